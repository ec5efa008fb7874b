"""python -m duo_jax.serve --model smollm2-135m --pattern default   (OpenAI-compatible server on localhost)"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax.numpy as jnp

from duo_jax.errors import HelpFormatter, integer_argument

port = integer_argument("a port number in [0, 65535]", 0, 65535)
positive = integer_argument("a positive integer", 1)
non_negative = integer_argument("an integer >= 0", 0)


def mebibytes(text: str) -> float:
    """An argparse type: a positive, finite number of MiB (whose bytes are a finite number too)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of MiB, got {text!r}")
    if not math.isfinite(value * 2**20):
        raise argparse.ArgumentTypeError(f"must be a number of MiB whose bytes a float holds, got {text!r}")
    return value


def host_names(text: str) -> list[str]:
    """An argparse type: comma-separated Host names, at least one (none would refuse every request)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"must name at least one Host ('*': any), got {text!r}: every request, /health included, would get 421"
        )
    return names


def main(argv=None) -> int:
    from duo_jax.serve.protocol import DEFAULT_MAX_REQUEST_BYTES, LOCAL_HOSTS, default_hosts
    from duo_jax.serve.scheduler import MIXED

    parser = argparse.ArgumentParser(prog="python -m duo_jax.serve", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="config name (see configs/), HF directory or .gguf")
    parser.add_argument(
        "--pattern", default=None, help="DuoAttention head pattern ('default': the model's); none: full attention"
    )
    parser.add_argument(
        "--sparsity", type=float, default=None, help="fraction of streaming heads of --pattern's (default 0.5)"
    )
    parser.add_argument(
        "--sink", type=non_negative, default=None, help="attention-sink tokens of a streaming head (with --pattern; 64)"
    )
    parser.add_argument(
        "--recent", type=positive, default=None, help="recent tokens of a streaming head (with --pattern; 256)"
    )
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence at most (prompt + new)")
    parser.add_argument("--page-size", type=int, default=128, help="tokens per page of the retrieval page pool")
    parser.add_argument("--kv-memory-mb", type=mebibytes, default=512, help="memory of the retrieval page pool")
    parser.add_argument("--slots", type=positive, default=8, help="sequences per step")
    parser.add_argument(
        "--chunk", type=positive, default=128, help="prefill tokens per sequence per step (at most the context)"
    )
    parser.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt whole (no shared pages)")
    parser.add_argument(
        "--prefix-snapshots",
        type=int,
        default=32,
        help="streaming-head states kept for prefix reuse (duo; least recently used dropped)",
    )
    parser.add_argument(
        "--mixed",
        default="split",
        choices=MIXED,
        help="steps with prefill beside decode: split (a decode step, then one prompt chunk alone) "
        "or padded (one [slots, chunk] step)",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the weights' and cache's dtype"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8000, help="TCP port (0: any free one)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("DUO_JAX_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $DUO_JAX_API_KEY; unset: none)",
    )
    parser.add_argument(
        "--allowed-hosts",
        type=host_names,
        default=None,
        help="comma-separated Host names accepted ('*': any); default: the local names "
        f"({', '.join(LOCAL_HOSTS)}) when --host is a loopback address, else any",
    )
    parser.add_argument(
        "--allowed-origins", default=None, help="comma-separated origins granted CORS (browser pages); default: none"
    )
    parser.add_argument(
        "--max-request-bytes",
        type=positive,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted (413 beyond, before reading it all)",
    )
    parser.add_argument(
        "--max-queued",
        type=positive,
        default=256,
        help="requests that may wait for a slot; beyond, a 429 with Retry-After",
    )
    parser.add_argument(
        "--no-warm-up", action="store_true", help="report ready at once instead of compiling the serving shapes first"
    )
    args = parser.parse_args(argv)
    windows = [flag for flag, value in (("--sink", args.sink), ("--recent", args.recent)) if value is not None]
    if windows and args.pattern is None:  # full attention has no streaming heads: they would be ignored
        parser.error(f"{' and '.join(windows)} set the streaming heads' window: pass --pattern (e.g. default) with it")

    try:
        import uvicorn
    except ImportError:
        print("the server needs the 'serve' extra: pip install 'duo-jax[serve]'", file=sys.stderr)
        return 2
    import duo_jax
    from duo_jax.engine import Engine
    from duo_jax.errors import DuoJaxError
    from duo_jax.generation import build_method
    from duo_jax.methods.paged import paged
    from duo_jax.serve.scheduler import Scheduler, page_bytes, pages_for_memory
    from duo_jax.serve.server import Server

    try:
        model = duo_jax.load(args.model, getattr(jnp, args.dtype))
        context = min(args.context, model.config.max_position_embeddings)
        if context < args.context:  # no request may pass the model's positions: no page table wider than that
            print(
                f"note: --context {args.context} is past {args.model}'s {context} positions; sequences hold at most "
                f"{context} tokens",
                file=sys.stderr,
            )
        method = build_method(
            model.config,
            None,
            context=context,
            pattern=args.pattern,
            sparsity=args.sparsity,
            sink=args.sink,
            recent=args.recent,
        )
        pages = pages_for_memory(
            paged(method, page_size=args.page_size),
            int(args.kv_memory_mb * 2**20),
            model.params.dtype,
            slots=args.slots,
        )
        method = paged(method, page_size=args.page_size, num_pages=pages)
        scheduler = Scheduler(
            Engine.of(model),
            method,
            slots=args.slots,
            chunk=args.chunk,
            mixed=args.mixed,
            prefix_cache=not args.no_prefix_cache,
            prefix_snapshots=args.prefix_snapshots,
            detokenize=None if model.tokenizer is None else model.tokenizer.decode,
            max_queued=args.max_queued,
        )
        hosts = default_hosts(args.host) if args.allowed_hosts is None else args.allowed_hosts
        server = Server(
            scheduler,
            model,
            args.model,
            warm_up=not args.no_warm_up,
            api_key=args.api_key or None,
            allowed_hosts=hosts,
            max_request_bytes=args.max_request_bytes,
            allowed_origins=args.allowed_origins.split(",") if args.allowed_origins else None,
        )
    except DuoJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if scheduler.pool_limit < scheduler.sequence_limit:  # /v1/models then reports the pool's limit
        full = -(-(scheduler.sequence_limit - 1) // args.page_size) * page_bytes(method, model.params.dtype)
        print(
            f"note: --kv-memory-mb {args.kv_memory_mb:g} holds {pages} page{'s' * (pages > 1)} of {args.page_size} "
            f"tokens: a request holds at most {scheduler.pool_limit} tokens (prompt + new), not the context's "
            f"{scheduler.sequence_limit}; --kv-memory-mb {math.ceil(full / 2**20)} holds one of the full context",
            file=sys.stderr,
        )
    print(
        f"serving {args.model} ({method.name}, context {context}, {pages} pages of {args.page_size} tokens, "
        f"{args.slots} slots) on http://{args.host}:{args.port}",
        file=sys.stderr,
    )
    web = uvicorn.Server(uvicorn.Config(server.app, host=args.host, port=args.port, log_level="info"))
    server.on_fatal = lambda: setattr(web, "should_exit", True)  # a supervisor restarts a process that exits
    web.run()
    if server.failed is not None:
        print(f"error: the scheduler stopped ({server.failed})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generate text with DuoAttention from the command line.

    python infer.py --model smollm2-135m --prompt "The capital of France is"     # chat: an instruct model
    python infer.py --model smollm2-135m --no-chat --prompt "The capital of France is"   # raw continuation
    python infer.py --model llama3-8b --pattern default --sparsity 0.5 --prompt-file book.txt
    python infer.py --model llama3-8b --pattern default --mesh model=8 --prompt-file book.txt   # 8 devices
    python infer.py --model llama3-8b --mesh data=2,model=8 --distributed --prompt-file book.txt  # on each of 2 hosts

`generate` here is `duo_jax.generate`: `infer.generate(model, prompts, ...)` from your own code.
"""

from __future__ import annotations

import argparse
import functools
import sys

from duo_jax.distributed import add_launch_options, initialize_from_args
from duo_jax.errors import DuoJaxError, HelpFormatter, read_user_text
from duo_jax.generation import generate, validate_options
from duo_jax.methods import METHODS, describe, entry

__all__ = ["generate", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"KV-cache methods (--method):\n{describe()}",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m", help="config name (see configs/), HF directory or .gguf")
    parser.add_argument(
        "--method",
        choices=METHODS,
        default=None,
        help="KV-cache method, listed below (default: duo when --pattern is given, else full)",
    )
    parser.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        help="tokens kept (infinigen: fetched) per KV head on average; required by the methods below that evict "
        "or select tokens; duo picks its sparsity from it",
    )
    parser.add_argument(
        "--scores",
        default=None,
        help="HeadKV head scores for headkv / duo_headkv: a folder / .tsv, or 'default' (the model's)",
    )
    parser.add_argument(
        "--pattern",
        default=None,
        help="head pattern: a directory / full_attention_heads.tsv, or 'default' for the model's own; "
        "omitted: full attention",
    )
    parser.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="fraction of streaming heads of the head pattern (default 0.5; 1.0: StreamingLLM); needs --pattern",
    )
    parser.add_argument(
        "--sink",
        type=int,
        default=None,
        help="attention-sink tokens kept by streaming heads (duo: 64, streaming_llm: 4)",
    )
    parser.add_argument("--recent", type=int, default=None, help="recent tokens kept by streaming heads (256)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="file holding the prompt text")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt as one user message in the model's chat template (default: on for "
        "models with a template whose name says instruct / chat); --no-chat sends the raw text",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=512, help="prompt tokens per prefill step")
    parser.add_argument(
        "--streaming-chunk",
        type=int,
        default=None,
        metavar="N",
        help="duo: the streaming heads see a prefill step longer than N (--chunk-size a multiple of N) as steps of "
        "N, so the output is that of --chunk-size N (docs/methods.md)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mesh",
        default=None,
        help="generate on a device mesh 'data=A,model=B' (A x B = the devices; one prompt: data=1): "
        "weights tensor-parallel over model, the retrieval cache split along its capacity; "
        "methods full and duo",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="weights and cache dtype; auto: float32 on CPU (no fast bf16 matmuls), else bfloat16",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=["int8", "int4"],
        default=None,
        help="quantized KV cache (every method; on --mesh: full and duo); default: the model's dtype",
    )
    parser.add_argument("--weights", choices=["int8"], default=None, help="int8 weights (per output channel)")
    add_launch_options(parser)  # a --mesh over the devices of several hosts
    return parser


def _check_windows(method: str | None, pattern: str | None, sink: int | None, recent: int | None) -> None:
    """Refuse --sink / --recent for full attention (no --pattern, no --method), which has no streaming heads:
    generate would run without them."""
    name = method or ("full" if pattern is None else "duo")
    given = [option for option, value in (("--sink", sink), ("--recent", recent)) if value is not None]
    if given and not entry(name).options:
        windowed = "|".join(m for m in METHODS if all(option[2:] in entry(m).windows for option in given))
        raise DuoJaxError(
            f"{'/'.join(given)} {'apply' if len(given) > 1 else 'applies'} to streaming heads, and method {name} "
            f"(full attention) has none: pass --pattern, or --method {windowed}"
        )


def _prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from --prompt or --prompt-file, refused when empty (with the chat template, an empty prompt
    would be an empty user message the model replies to)."""
    if prompt is not None:
        if not prompt:
            raise DuoJaxError("--prompt is empty: pass the prompt text")
        return prompt
    text = read_user_text(prompt_file, hint=" (--prompt-file)")
    if not text:
        raise DuoJaxError(f"--prompt-file {prompt_file} is empty: pass a file holding the prompt text")
    return text


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    import jax
    import jax.numpy as jnp

    import duo_jax
    from duo_jax import sharding
    from duo_jax.chat import is_chat_model

    try:
        initialize_from_args(args)  # before anything touches the devices
        if jax.process_count() > 1 and args.mesh is None:
            raise DuoJaxError(
                f"this is one of {jax.process_count()} processes but no --mesh spans them: each would generate alone "
                f"on its own devices; pass --mesh data=A,model=B over all {jax.device_count()} devices"
            )
    except DuoJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dtype == "auto":
        args.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"

    try:
        validate_options(
            sparsity=args.sparsity,
            sink=args.sink,
            recent=args.recent,
            max_new_tokens=args.max_new_tokens,
            chunk_size=args.chunk_size,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            impl="auto",
        )
        _check_windows(args.method, args.pattern, args.sink, args.recent)
        mesh = (
            None
            if args.mesh is None
            else sharding.make_generation_mesh(**sharding.parse_mesh(args.mesh, sharding.GENERATION_AXES))
        )
        text = _prompt_text(args.prompt, args.prompt_file)
        # On a mesh, each device reads its own slices of the weights: one copy of them, already where the steps run.
        shardings = None if mesh is None else functools.partial(sharding.tensor_parallel_shardings, mesh=mesh)
        model = duo_jax.load(args.model, dtype=jnp.dtype(args.dtype), weights=args.weights, shardings=shardings)
        chat = is_chat_model(model) if args.chat is None else args.chat
        options = dict(
            kv_budget=args.kv_budget, scores=args.scores, kv_dtype=args.kv_dtype, streaming_chunk=args.streaming_chunk
        )
        options = {k: v for k, v in options.items() if v is not None}
        out = generate(
            model,
            text,
            method=args.method,
            pattern=args.pattern,
            sparsity=args.sparsity,
            sink=args.sink,
            recent=args.recent,
            max_new_tokens=args.max_new_tokens,
            chunk_size=args.chunk_size,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            chat=chat,
            mesh=mesh,
            **options,
        )
    except (duo_jax.DuoJaxError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() != 0:  # several processes: each ran the same generation, the first prints it
        return 0
    print(out.text[0] if chat else text + out.text[0])  # chat: the reply; raw: the prompt and its continuation
    s = out.stats
    heads = f"retrieval heads {s['retrieval_heads']}/{s['kv_heads']} | " if "retrieval_heads" in s else ""
    print(
        f"\n{s['method']}{' | chat' if chat else ''} | prompt {s['prompt_tokens'][0]} tokens | "
        f"prefill {s['prefill_s']:.2f} s | decode "
        f"{s['decode_steps']} steps in {s['decode_s']:.2f} s ({s['decode_tokens_per_s']:.1f} tok/s) | "
        f"compile {s['compile_s']:.1f} s\n{heads}KV cache {s['cache_bytes'] / 2**20:.2f} MiB "
        f"(full attention: {s['full_cache_bytes'] / 2**20:.2f} MiB)",
        file=sys.stderr,
    )
    if "mesh" in s:
        print(
            f"mesh {s['mesh']} | per device: weights {s['device_weight_bytes'] / 2**20:.2f} MiB, "
            f"KV cache {s['device_cache_bytes'] / 2**20:.2f} MiB",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

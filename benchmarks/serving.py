"""Serving: throughput and latency of requests with mixed prompt lengths arriving at a fixed rate, through the
continuous-batching scheduler (`duo_jax.serve.Scheduler`, paged cache), for full attention and DuoAttention,
under three policies:

  continuous   requests join the running batch between steps as they arrive (`slots` sequences per step)
  one-by-one   one slot: each request runs alone, the others wait in the queue (FIFO)
  static       a batch of up to `slots` arrived requests runs to its end before the next batch starts

`--mixed` picks how a step runs prefill beside decoding slots (the scheduler's `mixed`: "split", a decode
step then one prompt chunk alone; "padded", one [slots, chunk] step), both for a comparison (rows
"continuous-split", "continuous-padded", "static-split", ...: a static batch's shorter prompts decode while
the longer ones still prefill).

Prompts are windows of real prose (the evaluation half of the Paul Graham essays) of lengths drawn uniformly
from [--min-len, --max-len], each starting at its own offset (by default no shared prefix, so prefix reuse stays
idle; `--shared-prefix N` starts every prompt with the same N tokens, `--no-prefix-cache` turns reuse off); request
i arrives at i / --rate seconds. Before the clock starts, a few short requests through a scheduler of the
same shape compile its steps (`warm_up`; for duo, also the streaming snapshot of prefix reuse). Reported per
(method, policy): generated tokens/s over the wall time from the first arrival to the last token, time to
first token (TTFT, from arrival) p50 / p90 / p99, time per output token after the first (TPOT) p50 / p90, the
scheduler's steps, its compiled calls and the positions they computed (batch x T summed, padding included),
the peak of retrieval pages in use and the cache bytes that peak holds (pages + every slot's streaming rows +
block tables) against the contiguous cache `generate` would reserve for the same batch (`slots` sequences of
the longest request's capacity).

    python benchmarks/serving.py                                  # 32 requests, 256-4096 tokens, 32 new
    python benchmarks/serving.py --requests 8 --min-len 128 --max-len 512 --max-new-tokens 8 --rate 1
    python benchmarks/serving.py --mixed split padded             # both mixed-step policies side by side
"""

from __future__ import annotations

import dataclasses
import sys
import time

import common
import numpy as np

POLICIES = ("continuous", "one-by-one", "static")


def prompts(model, args) -> list[list[int]]:
    """`args.requests` prompts of real prose, lengths uniform in [min_len, max_len], distinct offsets."""
    from duo_jax.data.haystack import EVALUATION_HAYSTACK, haystack_tokens
    from duo_jax.eval.niah import bos_id

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.requests)
    stride = 997  # not a multiple of any page size: no two prompts share a page
    end = args.max_len + stride * args.requests
    text = haystack_tokens(model.tokenizer, EVALUATION_HAYSTACK, end + args.shared_prefix)
    head = ([] if bos_id(model.tokenizer) is None else [bos_id(model.tokenizer)]) + text[end:][: args.shared_prefix]
    return [head + text[i * stride : i * stride + n - len(head)] for i, n in enumerate(lengths)]


def drive(scheduler, requests, arrivals, policy: str) -> dict:
    """Submit `requests` at their `arrivals` (s) under `policy`, step until all end; timings and peak pages."""
    from tqdm.auto import tqdm

    pending, first, last, peak = list(range(len(requests))), {}, {}, 0
    done = tqdm(total=len(requests), desc=policy, unit="request", leave=False)

    def on_token(request, token):
        if token is None:
            last[request.id] = time.perf_counter()
            done.update()
        else:
            first.setdefault(request.id, time.perf_counter())

    for r in requests:
        r.on_token = on_token
    start = time.perf_counter()
    while pending or not scheduler.idle:
        now = time.perf_counter() - start
        arrived = [i for i in pending if arrivals[i] <= now]
        if policy == "static":
            full_batch = len(arrived) >= scheduler.slots or len(arrived) == len(pending)
            arrived = arrived[: scheduler.slots] if scheduler.idle and arrived and full_batch else []
        for i in arrived:
            scheduler.submit(requests[i])
            pending.remove(i)
        if scheduler.step():
            peak = max(peak, scheduler.pages_in_use())
        else:
            time.sleep(0.002)
    done.close()
    ttft = [first[r.id] - start - a for r, a in zip(requests, arrivals)]
    tpot = [(last[r.id] - first[r.id]) / (len(r.tokens) - 1) for r in requests if len(r.tokens) > 1]
    tokens = sum(len(r.tokens) for r in requests)
    wall = max(last.values()) - start - min(arrivals)
    return dict(
        wall_s=wall,
        tokens=tokens,
        tokens_per_s=tokens / wall,
        ttft_s=_percentiles(ttft, (50, 90, 99)),
        tpot_ms=_percentiles([1e3 * t for t in tpot], (50, 90)),
        peak_pages=peak,
        steps=scheduler.counters["steps"],
        calls=scheduler.counters["calls"],
        row_tokens=scheduler.counters["row_tokens"],
        preemptions=scheduler.counters["preemptions"],
        prompt_tokens=scheduler.counters["prompt_tokens"],
        prefix_tokens=scheduler.counters["prefix_tokens"],
    )


def warm_up(scheduler, ids: list[int]) -> None:
    """Compile outside the clock whatever the run will: the steps (every slot prefilling, then one request
    decoding while another prefills: a mixed step's calls), sampling and (duo) a streaming snapshot. Prompts of
    one reuse unit + 1 tokens, each a rotation of `ids` (no prefix shared, so each is prefilled)."""
    from duo_jax.serve import Request

    unit = scheduler.reuse_unit
    prompt = lambda i: ((ids[i:] + ids[:i]) * (unit // len(ids) + 2))[: unit + 1]
    for i in range(scheduler.slots):
        scheduler.submit(Request(prompt(i), max_tokens=2, stop_at_eos=False))
    scheduler.run()
    first = scheduler.submit(Request(prompt(scheduler.slots), max_tokens=3, stop_at_eos=False))
    while not first.tokens:
        scheduler.step()
    scheduler.submit(Request(prompt(scheduler.slots + 1), max_tokens=2, stop_at_eos=False))
    scheduler.run()


def _percentiles(values, ps) -> dict:
    return {f"p{p}": float(np.percentile(values, p)) for p in ps}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "serving")
    common.add_model_args(p, peer=False)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-len", type=int, default=256, help="shortest prompt (tokens)")
    p.add_argument("--max-len", type=int, default=4096, help="longest prompt (tokens)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request (greedy, no EOS)")
    p.add_argument("--rate", type=float, default=0.5, help="requests per second")
    p.add_argument("--slots", type=int, default=8, help="sequences per step (continuous and static)")
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--methods", nargs="+", choices=("full", "duo"), default=["full", "duo"])
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument(
        "--mixed",
        nargs="+",
        choices=("split", "padded"),
        default=["split"],
        help="continuous: how mixed steps run (the scheduler's `mixed`); two: both, side by side",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens every prompt starts with (a shared document): exercises prefix reuse",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt whole")
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len or args.requests < 1 or args.max_new_tokens < 2 or args.rate <= 0:
        p.error("need 1 <= --min-len <= --max-len, --requests >= 1, --max-new-tokens >= 2 and --rate > 0")
    if not 0 <= args.shared_prefix < args.min_len - 1:
        p.error("--shared-prefix must be >= 0 and shorter than --min-len - 1")

    common.setup_threads(args)
    from duo_jax.engine import Engine
    from duo_jax.methods.paged import paged
    from duo_jax.serve import Request, Scheduler

    model, pattern = common.load(args)
    engine = Engine.of(model)
    ids = prompts(model, args)
    arrivals = [i / args.rate for i in range(args.requests)]
    context = max(map(len, ids)) + args.max_new_tokens
    itemsize = np.dtype(args.dtype).itemsize
    results, rows = {}, []
    headers = [
        "method",
        "policy",
        "slots",
        "tok/s",
        "TTFT p50 s",
        "TTFT p90 s",
        "TTFT p99 s",
        "TPOT p50 ms",
        "TPOT p90 ms",
        "steps",
        "calls",
        "row tokens",
        "peak pages",
        "paged MiB at peak",
        "contiguous MiB",
        "prefilled",
        "reused",
    ]
    notes = [
        f"model {model.config.name} ({args.dtype}); {args.requests} requests, prompts {args.min_len}-"
        f"{args.max_len} tokens (longest {max(map(len, ids))}), {args.max_new_tokens} new tokens each, "
        f"{args.rate} requests/s; chunk {args.chunk_size}, pages of {args.page_size}; duo sparsity "
        f"{args.sparsity} (sink {args.sink}, recent {args.recent}); shared prefix {args.shared_prefix} tokens, "
        f"prefix cache {'off' if args.no_prefix_cache else 'on'}"
    ]

    def write():  # after every run (the table so far), so a long sweep that is stopped keeps what it measured
        common.write_result(
            args.out,
            "serving",
            title="Serving: continuous batching vs one-by-one vs static batches",
            headers=headers,
            rows=rows,
            notes=notes,
            data=dict(
                args={k: str(v) for k, v in vars(args).items() if k != "out"},
                prompt_lengths=list(map(len, ids)),
                results=results,
            ),
        )

    for name in args.methods:
        contiguous = common.mode(name, model, pattern, args, context).build(model.config, context, model=model)
        base = paged(contiguous, page_size=args.page_size)
        runs = [
            (policy, mixed)
            for policy in args.policies
            for mixed in (args.mixed[:1] if policy == "one-by-one" else args.mixed)
        ]  # one slot: never mixed
        for policy, mixed in runs:
            slots = 1 if policy == "one-by-one" else args.slots
            method = dataclasses.replace(base, num_pages=slots * base.pages_per_sequence)  # never short
            warm_up(Scheduler(engine, method, slots=slots, chunk=args.chunk_size, mixed=mixed), ids[0])
            scheduler = Scheduler(
                engine, method, slots=slots, chunk=args.chunk_size, mixed=mixed, prefix_cache=not args.no_prefix_cache
            )
            if policy != "one-by-one" and len(args.mixed) > 1:
                policy = f"{policy}-{mixed}"
            requests = [Request(list(x), max_tokens=args.max_new_tokens, stop_at_eos=False) for x in ids]
            print(f"{name} / {policy}: {args.requests} requests...", file=sys.stderr, flush=True)
            r = drive(scheduler, requests, arrivals, policy)
            r["paged_bytes_at_peak"] = dataclasses.replace(
                method, num_pages=max(r["peak_pages"], 1)
            ).expected_cache_bytes(slots, itemsize)
            r["contiguous_bytes"] = contiguous.expected_cache_bytes(slots, itemsize)
            results[f"{name}/{policy}"] = r
            rows.append(
                [
                    name,
                    policy,
                    slots,
                    r["tokens_per_s"],
                    r["ttft_s"]["p50"],
                    r["ttft_s"]["p90"],
                    r["ttft_s"]["p99"],
                    r["tpot_ms"]["p50"],
                    r["tpot_ms"]["p90"],
                    r["steps"],
                    r["calls"],
                    r["row_tokens"],
                    r["peak_pages"],
                    r["paged_bytes_at_peak"] / 2**20,
                    r["contiguous_bytes"] / 2**20,
                    r["prompt_tokens"],
                    r["prefix_tokens"],
                ]
            )
            write()
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))

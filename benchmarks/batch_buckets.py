"""Varied batch sizes through `duo_jax.generate`: the executables compiled and the seconds spent over one sequence of
calls, full attention and DuoAttention. With batch buckets (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) a batch of 5 runs the
executables of 6; without them every new batch size compiles its prefill and decode steps. The padding rows cost
a prefill of the shortest prompt each and, without stop tokens (as here), their decode steps: the last pass over
the sizes, every executable already compiled, shows what they cost.

Prompts are real prose of 150-240 tokens (one prefill chunk and one capacity bucket: a longer one would move the
capacity to its next bucket and compile for that), 8 new tokens, greedy. The
script uses only `generate` and its stats, so it also runs on a checkout from before the buckets (copy it there).

    python benchmarks/batch_buckets.py                     # SmolLM2-135M fp32, sizes 3 5 2 7 6 1 8 4, twice
"""

from __future__ import annotations

import sys
import time

import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "batch_buckets")
    common.add_model_args(p, peer=False)
    p.add_argument("--sizes", type=int, nargs="+", default=[3, 5, 2, 7, 6, 1, 8, 4], help="batch sizes, in order")
    p.add_argument("--passes", type=int, default=2, help="times the sizes run (the last pass is steady state)")
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args(argv)
    common.setup_threads(args)

    import jax
    import numpy as np

    import duo_jax

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: compiles.append(secs) if event.endswith("backend_compile_duration") else None
    )
    model, pattern = common.load(args)
    rng = np.random.default_rng(0)
    prose = common.text_prompt(model, 240 * max(args.sizes))
    rows, data = [], {}
    for mode in ("full", "duo"):
        kwargs = dict(
            max_new_tokens=args.new_tokens,
            chunk_size=args.chunk_size,
            stop_at_eos=False,
            **common.mode(mode, model, pattern, args, 512).generate_kwargs(),
        )
        calls = []
        for pass_ in range(args.passes):
            for size in args.sizes:
                lengths = rng.integers(150, 241, size)
                starts = np.cumsum([0, *lengths[:-1]])
                prompts = [prose[s : s + n] for s, n in zip(starts, lengths)]
                before, start = len(compiles), time.perf_counter()
                out = duo_jax.generate(model, prompts, **kwargs)
                calls.append(
                    dict(
                        pass_=pass_,
                        batch=size,
                        rows=out.stats.get("batch_rows", size),
                        wall_s=time.perf_counter() - start,
                        compiles=len(compiles) - before,
                        compile_s=sum(compiles[before:]),
                        prefill_s=out.stats["prefill_s"],
                        decode_s=out.stats["decode_s"],
                    )
                )
        last = [c for c in calls if c["pass_"] == args.passes - 1]
        rows.append(
            [
                mode,
                len(calls),
                sorted({c["rows"] for c in calls}),
                sum(c["compiles"] for c in calls),
                sum(c["compile_s"] for c in calls),
                sum(c["wall_s"] for c in calls),
                sum(c["wall_s"] for c in last),
                sum(c["batch"] for c in last) * args.new_tokens / sum(c["wall_s"] for c in last),
            ]
        )
        data[mode] = calls
    headers = [
        "mode",
        "calls",
        "batch shapes run",
        "XLA compiles",
        "compile s",
        "all calls s",
        "last pass s",
        "last pass tokens/s",
    ]
    common.write_result(
        args.out,
        "batch_buckets",
        title=f"generate(): batch sizes {' '.join(map(str, args.sizes))} x {args.passes}",
        headers=headers,
        rows=rows,
        data=dict(args={k: str(v) for k, v in vars(args).items()}, calls=data),
        notes=[
            f"model {model.config.name} ({args.dtype}), prompts 150-240 tokens, {args.new_tokens} new tokens, chunk "
            f"{args.chunk_size}, duo sparsity {args.sparsity}"
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))

"""Whole-prompt prefill of the eviction methods (H2O, TOVA) vs full attention: the protocol the evaluations run
them under (the prompt in one chunk, compressed once at its end), so its time is what a RULER or LongBench run
spends per prompt.

Each mode prefills the same prose prompt of L tokens in one chunk and decodes --new-tokens tokens greedily; H2O
and TOVA keep --kv-budget of the prompt's tokens per KV head. Times exclude compilation; "vs full" is the mode's
prefill time over full attention's. The generated tokens are compared with full attention's (equal ones mean the
kept tokens carry the answer; they need not be equal).

    python benchmarks/eviction_prefill.py                       # SmolLM2-135M, fp32, 2k / 4k
    python benchmarks/eviction_prefill.py --lengths 4096 --repeats 3
"""

from __future__ import annotations

import common

MODES = ("full", "tova", "h2o")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "eviction_prefill")
    p.add_argument("--model", default="smollm2-135m", help="config name (see configs/), HF directory or .gguf")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and cache")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="prompt lengths (tokens)")
    p.add_argument("--kv-budget", type=float, default=0.25, help="H2O / TOVA: kept fraction of the prompt's tokens")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens decoded after the prefill")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode and length (the median is reported)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 1:
        p.error("--repeats and --new-tokens must be >= 1")
    if not 0 < args.kv_budget <= 1:
        p.error(f"--kv-budget is a fraction in (0, 1], got {args.kv_budget}")

    import jax.numpy as jnp
    import numpy as np
    from tqdm.auto import tqdm

    import duo_jax
    from duo_jax.eval.modes import mode_settings

    model = duo_jax.load(args.model, dtype=jnp.dtype(args.dtype))
    runs = {n: {m: [] for m in MODES} for n in args.lengths}
    with tqdm(total=len(args.lengths) * len(MODES) * args.repeats, desc="prefill", unit="run") as bar:
        for length in args.lengths:
            ids = common.text_prompt(model, length)
            context = length + args.new_tokens
            for _ in range(args.repeats):
                for mode in MODES:
                    bar.set_postfix_str(f"{mode} @ {length}")
                    budget = None if mode == "full" else max(1, int(args.kv_budget * length))
                    settings = mode_settings(  # (duo's pattern and window: unused by these modes)
                        mode, model.config, None, sparsity=0.5, sink=0, recent=1, context=context, kv_budget=budget
                    )
                    runs[length][mode].append(
                        common.time_ours(model, ids, settings, new_tokens=args.new_tokens, chunk_size=length)
                    )
                    bar.update()

    def median(length, mode, key):
        return float(np.median([r[key] for r in runs[length][mode]]))

    rows = []
    for n in args.lengths:
        full_tokens = runs[n]["full"][0]["tokens"]
        for mode in MODES:
            rows.append(
                [
                    n,
                    mode,
                    median(n, mode, "ttft_s"),
                    common.ratio(median(n, mode, "ttft_s"), median(n, "full", "ttft_s")),
                    median(n, mode, "decode_ms"),
                    median(n, mode, "compile_s"),
                    runs[n][mode][0]["tokens"] == full_tokens,
                ]
            )
    headers = ["prompt", "mode", "prefill s", "vs full", "decode ms / token", "compile s", "tokens = full's"]
    notes = [
        f"model {model.config.name} ({args.dtype}), the prompt in one chunk, H2O / TOVA at {args.kv_budget:g} of "
        f"its tokens per KV head, median of {args.repeats} run(s), interleaved across modes"
    ]
    common.write_result(
        args.out,
        "eviction_prefill",
        title="Eviction methods: whole-prompt prefill (batch 1)",
        headers=headers,
        rows=rows,
        data=dict(
            args={k: str(v) for k, v in vars(args).items()},
            runs={str(n): {m: r for m, r in by_mode.items()} for n, by_mode in runs.items()},
        ),
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run(main))

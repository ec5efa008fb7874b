"""Per-call overhead of `duo_jax.generate`: one new token after a 1k-token prompt, the first call on a model
(weights prepared, steps compiled) vs the next calls (the model's engine and executables reused), vs the
prefill alone (`stats["prefill_s"]` of the same call), for full attention and DuoAttention.

The third call uses a prompt of another length in the same buckets (prefill chunk, capacity): it must cost
what the second costs. The script uses only `duo_jax.generate` and its stats, so it also runs on older
checkouts (the before / after comparison in BENCHMARKS.md).

    python benchmarks/call_overhead.py                    # SmolLM2-135M fp32, prompt 1024 (and 1000) tokens
"""

from __future__ import annotations

import sys
import time

import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "call_overhead")
    common.add_model_args(p, peer=False)
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the first two calls")
    p.add_argument("--other-prompt", type=int, default=1000, help="prompt tokens of the third call (same buckets)")
    args = p.parse_args(argv)
    common.setup_threads(args)

    import duo_jax

    model, pattern = common.load(args)
    rows, data = [], {}
    for mode in ("full", "duo"):
        kwargs = dict(
            max_new_tokens=1,
            chunk_size=args.chunk_size,
            stop_at_eos=False,
            context=2048,
            **common.mode(mode, model, pattern, args, 2048).generate_kwargs(),
        )
        calls = []
        for length in (args.prompt, args.prompt, args.other_prompt):
            ids = common.text_prompt(model, length)
            start = time.perf_counter()
            out = duo_jax.generate(model, [ids], **kwargs)
            calls.append(
                dict(
                    wall_s=time.perf_counter() - start,
                    prefill_s=out.stats["prefill_s"],
                    compile_s=out.stats["compile_s"],
                    decode_s=out.stats["decode_s"],
                    prepare_s=out.stats.get("prepare_s"),
                )
            )
        first, second, third = calls
        overhead = second["wall_s"] - second["prefill_s"] - second["decode_s"]
        rows.append(
            [
                mode,
                first["wall_s"],
                second["wall_s"],
                third["wall_s"],
                second["prefill_s"],
                overhead,
                common.ratio(first["wall_s"], second["wall_s"]),
                common.ratio(second["wall_s"], second["prefill_s"]),
            ]
        )
        data[mode] = calls
    headers = [
        "mode",
        "1st call s",
        "2nd call s",
        "3rd call (other length) s",
        "prefill s (2nd)",
        "2nd: outside prefill + decode s",
        "1st / 2nd",
        "2nd / prefill",
    ]
    common.write_result(
        args.out,
        "call_overhead",
        title=f"generate(): per-call overhead, 1 new token after {args.prompt} tokens",
        headers=headers,
        rows=rows,
        data=dict(args={k: str(v) for k, v in vars(args).items()}, calls=data),
        notes=[
            f"model {model.config.name} ({args.dtype}), context 2048, chunk {args.chunk_size}, "
            f"duo sparsity {args.sparsity}"
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))

"""Quality cost of a quantized KV cache: full and duo with the cache in the model's dtype, int8 and int4
(`duo_jax.quant`: absmax per token and head, bf16 scales, Hadamard-rotated), side by side on the same inputs.

--task perplexity: windows of --length tokens of the evaluation essays teacher-forced through the engine
(`duo_jax.eval.perplexity.engine_nll`): the first --prefix tokens as a prompt in prefill chunks, the rest one
decode step per token, so the decoded tokens read keys and values that went through the quantized cache.
--task niah: the needle-in-a-haystack grid (`duo_jax.eval.niah.run_niah`, the evaluation half of the essays)
at --lengths x --depths, once per KV dtype.

    python benchmarks/kv_quant.py                                   # SmolLM2, 2048 tokens, 1536 prompt
    python benchmarks/kv_quant.py --length 4096 --prefix 3584 --samples 4 --dtype bfloat16
    python benchmarks/kv_quant.py --task niah --lengths 1024 2048 --depths 0 0.5 1
"""

from __future__ import annotations

import sys

import common

KV_DTYPES = (None, "int8", "int4")
MODES = ("full", "duo")


def perplexity(model, pattern, args) -> tuple[list, list, dict]:
    import numpy as np

    from duo_jax.data.haystack import EVALUATION_HAYSTACK
    from duo_jax.eval.perplexity import engine_nll, text_windows

    tokens = text_windows(model, EVALUATION_HAYSTACK, args.length, args.samples)
    rows, results = [], {}
    for name in MODES:
        base = None
        for kv in KV_DTYPES:
            settings = common.mode(name, model, pattern, args, args.length, kv_dtype=kv)
            nll, cache = engine_nll(model, tokens, settings, chunk_size=args.chunk_size, prefix=args.prefix)
            prefill = float(np.exp(nll[:, : args.prefix - 1].mean()))
            decoded = float(np.exp(nll[:, args.prefix - 1 :].mean()))
            base = decoded if kv is None else base
            label = kv or args.dtype
            results[f"{name}/{label}"] = dict(
                mode=name, kv_dtype=label, cache_bytes=cache, prefill_ppl=prefill, decoded_ppl=decoded
            )
            rows.append(
                [name, label, f"{cache / 2**20:.2f}", f"{prefill:.3f}", f"{decoded:.3f}", f"{decoded / base - 1:+.2%}"]
            )
            print(rows[-1], flush=True)
    headers = ["mode", "KV cache", "cache MiB", "prompt ppl", "decoded ppl", "decoded vs unquantized"]
    return headers, rows, results


def niah(model, pattern, args) -> tuple[list, list, dict]:
    from duo_jax.eval.niah import run_niah

    longest = max(args.lengths)
    lengths = sorted(set(args.lengths))
    rows, results = [], {}
    for kv in KV_DTYPES:
        label = kv or args.dtype
        grid = run_niah(
            model,
            list(MODES),
            pattern=pattern,
            lengths=lengths,
            depths=args.depths,
            sparsity=args.sparsity,
            sink=args.sink,
            recent=args.recent,
            chunk_size=args.chunk_size,
            kv_dtype=kv,
            progress=False,
        )
        for name in MODES:
            r = grid["modes"][name]
            results[f"{name}/{label}"] = dict(
                mode=name,
                kv_dtype=label,
                accuracy=r["accuracy"],
                accuracy_by_length=r["accuracy_by_length"],
                accuracy_by_depth=r["accuracy_by_depth"],
                cache_bytes=r["cache_bytes"],
                cells=r["cells"],
            )
            rows.append(
                [
                    name,
                    label,
                    *[f"{r['accuracy_by_length'][n]:.0%}" for n in lengths],
                    f"{r['accuracy']:.0%}",
                    f"{r['cache_bytes'][longest] / 2**20:.2f}",
                ]
            )
            print(rows[-1], flush=True)
    rows.sort(key=lambda row: MODES.index(row[0]))  # full's three KV dtypes, then duo's
    headers = ["mode", "KV cache", *[f"acc @ {n}" for n in lengths], "accuracy", f"cache MiB @ {longest}"]
    return headers, rows, results


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "kv_quant")
    common.add_model_args(p, peer=False)
    p.add_argument("--task", choices=["perplexity", "niah"], default="perplexity")
    p.add_argument("--length", type=int, default=2048, help="perplexity: tokens per window")
    p.add_argument("--prefix", type=int, default=1536, help="perplexity: prompt tokens; the rest is decoded")
    p.add_argument("--samples", type=int, default=2, help="perplexity: windows (one batch)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="niah: context lengths")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.5, 1.0], help="niah: needle depths")
    args = p.parse_args(argv)
    common.setup_threads(args)

    model, pattern = common.load(args)
    if args.task == "perplexity":
        headers, rows, results = perplexity(model, pattern, args)
        title = (
            f"KV-cache quantization: perplexity of {model.config.name}, {args.samples} x {args.length} tokens "
            f"({args.prefix} prompt, the rest decoded)"
        )
    else:
        headers, rows, results = niah(model, pattern, args)
        title = (
            f"KV-cache quantization: NIAH of {model.config.name}, lengths {sorted(set(args.lengths))} x depths "
            f"{args.depths} (one batch per length; cache MiB per sequence)"
        )
    common.write_result(
        args.out,
        f"kv_quant_{args.task}" if args.task != "perplexity" else "kv_quant",
        title=title,
        headers=headers,
        rows=rows,
        data=dict(results=results, args={k: str(v) for k, v in vars(args).items()}),
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))

"""Quality cost of a quantized KV cache: perplexity of full and duo with the cache in the model's dtype, int8
and int4 (`duo_jax.quant`: absmax per token and head, bf16 scales), side by side on the same text.

Windows of --length tokens of the evaluation essays are teacher-forced through the engine
(`duo_jax.eval.perplexity.engine_nll`): the first --prefix tokens as a prompt in prefill chunks, the rest
one decode step per token, so the decoded tokens read keys and values that went through the quantized cache.

    python benchmarks/kv_quant.py                                   # SmolLM2, 2048 tokens, 1536 prompt
    python benchmarks/kv_quant.py --length 4096 --prefix 3584 --samples 4 --dtype bfloat16
"""

from __future__ import annotations

import dataclasses
import sys

import common

KV_DTYPES = (None, "int8", "int4")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "kv_quant")
    common.add_model_args(p, peer=False)
    p.add_argument("--length", type=int, default=2048, help="tokens per window")
    p.add_argument("--prefix", type=int, default=1536, help="prompt tokens; the rest is decoded")
    p.add_argument("--samples", type=int, default=2, help="windows (one batch)")
    args = p.parse_args(argv)
    common.setup_threads(args)

    import jax.numpy as jnp
    import numpy as np

    from duo_jax.data.haystack import EVALUATION_HAYSTACK
    from duo_jax.eval.perplexity import engine_nll, text_windows
    from duo_jax.generation import build_method

    model, pattern = common.load(args)
    tokens = text_windows(model, EVALUATION_HAYSTACK, args.length, args.samples)
    itemsize = jnp.dtype(model.params.dtype).itemsize
    rows, results = [], {}
    for name in ("full", "duo"):
        settings = common.mode(name, model, pattern, args, args.length)
        base = None
        for kv in KV_DTYPES:
            method = build_method(model.config, context=args.length, kv_dtype=kv, **settings.generate_kwargs())
            nll = engine_nll(model, tokens, dataclasses.replace(settings, instance=method),
                             chunk_size=args.chunk_size, prefix=args.prefix)
            prefill = float(np.exp(nll[:, : args.prefix - 1].mean()))
            decoded = float(np.exp(nll[:, args.prefix - 1:].mean()))
            base = decoded if kv is None else base
            label = kv or args.dtype
            cache = method.expected_cache_bytes(args.samples, itemsize)
            results[f"{name}/{label}"] = dict(mode=name, kv_dtype=label, cache_bytes=cache, prefill_ppl=prefill,
                                              decoded_ppl=decoded)
            rows.append([name, label, f"{cache / 2**20:.2f}", f"{prefill:.3f}", f"{decoded:.3f}",
                         f"{decoded / base - 1:+.2%}"])
            print(rows[-1], flush=True)
    common.write_result(args.out, "kv_quant",
                        title=f"KV-cache quantization: perplexity of {model.config.name}, {args.samples} x "
                              f"{args.length} tokens ({args.prefix} prompt, the rest decoded)",
                        headers=["mode", "KV cache", "cache MiB", "prompt ppl", "decoded ppl", "decoded vs unquantized"],
                        rows=rows, data=dict(results=results, args={k: str(v) for k, v in vars(args).items()}))
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))

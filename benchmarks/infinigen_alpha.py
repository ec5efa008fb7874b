"""InfiniGen's two approximations, one at a time: the alpha threshold and speculating from the previous layer.

Perplexity of --length tokens of the evaluation half of the Paul Graham essays, the first --prefix as the
prompt and the rest decoded one token per step (`duo_jax.eval.perplexity.engine_nll`), with InfiniGen (the
authors' Llama rules otherwise: layers 0-1 dense, Q-and-K partial channels) fetching at most --budget x
--length tokens per KV head per step, for each combination of
- alpha: the threshold (keep tokens whose speculated logit is within alpha of the max; the count is averaged
  over the layer's heads, then capped by the budget): 5 (the authors' Llama setting), 4 (their OPT setting),
  or inf (always the budget's top-k), and
- speculation from the previous layer's attention input (the original, `InfiniGen(lookahead=True)`) or from
  this layer's own partial query,
next to full attention on the same tokens.

    python benchmarks/infinigen_alpha.py
"""

from __future__ import annotations

import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "infinigen_alpha")
    p.add_argument("--model", default="smollm2-135m", help="config name (see configs/), HF directory or .gguf")
    p.add_argument("--length", type=int, default=2048, help="window (tokens)")
    p.add_argument("--prefix", type=int, default=1536, help="prompt tokens; the rest is decoded")
    p.add_argument("--budget", type=float, default=0.5, help="most tokens fetched per KV head, share of --length")
    p.add_argument("--alphas", type=float, nargs="+", default=[5.0, 4.0, float("inf")], help="thresholds")
    args = p.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np

    import duo_jax
    from duo_jax.data.haystack import EVALUATION_HAYSTACK
    from duo_jax.eval.modes import ModeSettings, mode_settings
    from duo_jax.eval.perplexity import engine_nll, text_windows

    model = duo_jax.load(args.model, dtype=jnp.float32)
    tokens = text_windows(model, EVALUATION_HAYSTACK, args.length, 1)
    budget = int(args.budget * args.length)

    def decoded_ppl(settings) -> float:
        nll, _ = engine_nll(model, tokens, settings, chunk_size=256, prefix=args.prefix)
        return float(np.exp(nll[:, args.prefix - 1 :].mean()))

    full = decoded_ppl(
        mode_settings("full", model.config, None, sparsity=0.5, sink=64, recent=256, context=args.length)
    )
    rows, results = [["full attention", "-", "-", full, 1.0]], []
    for lookahead in (True, False):
        for alpha in args.alphas:
            options = (("kv_budget", budget), ("alpha", alpha), ("lookahead", lookahead))  # one skew, computed once
            ppl = decoded_ppl(ModeSettings("infinigen", "infinigen", options, budget))
            speculation = "previous layer (original)" if lookahead else "this layer"
            rows.append(["infinigen", alpha, speculation, ppl, ppl / full])
            results.append(dict(alpha=alpha, lookahead=lookahead, decoded_ppl=ppl))
    common.write_result(
        args.out,
        "infinigen_alpha",
        title=f"InfiniGen on {model.config.name}: decoded perplexity",
        headers=["method", "alpha", "speculation from", "ppl (decoded)", "ppl / full"],
        rows=rows,
        data=dict(args={k: str(v) for k, v in vars(args).items()}, full_ppl=full, results=results),
        notes=[
            f"{args.length} tokens, prefix {args.prefix}, at most {budget} tokens fetched per KV head per step, fp32"
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run(main))

"""Decode latency: ms per new token and tokens/s at several contexts, DuoAttention vs full attention vs the
Hugging Face transformers peer (same weights from the same file, same dtype, same prompt, greedy).

A context of C tokens is a prompt of C - N tokens of real prose plus N generated tokens; the time per token
excludes the prefill (see benchmarks/common.py). Ratios are speed-ups (> 1: the first is faster).

    python benchmarks/decode.py                      # SmolLM2-135M, its shipped pattern, 2k / 4k / 8k
    python benchmarks/decode.py --pattern PATH --contexts 1024 2048 --new-tokens 16 --out results/benchmarks/decode
"""

from __future__ import annotations

import sys

import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "decode")
    common.add_model_args(p)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192], help="prompt + generated tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per run (N)")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode time is measured between the first and the last token)")

    common.setup_threads(args)
    from tqdm.auto import tqdm

    from duo_jax.eval import report

    model, pattern = common.load(args)
    peer = None if args.no_peer else common.Peer(model, args.dtype, single_thread=args.single_thread)
    systems = ["full", "duo"] + ([common.PEER] if peer else [])
    results = {}
    with tqdm(total=len(args.contexts) * len(systems), desc="decode", unit="run") as bar:
        for context in args.contexts:
            ids = common.text_prompt(model, context - args.new_tokens)
            results[context] = {}
            for system in systems:
                bar.set_postfix_str(f"{system} @ {context}")
                if system == common.PEER:
                    results[context][system] = peer.time(ids, new_tokens=args.new_tokens)
                else:
                    settings = common.mode(system, model, pattern, args, context)
                    results[context][system] = common.time_ours(
                        model, ids, settings, new_tokens=args.new_tokens, chunk_size=args.chunk_size
                    )
                bar.update()

    ms = {c: {s: r[s]["decode_ms"] for s in systems} for c, r in results.items()}
    peer_ms = {c: ms[c].get(common.PEER) for c in ms}
    rows = [
        [
            c,
            *[ms[c][s] for s in systems],
            *[1e3 / ms[c][s] for s in systems],
            common.ratio(ms[c]["full"], ms[c]["duo"]),
            common.ratio(peer_ms[c], ms[c]["full"]),
            common.ratio(peer_ms[c], ms[c]["duo"]),
        ]
        for c in args.contexts
    ]
    headers = [
        "context",
        *[f"{s} ms/tok" for s in systems],
        *[f"{s} tok/s" for s in systems],
        "duo vs full",
        f"full vs {common.PEER}",
        f"duo vs {common.PEER}",
    ]

    def plot(path):
        return report.line_plot(
            path,
            args.contexts,
            {s: [ms[c][s] for c in args.contexts] for s in systems},
            xlabel="context (tokens)",
            ylabel="ms per new token",
            logx=True,
            title=f"decode, {model.config.name} ({args.dtype}), batch 1",
        )

    notes = [
        f"model {model.config.name} ({args.dtype}), duo sparsity {args.sparsity} (sink {args.sink}, "
        f"recent {args.recent}), {args.new_tokens} new tokens per run, prefill chunk {args.chunk_size}"
        + (", single-threaded" if args.single_thread else "")
    ]
    if peer:
        notes.append(
            f"peer: transformers {__import__('transformers').__version__}, attention {peer.attention}, dynamic cache"
        )
    common.write_result(
        args.out,
        "decode",
        title="Decode: ms per new token (batch 1, greedy)",
        headers=headers,
        rows=rows,
        data=dict(args={k: str(v) for k, v in vars(args).items()}, results=results),
        plot=plot,
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))

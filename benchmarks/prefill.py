"""Prefill: time to first token at several prompt lengths, chunked DuoAttention vs chunked full attention vs
the Hugging Face transformers peer (same weights from the same file, same dtype, same prompt).

Ours prefills in chunks of --chunk-size tokens (`duo_jax.generate`, compilation excluded and reported
apart); the peer runs its whole prompt in one forward. Ratios are speed-ups (> 1: the first is faster).

    python benchmarks/prefill.py                     # SmolLM2-135M, its shipped pattern, 1k / 2k / 4k
    python benchmarks/prefill.py --pattern PATH --lengths 512 1024 --out results/benchmarks/prefill
    python benchmarks/prefill.py --one-chunk --no-peer   # beside each mode, its prompt in one chunk

With --one-chunk each mode also prefills its prompt as one chunk: full exactly so, duo with `streaming_chunk` =
--chunk-size, so that its streaming heads still see chunks of --chunk-size (the same output) while its retrieval
heads see the prompt whole.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "prefill")
    common.add_model_args(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths (tokens)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per system and length, interleaved across systems; the median TTFT is reported",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds of idle before every timed run: torch's OpenMP threads keep spinning a while "
        "after a forward and slowed the run after the peer's (ours at 2k: 0.89x -> 0.99x the "
        "peer with 1 s)",
    )
    p.add_argument(
        "--one-chunk",
        action="store_true",
        help="also time each mode with the prompt as one chunk (duo: streaming_chunk = --chunk-size, the same output)",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.settle < 0:
        p.error("--settle must be >= 0")

    common.setup_threads(args)
    import numpy as np
    from tqdm.auto import tqdm

    from duo_jax.eval import report

    model, pattern = common.load(args)
    peer = None if args.no_peer else common.Peer(model, args.dtype, single_thread=args.single_thread)
    one_chunk = ["full, one chunk", "duo, one chunk"] if args.one_chunk else []
    systems = ["full", "duo"] + one_chunk + ([common.PEER] if peer else [])
    runs = {n: {s: [] for s in systems} for n in args.lengths}
    with tqdm(total=len(args.lengths) * len(systems) * args.repeats, desc="prefill", unit="run") as bar:
        for length in args.lengths:
            ids = common.text_prompt(model, length)
            for _ in range(args.repeats):
                for system in systems:
                    bar.set_postfix_str(f"{system} @ {length}")
                    time.sleep(args.settle)
                    if system == common.PEER:
                        runs[length][system].append(peer.time(ids, new_tokens=1)["ttft_s"])
                    else:
                        name, whole = system.split(",")[0], system in one_chunk
                        settings = common.mode(name, model, pattern, args, length + 1)
                        chunk = args.chunk_size
                        if whole:  # the prompt in one chunk, a multiple of --chunk-size
                            chunk = -(-length // args.chunk_size) * args.chunk_size
                            if name == "duo":
                                options = settings.options + (("streaming_chunk", args.chunk_size),)
                                settings = dataclasses.replace(settings, options=options)
                        runs[length][system].append(
                            common.time_ours(model, ids, settings, new_tokens=1, chunk_size=chunk)["ttft_s"]
                        )
                    bar.update()

    ttft = {n: {s: float(np.median(r[s])) for s in systems} for n, r in runs.items()}
    rows = [
        [
            n,
            *[ttft[n][s] for s in systems],
            *[n / ttft[n][s] for s in systems],
            common.ratio(ttft[n]["full"], ttft[n]["duo"]),
            common.ratio(ttft[n].get(common.PEER), ttft[n]["full"]),
            common.ratio(ttft[n].get(common.PEER), ttft[n]["duo"]),
            *[common.ratio(ttft[n][m], ttft[n][f"{m}, one chunk"]) for m in ("full", "duo") if one_chunk],
        ]
        for n in args.lengths
    ]
    headers = [
        "prompt",
        *[f"{s} TTFT s" for s in systems],
        *[f"{s} tok/s" for s in systems],
        "duo vs full",
        f"full vs {common.PEER}",
        f"duo vs {common.PEER}",
        *[f"{m}: one chunk vs chunks" for m in ("full", "duo") if one_chunk],
    ]

    def plot(path):
        return report.line_plot(
            path,
            args.lengths,
            {s: [ttft[n][s] for n in args.lengths] for s in systems},
            xlabel="prompt (tokens)",
            ylabel="time to first token (s)",
            logx=True,
            logy=True,
            title=f"prefill, {model.config.name} ({args.dtype}), batch 1",
        )

    notes = [
        f"model {model.config.name} ({args.dtype}), duo sparsity {args.sparsity} (sink {args.sink}, "
        f"recent {args.recent}), ours chunked by {args.chunk_size}, median of {args.repeats} run(s), "
        f"{args.settle:g} s idle before each" + (", single-threaded" if args.single_thread else "")
    ]
    if peer:
        notes.append(
            f"peer: transformers {__import__('transformers').__version__}, attention {peer.attention}, "
            "one forward over the prompt"
        )
    common.write_result(
        args.out,
        "prefill",
        title="Prefill: time to first token (batch 1)",
        headers=headers,
        rows=rows,
        data=dict(args={k: str(v) for k, v in vars(args).items()}, ttft_s=ttft, runs_s=runs),
        plot=plot,
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))

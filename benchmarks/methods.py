"""Every KV-cache method on one model at the same KV budgets: needle-in-a-haystack accuracy and perplexity.

For each budget F (tokens kept per KV head as a fraction of the evaluated length; see duo_jax/eval/modes.py
for how each method meets it), every mode runs
- the NIAH grid (`duo_jax.eval.niah.run_niah`: the San Francisco needle in the evaluation half
  of the Paul Graham essays at --depths of --lengths tokens, greedy, scored on the answer), and
- perplexity on --ppl-length tokens of that half of the essays whose first --ppl-prefix are the prompt and the rest is
  decoded one token per step after the method compressed the prompt (`duo_jax.eval.perplexity`).
Full attention runs once (it has no budget). Each (task, budget, mode) result is written to
<out>/<task>/<budget>/<mode>/ when it is done and a rerun skips those already there, so an interrupted
run resumes where it stopped (use a fresh --out after changing a method or the data). Prints one table (a
row per mode and budget) and writes methods.json and methods.png (the NIAH heat maps, a row per budget, a
column per mode).

    python benchmarks/methods.py                                  # SmolLM2, budgets 0.25 and 0.5, all modes
    python benchmarks/methods.py --modes full duo h2o --budgets 0.5 --lengths 1024 --ppl-length 1024 --ppl-prefix 768
"""

from __future__ import annotations

import json
import pathlib
import time

import common


def main(argv: list[str] | None = None) -> int:
    from duo_jax.eval.modes import MODES  # every registered method, plus duo's all-streaming mode

    p = common.parser(__doc__, "methods")
    common.add_model_args(p, peer=False)
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        metavar="MODE",
        help=f"modes, from: {', '.join(MODES)}",
    )
    p.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[0.25, 0.5],
        help="KV budgets: tokens per KV head as a fraction of the evaluated length",
    )
    p.add_argument("--scores", default="default", help="HeadKV head scores (headkv, duo_headkv)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="NIAH context lengths")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="NIAH needle depths")
    p.add_argument("--max-new-tokens", type=int, default=16, help="NIAH answer tokens")
    p.add_argument("--ppl-length", type=int, default=2048, help="perplexity window (tokens)")
    p.add_argument("--ppl-prefix", type=int, default=1536, help="perplexity prompt tokens; the rest is decoded")
    p.add_argument("--skip", nargs="*", default=[], choices=["niah", "perplexity"], help="tasks not to run")
    args = p.parse_args(argv)
    if any(not 0 < b <= 1 for b in args.budgets):
        p.error(f"--budgets are fractions in (0, 1], got {args.budgets}")
    if not 1 <= args.ppl_prefix < args.ppl_length:
        p.error(f"--ppl-prefix must lie in [1, --ppl-length), got {args.ppl_prefix}")

    common.setup_threads(args)
    from tqdm.auto import tqdm

    from duo_jax.eval import report
    from duo_jax.eval.niah import run_niah, score_matrix
    from duo_jax.eval.perplexity import run_perplexity
    from duo_jax.methods.headkv import resolve_scores

    model, pattern = common.load(args)
    scores = resolve_scores(args.scores, model.config) if {"headkv", "duo_headkv"} & set(args.modes) else None
    shared = dict(
        pattern=pattern,
        scores=scores,
        sparsity=args.sparsity,
        sink=args.sink,
        recent=args.recent,
        chunk_size=args.chunk_size,
    )
    tasks = {
        "niah": lambda mode, budget, out: run_niah(
            model,
            [mode],
            kv_budget=budget,
            lengths=args.lengths,
            depths=args.depths,
            max_new_tokens=args.max_new_tokens,
            out_dir=out,
            progress=False,
            **shared,
        ),
        "perplexity": lambda mode, budget, out: run_perplexity(
            model,
            [mode],
            kv_budget=budget,
            length=args.ppl_length,
            samples=1,
            prefix=args.ppl_prefix,
            out_dir=out,
            progress=False,
            **shared,
        ),
    }
    runs = [
        (task, mode, None if mode == "full" else budget)
        for task in tasks
        if task not in args.skip
        for budget in args.budgets
        for mode in args.modes
    ]
    runs = list(dict.fromkeys(runs))  # full: once per task
    results: dict = {}
    start = time.perf_counter()
    for task, mode, budget in (bar := tqdm(runs, desc="methods", unit="run")):
        bar.set_postfix_str(f"{task} {mode} @ {budget or 'all'}")
        out = args.out / task / (f"{budget:g}" if budget else "full") / mode
        saved = out / f"{task}.json"
        if saved.is_file():  # done by an earlier (interrupted) run
            result = json.loads(saved.read_text())
        else:
            result = tasks[task](mode, budget, out)
        results[(task, mode, budget)] = result["modes"][mode]

    rows, heatmaps, titles = [], {}, {}
    full = {t: results.get((t, "full", None)) for t in tasks}
    for budget in args.budgets:
        for mode in args.modes:
            key_budget = None if mode == "full" else budget
            niah = results.get(("niah", mode, key_budget))
            ppl = results.get(("perplexity", mode, key_budget))
            row = [mode, "all" if mode == "full" else f"{budget:.0%}"]
            if niah is not None:
                longest = str(max(args.lengths))
                by_length = {str(k): v for k, v in niah["accuracy_by_length"].items()}
                cache = {str(k): v for k, v in niah["cache_bytes"].items()}
                full_cache = {str(k): v for k, v in niah["full_cache_bytes"].items()}
                row += [
                    *[by_length.get(str(n)) for n in args.lengths],
                    niah["accuracy"],
                    report.human_bytes(cache[longest]),
                    f"{cache[longest] / full_cache[longest]:.1%}",
                ]
                name = f"{mode} @ {row[1]}"
                heatmaps[name] = score_matrix(niah["cells"], args.lengths, args.depths)
                titles[name] = f"{name}: {niah['accuracy']:.0%}"
            else:
                row += [None] * (len(args.lengths) + 3)
            if ppl is not None:
                reference = (full["perplexity"] or {}).get("decoded_ppl")
                row += [ppl["decoded_ppl"], common.ratio(ppl["decoded_ppl"], reference)]
            else:
                row += [None, None]
            if mode != "full" or budget == args.budgets[0]:
                rows.append(row)
    headers = [
        "mode",
        "budget",
        *[f"NIAH @ {n}" for n in args.lengths],
        "NIAH",
        f"KV @ {max(args.lengths)}",
        "of full",
        f"ppl (decoded {args.ppl_length - args.ppl_prefix})",
        "ppl / full",
    ]

    def plot(path: pathlib.Path):
        return (
            report.grid_heatmaps(path, heatmaps, args.lengths, args.depths, titles, columns=len(args.modes))
            if heatmaps
            else None
        )

    notes = [
        f"model {model.config.name} ({args.dtype}); budget = tokens per KV head as a share of the evaluated "
        f"length (NIAH: the prompt, perplexity: the {args.ppl_length}-token window); duo: pattern "
        f"{args.pattern}, window {args.sink}+{args.recent} (shrunk to half the budget when larger); "
        f"wall {time.perf_counter() - start:.0f} s (resumed runs count only what ran now)"
    ]
    data = dict(
        args={k: str(v) for k, v in vars(args).items()},
        results=[dict(task=t, mode=m, budget=b, result=r) for (t, m, b), r in results.items()],
    )
    common.write_result(
        args.out,
        "methods",
        title="KV-cache methods at equal budgets",
        headers=headers,
        rows=rows,
        data=data,
        plot=plot,
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run(main))

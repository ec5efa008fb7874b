"""RULER's synthetic tasks on any model duo-jax loads, in every KV-cache mode at every KV budget.

`run_ruler` generates the samples of `duo_jax.data.ruler` greedily in every run (`duo_jax.eval.samples`,
resumable from `out_dir`) and scores them as RULER's evaluation scripts do (`postprocess`, then
`string_match_all`, or `string_match_part` for QA); `write_outputs` writes ``ruler.json``, ``ruler.md`` and
``ruler_budget.png``. qa_1 / qa_2 run only with `qa_data` and are otherwise skipped, and the results say so.
Metrics, outputs and what the numbers mean: docs/ruler.md.
"""

from __future__ import annotations

import functools
import operator
import re
import time
from collections.abc import Sequence
from pathlib import Path

from duo_jax.chat import is_chat_model
from duo_jax.data import ruler as data
from duo_jax.data.haystack import EVALUATION_HAYSTACK
from duo_jax.errors import DuoJaxError
from duo_jax.eval import report
from duo_jax.eval.modes import check_kv_budgets, warn_if_calibrated_on
from duo_jax.eval.samples import (
    PredictionStore,
    Sample,
    Settings,
    budget_panel,
    check_duo_budget,
    generate_missing,
    make_runs,
    mean_score,
    protocol_legend,
    seconds_per_1k_tokens,
    settings_record,
    write_results,
)
from duo_jax.loading import Model

DEFAULT_LENGTHS = (1024, 2048, 4096)
SYNTHETIC_TASKS = tuple(t for t in data.TASKS if t not in data.QA_TASKS)


def postprocess(prediction: str) -> str:
    """evaluate.py's postprocess_pred: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """The share of `references` contained in `prediction` (case-insensitive)."""
    if not references:
        raise DuoJaxError("a RULER sample needs at least one reference")
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1 when any of `references` is contained in `prediction` (case-insensitive), else 0."""
    return max((1.0 if r.lower() in prediction.lower() else 0.0) for r in references) if references else 0.0


def task_score(values: Sequence[float]) -> float:
    """A task's score at one length from its samples' values in [0, 1], as RULER's `string_match_all` / `_part`
    compute it: summed one by one in order (the `sum` of Python before 3.12, which now compensates), / their
    number, x 100, rounded to 2 decimals; another order of these operations rounds a tie the other way. NaN for
    no samples."""
    if not len(values):
        return float("nan")
    total = functools.reduce(operator.add, values, 0.0)  # left to right, as Python's sum before 3.12
    return round(total / len(values) * 100, 2)


def metric(task: str):
    return string_match_part if data.check_task(task)[0] == "qa" else string_match_all


def record_score(task: str, record: dict) -> float:
    """A stored prediction's score (its "pred" against its "outputs"): when it is made, and when the tables
    rescore it."""
    return metric(task)(postprocess(record["pred"]), record["outputs"])


def check_tasks(tasks: Sequence[str] | None, qa_data: str | Path | None) -> tuple[list[str], list[str]]:
    """(tasks to run, notes): the synthetic tasks by default, plus QA when `qa_data` is given; a QA task
    asked for without data is skipped with a note."""
    tasks = list(dict.fromkeys(tasks or [*SYNTHETIC_TASKS, *data.QA_TASKS]))
    for task in tasks:
        data.check_task(task)
    notes = []
    if qa_data is None and any(t in data.QA_TASKS for t in tasks):
        skipped = [t for t in tasks if t in data.QA_TASKS]
        notes.append(
            f"skipped {', '.join(skipped)}: RULER's QA tasks need SQuAD / HotpotQA, pass --qa-data DIR ({data.GET_QA})"
        )
        tasks = [t for t in tasks if t not in data.QA_TASKS]
    if not tasks:
        raise DuoJaxError("no RULER task left to run: " + "; ".join(notes))
    return tasks, notes


def predictions_file(out_dir: str | Path, run: str, task: str, length: int) -> Path:
    """Where a run's predictions of a task at a length are kept (resumed from, and read back for the tables)."""
    return Path(out_dir) / "predictions" / run / f"{task}_{length}.jsonl"


def run_ruler(
    model: Model,
    modes: Sequence[str],
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    samples: int = 10,
    kv_budgets: Sequence[float] | None,
    settings: Settings,
    tasks: Sequence[str] | None = None,
    seed: int = 42,
    qa_data: str | Path | None = None,
    chat: bool | None = None,
    haystack: str = EVALUATION_HAYSTACK,
    out_dir: str | Path,
    decode_last: int = 0,
    progress: bool = True,
) -> dict:
    """Generate and score `samples` samples of every task at every length in every run, resuming from the
    predictions already in `out_dir` (`predictions_file`); the outputs: docs/ruler.md."""

    if model.tokenizer is None:
        raise DuoJaxError("RULER needs the model's tokenizer (none was found with the weights)")
    if samples < 1:
        raise DuoJaxError(f"need at least one sample per task and length, got {samples}")
    lengths = sorted(set(int(n) for n in lengths))
    if lengths[0] < 256:
        raise DuoJaxError(f"RULER lengths must be at least 256 tokens, got {lengths[0]}")
    if lengths[-1] > model.config.max_position_embeddings:
        raise DuoJaxError(
            f"length {lengths[-1]} exceeds the model's context of "
            f"{model.config.max_position_embeddings} tokens: choose shorter --lengths"
        )
    tasks, notes = check_tasks(tasks, qa_data)
    check_duo_budget(settings.duo_budget or "fitted", kv_budgets)
    runs = make_runs(modes, kv_budgets, decode_last)
    overlap = warn_if_calibrated_on(haystack, [r.mode for r in runs], settings.pattern, settings.scores)
    chat = is_chat_model(model) if chat is None else chat
    out_dir = Path(out_dir)
    start = time.perf_counter()
    prompts = {}
    for length in lengths:  # every prompt first: a task that cannot fit a length fails before any generation
        for task in tasks:
            try:
                prompts[task, length] = [
                    data.make_sample(
                        task, model.tokenizer, length, i, seed=seed, chat=chat, haystack=haystack, qa_data=qa_data
                    )
                    for i in range(samples)
                ]
            except DuoJaxError as e:
                raise type(e)(f"{task} at {length} tokens: {e}") from None
    groups = {
        (task, length): [
            Sample(str(s.index), s.ids, s.tokens_to_generate, dict(outputs=s.outputs, length=s.length)) for s in group
        ]
        for (task, length), group in prompts.items()
    }
    generate_missing(
        model,
        runs,
        groups,
        settings,
        file=lambda run, key: predictions_file(out_dir, run.name, *key),
        score=lambda key, record: record_score(key[0], record),
        desc="ruler",
        progress=progress,
    )
    results = dict(
        runs={},
        task="ruler",
        tasks=tasks,
        notes=notes,
        lengths=lengths,
        samples=samples,
        seed=seed,
        chat=chat,
        haystack=haystack,
        calibration_overlap=overlap,
        **settings_record(model, settings, kv_budgets),
        prompts={
            f"{t}_{n}": [dict(length=s.length, outputs=s.outputs, haystack_size=s.meta["haystack_size"]) for s in v]
            for (t, n), v in prompts.items()
        },
    )
    for run in runs:
        scores, records = {}, {}
        for (task, length), group in prompts.items():
            store = PredictionStore(predictions_file(out_dir, run.name, task, length))
            done = store.ordered(str(s.index) for s in group)
            # The tables rescore each prediction with the current metric code. A line's own "score" is what the
            # metric gave when it was generated, kept for reading the lines; nothing reads it back.
            values = [record_score(task, r) for r in done]
            scores.setdefault(task, {})[length] = task_score(values)
            records[f"{task}_{length}"] = done
        average = {n: mean_score([scores[t][n] for t in tasks]) for n in lengths}
        results["runs"][run.name] = dict(
            mode=run.mode,
            kv_budget=run.kv_budget,
            decode_last=run.decode_last,
            protocol=run.protocol,
            scores=scores,
            average=average,
            overall=mean_score(list(average.values())),
            s_per_1k_tokens=seconds_per_1k_tokens(sum(records.values(), [])),
            predictions=records,
        )
    results.update(wall_s=time.perf_counter() - start, machine=report.machine_info())
    write_outputs(results, out_dir)
    return results


# What every merged result must share (`merge_results`): otherwise its rows are not comparable.
MERGE_KEYS = (
    "model",
    "dtype",
    "tasks",
    "seed",
    "chat",
    "haystack",
    "sparsity",
    "pattern",
    "scores",
    "sink",
    "recent",
    "chunk_size",
    "kv_dtype",
    "streaming_chunk",
    "duo_budget",
)


# What a result from an older version, which did not record a setting, was run with
MERGE_DEFAULTS = {"duo_budget": "fitted"}


def _setting(result: dict, key: str):
    return result.get(key, MERGE_DEFAULTS.get(key))


def _recorded(result: dict, key: str) -> str:
    if key in result or key in MERGE_DEFAULTS:
        return repr(_setting(result, key))
    return "(not recorded: a result from an older version)"


def check_result(source: str, result) -> None:
    """A DuoJaxError naming `source` unless `result` has the form of a ruler.json: an object whose "runs" and
    "prompts" are objects, "lengths" a list of integers and "notes" a list, each run an object of objects."""

    def bad(what: str):
        return DuoJaxError(f"{source} is not a ruler.json of `python -m duo_jax.eval ruler`: {what}")

    if not isinstance(result, dict):
        raise bad(f"it holds a {type(result).__name__}, not an object")
    for key, kind in (("runs", dict), ("prompts", dict), ("lengths", list), ("notes", list)):
        if not isinstance(result.get(key), kind):
            raise bad(
                f"its {key!r} is {type(result.get(key)).__name__}, not {kind.__name__.replace('dict', 'an object')}"
            )
    if not all(isinstance(n, int) or (isinstance(n, str) and n.isdigit()) for n in result["lengths"]):
        raise bad(f"its 'lengths' are not token counts: {result['lengths']!r:.80}")
    for name, run in result["runs"].items():
        if not (isinstance(run, dict) and all(isinstance(run.get(k), dict) for k in ("scores", "average"))):
            raise bad(f"its run {name!r} lacks the 'scores' and 'average' of each length")


def merge_results(parts: Sequence[tuple[str, dict]]) -> dict:
    """One result from several `run_ruler` results (named (source, result) pairs, as ``ruler.json`` holds them):
    a grid run in pieces (a length, a method or a budget at a time) read as one table. The parts must share the
    settings of `MERGE_KEYS` and, where two hold the same task and length, the same prompts; a run at a length
    may come from one part only. A run missing at a length has None there, and its overall is None unless it has
    every length. The predictions stay in the parts (`sources`); `samples` is per length."""
    if not parts:
        raise DuoJaxError("nothing to merge: give at least one ruler.json")
    for source, part in parts:
        check_result(source, part)
    first_source, first = parts[0]
    merged = {key: _setting(first, key) for key in MERGE_KEYS}  # (older results lack streaming_chunk: None)
    merged.update(task="ruler", notes=list(first["notes"]), runs={}, prompts={}, samples={}, sources=[])
    owners = {}  # (run, length) -> source
    for source, part in parts:
        for key in MERGE_KEYS:
            if _setting(part, key) != merged[key]:
                raise DuoJaxError(
                    f"{source} was run with {key}={_recorded(part, key)}, {first_source} with "
                    f"{_recorded(first, key)}: only results of the same settings can share a table"
                )
        lengths = [int(n) for n in part["lengths"]]
        for name, prompts in part["prompts"].items():
            if merged["prompts"].setdefault(name, prompts) != prompts:
                raise DuoJaxError(
                    f"{source} and an earlier file hold different prompts for {name} (another --samples or "
                    "another version of the generator): their scores would not be comparable"
                )
        for n in lengths:
            merged["samples"][n] = len(part["prompts"][f"{merged['tasks'][0]}_{n}"])
        for name, run in part["runs"].items():
            into = merged["runs"].setdefault(
                name,
                dict(
                    {k: run[k] for k in ("mode", "kv_budget", "decode_last", "protocol")},
                    scores={t: {} for t in merged["tasks"]},
                    average={},
                    predictions={},
                ),
            )
            if run.get("protocol") != into["protocol"]:  # e.g. +last50 before and after its protocol changed
                raise DuoJaxError(
                    f"{source} ran {name} as {run.get('protocol')!r}, an earlier file as {into['protocol']!r}: only "
                    "runs of one protocol can share a row; run the older piece again"
                )
            for n in lengths:
                if (name, n) in owners:
                    raise DuoJaxError(f"{name} at {n} tokens is in both {owners[name, n]} and {source}: pass one")
                owners[name, n] = source
                into["average"][n] = run["average"][_key(run["average"], n)]
                for t in merged["tasks"]:
                    into["scores"][t][n] = run["scores"][t][_key(run["scores"][t], n)]
                    into["predictions"][f"{t}_{n}"] = run["predictions"][f"{t}_{n}"]
        merged["sources"].append(source)
    try:  # one figure draws every budget on one axis
        check_kv_budgets([run["kv_budget"] for run in merged["runs"].values()])
    except DuoJaxError as e:
        raise DuoJaxError(f"{', '.join(merged['sources'])}: {e}") from None
    merged["lengths"] = sorted(merged["samples"])
    merged["samples"] = {n: merged["samples"][n] for n in merged["lengths"]}
    # full first, then each budget's runs, duo first among them
    order = sorted(
        merged["runs"].items(),
        key=lambda item: (
            item[1]["kv_budget"] is not None,
            item[1]["kv_budget"] or 0,
            item[1]["mode"] != "duo",
            item[1]["mode"],
            item[1]["decode_last"],
        ),
    )
    merged["runs"] = dict(order)
    for run in merged["runs"].values():
        run["average"] = {n: run["average"].get(n) for n in merged["lengths"]}
        run["scores"] = {t: {n: s.get(n) for n in merged["lengths"]} for t, s in run["scores"].items()}
        averages = list(run["average"].values())
        run["overall"] = None if None in averages else mean_score(averages)
        run["s_per_1k_tokens"] = seconds_per_1k_tokens(sum(run.pop("predictions").values(), []))
    return merged


def _key(by_length: dict, n: int):
    """A per-length dict's key for length n: an int in memory, a string once read back from JSON."""
    return n if n in by_length else str(n)


def tables(results: dict) -> str:
    """Markdown: the average over tasks per length (RULER's headline) per run, then every task per length."""
    lengths, tasks = results["lengths"], results["tasks"]
    runs = results["runs"]
    text = report.markdown_table(
        ["run", *[f"avg @ {n}" for n in lengths], "overall", "s / 1k tokens"],
        [[name, *[r["average"][n] for n in lengths], r["overall"], r["s_per_1k_tokens"]] for name, r in runs.items()],
    )
    rows = [
        [name, n, *[r["scores"][t][n] for t in tasks]]
        for n in lengths
        for name, r in runs.items()
        if r["average"][n] is not None  # a merged run may lack a length
    ]
    text += "\n\n" + report.markdown_table(["run", "length", *tasks], rows)
    text += protocol_legend(runs, results.get("duo_budget"))
    if "sources" in results:
        per_length = ", ".join(f"{n}: {k}" for n, k in results["samples"].items())
        text += f"\n\nSamples per task at each length: {per_length}. Merged from {', '.join(results['sources'])}."
    for note in results["notes"]:
        text += f"\n\nNote: {note}"
    return text


def budget_figure(results: dict, path: str | Path) -> Path:
    """Average score vs KV budget, one line per method (full: a dashed level), one panel per length."""
    runs = results["runs"].values()
    budgets = sorted({r["kv_budget"] for r in runs if r["kv_budget"] is not None})
    panels = {f"{n} tokens": budget_panel(runs, budgets, lambda r, n=n: r["average"][n]) for n in results["lengths"]}
    return report.budget_panels(path, budgets, panels, title=f"RULER, {results['model']}")


def write_outputs(results: dict, out_dir: str | Path) -> list[Path]:
    """ruler_budget.png, ruler.md and ruler.json into `out_dir`."""
    return write_results(results, out_dir, "ruler", tables, budget_figure)

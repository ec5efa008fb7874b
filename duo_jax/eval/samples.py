"""Per-sample evaluations (LongBench, RULER): every sample generated once in every run, resumably.

A `Run` is one mode at one KV budget (``full``, or e.g. ``duo@0.25``; `make_runs` builds them from the modes and
budgets asked for). `generate_sample` generates one sample alone (batch 1, greedy), the run's mode built for that
prompt's own length (full and duo at a capacity bucket that samples of similar lengths share,
`shares_capacity_buckets`); `PredictionStore` records one JSON line per finished sample under
``<out>/predictions/<run>/`` and tells which samples a restarted evaluation still has to generate
(`sample_fingerprint`: a line made from another prompt or other settings does not count). `generate_missing` is the
loop over samples and runs an evaluation calls, `settings_record` and `write_results` what its results share.
Design: docs/evaluation.md, "Runs and resuming"; a new evaluation: docs/adding-an-evaluation.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from duo_jax import methods, sharding
from duo_jax.cache import capacity_bucket, full_cache_bytes
from duo_jax.errors import DuoJaxError
from duo_jax.eval import report
from duo_jax.eval.modes import (
    ModeSettings,
    budget_tokens,
    check_kv_budgets,
    check_modes,
    is_token_budget,
    mode_settings,
    one_chunk_prefill,
)
from duo_jax.loading import Model
from duo_jax.pattern import Pattern


@dataclasses.dataclass(frozen=True)
class Run:
    """One mode at one KV budget: a fraction of each prompt's tokens, or a number of tokens per KV head for every
    prompt (`duo_jax.eval.modes.check_kv_budget`); None: full, or duo's default budget.
    decode_last > 0: the prompt's last `decode_last` tokens are decoded one at a time after the prefill of the rest
    (`duo_jax.generate`'s prompt_tail_steps; DuoAttention's evaluations: its appendix protocol for H2O / TOVA, and
    its LongBench for every method); its name then ends in "+last<N>". one_pass: the prompt (less those tokens) is
    prefilled in one chunk whatever the mode (DuoAttention's LongBench: its first forward pass is the whole prompt,
    dense on a streaming head too, before the cache is cut to the window)."""

    mode: str
    kv_budget: float | None = None
    decode_last: int = 0
    one_pass: bool = False

    @property
    def name(self) -> str:
        name = self.mode if self.kv_budget is None else f"{self.mode}@{self.kv_budget:g}"
        return name + (f"+last{self.decode_last}" if self.decode_last else "")

    @property
    def protocol(self) -> str:
        if self.decode_last and one_chunk_prefill(self.mode):
            return (
                f"exact prefill of all but the last {self.decode_last} prompt tokens, then those decoded one at a time "
                "with eviction from the first on"
            )
        if self.decode_last:
            return f"prefill in one chunk, last {self.decode_last} prompt tokens decoded one at a time"
        if one_chunk_prefill(self.mode):
            return "prefill in one chunk, compressed at its end"
        return "prefill in one chunk" if self.one_pass else "prefill"

    def tail_steps(self, mode: ModeSettings) -> int:
        """The prompt tokens decoded one at a time (`generate`'s prompt_tail_steps; `decode_last_protocol`)."""
        return decode_last_protocol(mode, self.decode_last)[1]

    def one_chunk(self, mode: ModeSettings) -> bool:
        """Whether the prompt (less its last `decode_last` tokens) is prefilled in one chunk: the mode's own rule
        (h2o, tova), or `one_pass`."""
        return mode.one_chunk_prefill or self.one_pass


def check_decode_last(decode_last: int) -> None:
    """The prompt's last tokens decoded one at a time: a count >= 0."""
    if not isinstance(decode_last, (int, np.integer)) or isinstance(decode_last, bool) or decode_last < 0:
        raise DuoJaxError(f"decode_last is a number of prompt tokens >= 0 (0: none), got {decode_last!r}")


def make_runs(
    modes: Sequence[str], budgets: Sequence[float | None] | None, decode_last: int = 0, *, every_mode: bool = False
) -> list[Run]:
    """Every mode at every budget; full once (it keeps every token at any budget). decode_last applies to the
    modes evaluated with one-chunk prefill (h2o, tova), or with `every_mode` to all, each prefilled in one pass
    (DuoAttention's LongBench)."""
    budgets = list(dict.fromkeys(budgets or [None]))
    check_kv_budgets(budgets)
    check_decode_last(decode_last)
    decode_last = int(decode_last)
    return [
        Run(m, b, decode_last if every_mode or one_chunk_prefill(m) else 0, one_pass=every_mode)
        for m in check_modes(modes)
        for b in (budgets if m != "full" else [None])
    ]


@dataclasses.dataclass
class Settings:
    """What every run shares: the head pattern / scores of the modes that need them and the windows."""

    pattern: Pattern | None = None
    scores: Pattern | None = None
    sparsity: float = 0.5
    sink: int = 64
    recent: int = 256
    chunk_size: int = 256
    kv_dtype: str | None = None
    streaming_chunk: int | None = None  # duo's streaming heads see a longer chunk as chunks of this size
    # How duo meets a fractional budget F: "fitted", its retrieval heads and window fitted so that its cache holds F
    # of each prompt (`duo_jax.methods.duo.duo_budget`); "heads", F of its heads retrieval heads (sparsity 1 - F)
    # with the evaluation's window, as DuoAttention's own evaluations give its budgets. None: the evaluation's
    # default ("fitted"; LongBench's "duoattention" protocol: "heads").
    duo_budget: str | None = None
    # Later samples whose steps threads compile while one generates (`generate_missing`); 0: none. It changes when
    # compilation happens, never an output.
    compile_ahead: int = 1


DUO_BUDGETS = ("fitted", "heads")


def check_duo_budget(rule: str, budgets: Sequence[float | None] | None = None) -> str:
    """`Settings.duo_budget`, checked: one of DUO_BUDGETS; "heads" takes fractions only (a share of the heads)."""
    if rule not in DUO_BUDGETS:
        raise DuoJaxError(f"unknown duo budget rule {rule!r}: choose from {', '.join(DUO_BUDGETS)}")
    if rule == "heads" and any(b is not None and is_token_budget(b) for b in budgets or ()):
        raise DuoJaxError(
            "duo's budget as a share of retrieval heads (--duo-budget heads) takes fractions in (0, 1], not tokens: "
            "pass --kv-budget 0.25 0.5, or --duo-budget fitted"
        )
    return rule


def _mode(model: Model, run: Run, length: int, max_new_tokens: int, settings: Settings):
    """The run's mode built for a prompt of `length` tokens: budget = the run's fraction of it, or its tokens;
    duo's under `Settings.duo_budget` "heads" the share of its heads that are retrieval heads."""
    sparsity, kv_budget = settings.sparsity, budget_tokens(run.kv_budget, length)
    rule = check_duo_budget(settings.duo_budget or "fitted", [run.kv_budget])
    if rule == "heads" and run.mode == "duo" and run.kv_budget:
        sparsity, kv_budget = 1 - run.kv_budget, None
    mode = mode_settings(
        run.mode,
        model.config,
        settings.pattern,
        sparsity=sparsity,
        sink=settings.sink,
        recent=settings.recent,
        context=length + max_new_tokens,
        kv_budget=kv_budget,
        scores=settings.scores,
        kv_dtype=settings.kv_dtype,
        streaming_chunk=settings.streaming_chunk,
    )
    return decode_last_protocol(mode, run.decode_last)[0]


def decode_last_protocol(mode: ModeSettings, decode_last: int) -> tuple[ModeSettings, int]:
    """DuoAttention's appendix protocol for a prompt's last `decode_last` tokens: an exact prefill of the rest, then
    those decoded one at a time, the eviction (and H2O's scores) starting with the first of them, whose query sees
    the whole prefix. For a mode that compresses at the end of its one chunk (h2o, tova) that query ends the chunk
    and the chunk's compression is its eviction, so one token fewer is decoded, and H2O scores from a chunk's newest
    query alone. Returns (the mode, the prompt tokens decoded one at a time: `generate`'s prompt_tail_steps)."""
    if not decode_last:
        return mode, 0
    if "scores_from" in methods.entry(mode.method).options:
        mode = dataclasses.replace(mode, options=mode.options + (("scores_from", "newest"),))
    return mode, decode_last - 1 if mode.one_chunk_prefill else decode_last


def sample_fingerprint(model: Model, run: Run, ids: Sequence[int], max_new_tokens: int, settings: Settings) -> str:
    """What a prediction is made from: the model and its dtype, the prompt ids, the new tokens, the run's protocol
    and what its mode was built with (its pattern / scores only where the mode uses them). A stored prediction
    with another fingerprint is stale (an option or the data changed) and is generated again, never reused."""
    mode = _mode(model, run, len(ids), max_new_tokens, settings)
    digest = hashlib.sha256()
    digest.update(
        repr(
            (
                model.config.name,
                model.source,
                str(model.params.dtype),  # a bf16 run's predictions are not a float32 run's
                max_new_tokens,
                run.name,
                len(ids) if run.one_chunk(mode) else settings.chunk_size,
            )
        ).encode()
    )
    for key, value in sorted(mode.options):
        digest.update(key.encode())
        digest.update(
            np.ascontiguousarray(value.gates, np.float32).tobytes()
            if isinstance(value, Pattern)
            else repr(value).encode()
        )
    mask = mode.retrieval_mask()
    if mask is not None:  # the heads the pattern gave, so that a change of the binarisation rule is seen too
        digest.update(np.packbits(mask).tobytes())
    if run.decode_last:  # how the prompt's last tokens ran (an earlier version decoded all of them for h2o / tova)
        digest.update(f"tail steps {run.tail_steps(mode)}".encode())
    if getattr(model.tokenizer, "clean_up_assumed", False):  # its predictions' text is decoded otherwise
        digest.update(b"clean_up_tokenization_spaces assumed")
    digest.update(np.asarray(ids, np.int64).tobytes())
    return digest.hexdigest()[:16]


def _request(model: Model, run: Run, ids: Sequence[int], max_new_tokens: int, settings: Settings):
    """(the run's mode for this prompt, `duo_jax.generate`'s keyword arguments for it)."""
    length = len(ids)
    if run.decode_last >= length:
        raise DuoJaxError(
            f"--decode-last {run.decode_last} is not shorter than a prompt of {length} tokens ({run.name}): pass fewer "
            "prompt tokens to decode one at a time"
        )
    mode = _mode(model, run, length, max_new_tokens, settings)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        context=None if shares_capacity_buckets(mode) else length + max_new_tokens,
        chat=False,
        # One chunk for the whole prompt, padded to a capacity bucket so that prompts of similar lengths share it
        chunk_size=capacity_bucket(length) if run.one_chunk(mode) else settings.chunk_size,
        prompt_tail_steps=run.tail_steps(mode),
        **mode.generate_kwargs(),
    )
    if not is_token_budget(run.kv_budget):  # a budget in tokens shapes every sample alike: nothing to bucket
        for option, slots in (("ring_slots", ring_bucket(mode, settings)), ("budget_slots", budget_bucket(mode))):
            if slots is not None:
                kwargs[option] = slots
    if takes_room(mode):
        kwargs["room"] = capacity_bucket(max_new_tokens + run.decode_last)
    return mode, kwargs


def generate_sample(model: Model, run: Run, ids: Sequence[int], max_new_tokens: int, settings: Settings) -> dict:
    """Generate greedily from one token-id prompt in `run`; returns the text and what it cost. The mode's
    budget is the run's fraction of the whole prompt (whichever protocol), or its number of tokens."""
    from duo_jax import generate

    mode, kwargs = _request(model, run, ids, max_new_tokens, settings)
    length, need = len(ids), len(ids) + max_new_tokens
    # it reserves more than the sample keeps
    bucketed = kwargs["context"] is None or "ring_slots" in kwargs or "budget_slots" in kwargs
    room = {"room": kwargs["room"]} if "room" in kwargs else {}
    out = generate(model, [list(ids)], **kwargs)
    # The new ids decoded alone, as LongBench's pred.py decodes them (`out.text` keeps the space a SentencePiece
    # decoder drops from the first word, which code_sim_score would see; RULER strips its predictions either way).
    tokenizer = model.tokenizer
    text = " ".join(map(str, out.tokens[0])) if tokenizer is None else tokenizer.decode(out.tokens[0])
    return dict(
        pred=text,
        prompt_tokens=length,
        new_tokens=len(out.tokens[0]),
        kv_budget_tokens=mode.kv_budget,
        prefill_s=out.stats["prefill_s"],
        decode_s=out.stats["decode_s"],
        compile_s=out.stats["compile_s"],
        cache_bytes=own_cache_bytes(model, mode, need, length - run.tail_steps(mode), **room)
        if bucketed
        else out.stats["cache_bytes"],
        reserved_cache_bytes=out.stats["cache_bytes"],
        # One reference for every mode: a full cache of this sample's own need.
        full_cache_bytes=full_cache_bytes(model.config, 1, need, model.params.dtype.itemsize),
    )


def shares_capacity_buckets(mode: ModeSettings) -> bool:
    """Whether `mode` runs at generate's capacity bucket rather than at the sample's own capacity: full attention
    and duo (``streaming`` too) keep the same tokens at any capacity that holds the sample, since duo's budget rule
    fits its sparsity and window to the sample's length, not to the capacity. So samples of similar lengths share
    compiled steps (a window fitted to the sample is runtime data in a ring bucket, `ring_bucket`). So does SnapKV's
    family, whose decode cache is sized by its budgets and its `room` for the answer, not by the capacity
    (`takes_room`), and InfiniGen, which holds every token and fetches its budget's (runtime data in a budget bucket,
    `budget_bucket`). Every other method's cache is shaped by its budget, so a bucket would only reserve memory."""
    return mode.method in ("full", "duo", "infinigen") or takes_room(mode)


def takes_room(mode: ModeSettings) -> bool:
    """Whether the mode's decode cache takes a `room` for the tokens after the prompt (SnapKV's family): the
    evaluations give it the capacity bucket of the tokens generated, so that prompts of any length share its decode
    steps (otherwise the capacity less the prompt's whole blocks)."""
    return "room" in methods.entry(mode.method).options


def compile_sample(model: Model, run: Run, ids: Sequence[int], max_new_tokens: int, settings: Settings) -> None:
    """Compile the steps `generate_sample` runs for this sample (`duo_jax.generation.compile_steps`), so that a
    thread can prepare the next samples while the device generates this one."""
    from duo_jax.engine import Engine
    from duo_jax.generation import compile_steps, plan_generation

    plan = plan_generation(model, [list(ids)], **_request(model, run, ids, max_new_tokens, settings)[1])
    compile_steps(Engine.of(model, plan.mesh), plan)


def ring_bucket(mode: ModeSettings, settings: Settings) -> int | None:
    """The ring a mode runs with where its window was fitted to the sample (``streaming``'s and streaming_llm's are
    the budget, duo's shrinks under a small one): `duo_jax.cache.capacity_bucket` of it, the window runtime data
    (the method's `ring_slots` option: `duo_jax.cache.WindowAsData`), so that samples with windows in one bucket
    share compiled steps. None: the mode keeps the evaluation's window (--sink / --recent) on every sample, compiled
    in, or its method has no such ring. (A budget in tokens, the same for every sample, takes none: `_request`.)"""
    takes_ring = "ring_slots" in methods.entry(mode.method).options
    if not takes_ring or (mode.sink, mode.recent) == (settings.sink, settings.recent):
        return None
    return capacity_bucket(mode.sink + mode.recent)


def budget_bucket(mode: ModeSettings) -> int | None:
    """The slots of a mode whose cache (h2o, tova) or fetch (infinigen) is shaped by a budget fitted to the sample
    (the method's `budget_slots` option): `duo_jax.cache.capacity_bucket` of the budget, the budget runtime data, so
    that samples whose budgets fall in one bucket share compiled steps. None: the method has no such option, or no
    budget. (A budget in tokens, the same for every sample, takes none: `_request`.)"""
    if mode.kv_budget is None or "budget_slots" not in methods.entry(mode.method).options:
        return None
    return capacity_bucket(mode.kv_budget)


def own_cache_bytes(model: Model, mode: ModeSettings, capacity: int, length: int, **options) -> int:
    """Bytes of `mode`'s cache of one sequence at `capacity` tokens after a prefill of `length` tokens (`options`:
    the method's own beside the mode's, e.g. SnapKV's `room`): what it keeps for a sample of that need (SnapKV's
    family: the compressed cache it decodes with), read from the shapes of the cache it builds (nothing is
    allocated)."""
    mode = dataclasses.replace(mode, options=mode.options + tuple(options.items()))
    method = mode.build(model.config, capacity, model=model).decode_method(length)
    return sharding.total_bytes(method.cache_spec(1, model.params.dtype))


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt of a per-sample evaluation: its id in the predictions file (`sample_id`), its token ids, how many
    tokens to generate, and what its record keeps beside the prediction (the answers, the length...)."""

    sample_id: str
    prompt_ids: Sequence[int]
    max_new_tokens: int
    fields: dict = dataclasses.field(default_factory=dict)


def generate_missing(
    model: Model,
    runs: Sequence[Run],
    groups: dict[Any, Sequence[Sample]],
    settings: Settings,
    *,
    file: Callable[[Run, Any], Path],
    score: Callable[[Any, dict], float],
    desc: str,
    progress: bool = True,
) -> None:
    """The one per-sample loop of the evaluations: every sample of every group (a task, or a task at a length) in
    every run, the run's predictions of a group in `file(run, key)`. A sample stored there with its fingerprint
    (`sample_fingerprint`) is skipped; any other is generated (`generate_sample`), its record given the sample's id,
    fields, fingerprint and `score(key, record)`, and written at once (`PredictionStore.add`), so that a killed
    evaluation resumes where it stopped. While a sample generates, `settings.compile_ahead` threads compile the
    steps of the next samples (`compile_sample`; a shape already compiled costs nothing), so that compilation
    overlaps the device's work."""
    from tqdm.auto import tqdm

    compile_ahead = settings.compile_ahead
    if compile_ahead < 0:
        raise DuoJaxError(f"compile_ahead is a number of samples >= 0, got {compile_ahead}")
    todo, total = [], len(runs) * sum(len(group) for group in groups.values())
    for key, group in groups.items():
        for run in runs:
            store = PredictionStore(file(run, key))
            for sample in group:
                fingerprint = sample_fingerprint(model, run, sample.prompt_ids, sample.max_new_tokens, settings)
                if not store.has(sample.sample_id, fingerprint):
                    todo.append((key, run, store, sample, fingerprint))
    pool = ThreadPoolExecutor(max(compile_ahead, 1), thread_name_prefix="compile-ahead")
    try:
        with tqdm(total=total, initial=total - len(todo), desc=desc, unit="sample", disable=not progress) as bar:
            sent = 0  # the last sample handed to the compile threads (the first is generated at once)
            for i, (key, run, store, sample, fingerprint) in enumerate(todo):
                sent = max(sent, i)  # only later samples: this one compiles in its own generation
                while sent < min(i + compile_ahead, len(todo) - 1):
                    sent += 1
                    pool.submit(_compile_quietly, model, todo[sent][1], todo[sent][3], settings)
                bar.set_postfix_str(f"{run.name} / {_group_label(key)}")
                record = generate_sample(model, run, sample.prompt_ids, sample.max_new_tokens, settings)
                record.update(id=sample.sample_id, **sample.fields, fingerprint=fingerprint)
                record["score"] = score(key, record)
                store.add(record)
                bar.update(1)
    finally:  # a failed or interrupted loop waits for the compiles under way, not for those queued
        pool.shutdown(cancel_futures=True)


def _group_label(key) -> str:
    """A group's key for the progress bar: a task's name, or a tuple (a task at a length) joined with " @ "."""
    return " @ ".join(map(str, key)) if isinstance(key, tuple) else str(key)


def _compile_quietly(model: Model, run: Run, sample: Sample, settings: Settings) -> None:
    """`compile_sample`, its errors left to the sample's own generation, which raises them where they belong."""
    try:
        compile_sample(model, run, sample.prompt_ids, sample.max_new_tokens, settings)
    except Exception:  # noqa: BLE001  (generate_sample raises it again, in the loop)
        pass


def settings_record(model: Model, settings: Settings, kv_budgets: Sequence[float] | None) -> dict:
    """What every run of an evaluation shared, for its results: the model and its dtype, the budgets, the windows,
    and the head pattern and scores by digest."""
    return dict(
        model=model.config.name,
        source=model.source,
        dtype=str(model.params.dtype),
        kv_budgets=list(kv_budgets or [None]),
        sparsity=settings.sparsity,
        pattern=None if settings.pattern is None else settings.pattern.digest(),
        scores=None if settings.scores is None else settings.scores.digest(),
        sink=settings.sink,
        recent=settings.recent,
        chunk_size=settings.chunk_size,
        kv_dtype=settings.kv_dtype,
        streaming_chunk=settings.streaming_chunk,
        duo_budget=settings.duo_budget or "fitted",
    )


def write_results(
    results: dict,
    out_dir: str | Path,
    name: str,
    tables: Callable[[dict], str],
    budget_figure: Callable[[dict, Path], Path],
) -> list[Path]:
    """`<name>_budget.png` (`budget_figure`), `<name>.md` (`tables`) and `<name>.json` (the results, which list
    the three files) into `out_dir`."""
    out_dir = Path(out_dir)
    paths = [budget_figure(results, out_dir / f"{name}_budget.png"), out_dir / f"{name}.md", out_dir / f"{name}.json"]
    results["files"] = [str(p) for p in paths]
    paths[1].write_text(tables(results) + "\n", encoding="utf-8")
    report.write_json(paths[2], results)
    return paths


class PredictionStore:
    """The finished samples of one run and task: a JSON-lines file, one object per sample with its "id"."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: dict[str, dict] = {}
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the last line of a killed run
                    continue
                if isinstance(record, dict) and "id" in record:
                    self.records[str(record["id"])] = record

    def has(self, sample_id: str, fingerprint: str) -> bool:
        """Whether sample `sample_id` is stored with this `fingerprint` (`sample_fingerprint`)."""
        record = self.records.get(str(sample_id))
        return record is not None and record.get("fingerprint") == fingerprint

    def add(self, record: dict) -> None:
        """Append `record` (it needs an "id") and flush it to disk at once; it replaces an earlier line of
        the same id (the last line of an id wins when the file is read)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = self.path.read_text(encoding="utf-8") if self.path.is_file() else ""
        with self.path.open("a", encoding="utf-8") as f:
            if text and not text.endswith("\n"):  # a line cut short by a kill: start a fresh one
                f.write("\n")
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
        self.records[str(record["id"])] = record

    def ordered(self, ids: Iterable[str]) -> list[dict]:
        """The records of `ids` that are done, in that order."""
        return [self.records[str(i)] for i in ids if str(i) in self.records]


def seconds_per_1k_tokens(records: Sequence[dict[str, Any]]) -> float:
    """Prefill + decode seconds per 1,000 prompt tokens over `records` (compilation excluded)."""
    tokens = sum(r["prompt_tokens"] for r in records)
    return 1000 * sum(r["prefill_s"] + r["decode_s"] for r in records) / tokens if tokens else float("nan")


def protocol_legend(runs: dict[str, dict], duo_budget: str | None = None) -> str:
    """Markdown lines naming the protocol of every run prefilled otherwise than in the evaluation's chunks,
    and under `duo_budget` "heads" what duo's budgets mean ("" when there is nothing to say)."""
    lines = [f"- {name}: {r['protocol']}" for name, r in runs.items() if r.get("protocol", "prefill") != "prefill"]
    if duo_budget == "heads" and any(r["mode"] == "duo" and r.get("kv_budget") for r in runs.values()):
        lines.append("- duo@F: F of its heads are retrieval heads (sparsity 1 - F), as DuoAttention gives its budgets")
    return "\n\nProtocols:\n" + "\n".join(lines) if lines else ""


def mean_score(values: Sequence[float | None]) -> float:
    """The mean of the finite scores, rounded to 2 decimals as the benchmarks report them (NaN for none)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return round(sum(values) / len(values), 2) if values else float("nan")


def budget_panel(runs: Iterable[dict], budgets: Sequence[float], value) -> tuple[dict, dict]:
    """One panel of `duo_jax.eval.report.budget_panels` from result runs (dicts with "mode", "kv_budget"):
    ({label: [value(run) per budget]}, {label of a run without a budget: value(run)}); a run's label is its
    mode, plus "+last<N>" for the decoded-tail protocol."""
    series, levels = {}, {}
    for run in runs:
        label = run["mode"] + (f"+last{run['decode_last']}" if run.get("decode_last") else "")
        if run["kv_budget"] is None:
            levels[label] = value(run)
        else:
            series.setdefault(label, {})[run["kv_budget"]] = value(run)
    return {m: [s.get(b) for b in budgets] for m, s in series.items()}, levels

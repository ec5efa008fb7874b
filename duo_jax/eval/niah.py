"""Needle in a haystack, compared across attention modes (full / duo / streaming / the other KV methods) in one run.

`run_niah` builds the prompts of every depth once per context length (`duo_jax.data.make_needle_prompt`),
generates them greedily in one batched `duo_jax.generate` call per mode, scores each cell (``score``: the share of
the needle's key words found; ``correct``: `score_contains`) and writes ``niah.json`` and the heat maps.
`evaluate_grid` is the loop shared with the passkey evaluation. Design and outputs: docs/evaluation.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duo_jax.data import niah_duoattention
from duo_jax.data.haystack import EVALUATION_HAYSTACK, concatenated_files, haystack_tokens
from duo_jax.data.niah import (
    NEEDLE_PASS_FRACTION,
    NeedlePrompt,
    make_needle_prompt,
    score_contains,
    score_needle,
)
from duo_jax.errors import DuoJaxError
from duo_jax.eval import report
from duo_jax.eval.modes import budget_tokens, check_kv_dtype_modes, check_modes, mode_settings, warn_if_calibrated_on
from duo_jax.eval.samples import check_decode_last, decode_last_protocol
from duo_jax.loading import Model
from duo_jax.pattern import Pattern

DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def bos_id(tokenizer: Any) -> int | None:
    """The BOS id to start prompts with: the tokenizer's own when it adds one to text (Llama), else None."""
    return getattr(tokenizer, "bos_id", None) if getattr(tokenizer, "add_bos", False) else None


def aggregate(cells: Sequence[dict], key: str | None = None) -> float | dict:
    """Accuracy (mean of ``correct``) over `cells`; with `key`, a dict {cell[key]: accuracy} in first-seen order."""
    if key is None:
        return float(np.mean([c["correct"] for c in cells])) if cells else float("nan")
    groups: dict = {}
    for cell in cells:
        groups.setdefault(cell[key], []).append(cell["correct"])
    return {k: float(np.mean(v)) for k, v in groups.items()}


def score_matrix(
    cells: Sequence[dict], lengths: Sequence[int], depths: Sequence[float], field: str = "score"
) -> np.ndarray:
    """[depths, lengths] of cell[field] (NaN where no cell was run); a depth with several cells is averaged."""
    total = np.zeros((len(depths), len(lengths)))
    count = np.zeros_like(total)
    row = {d: i for i, d in enumerate(depths)}
    column = {n: j for j, n in enumerate(lengths)}
    for cell in cells:
        i, j = row[cell["depth"]], column[cell["length"]]
        total[i, j] += float(cell[field])
        count[i, j] += 1
    with np.errstate(invalid="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def evaluate_grid(
    model: Model,
    modes: Sequence[str],
    lengths: Iterable[int],
    prompts_for: Callable[[int], list[NeedlePrompt]],
    *,
    pattern: Pattern | None,
    sparsity: float,
    sink: int,
    recent: int,
    max_new_tokens: int,
    chunk_size: int,
    score: Callable[[str, NeedlePrompt], float],
    correct: Callable[[str, NeedlePrompt], bool] | None = None,
    batch_size: int | None = None,
    kv_budget: float | None = None,
    scores: Pattern | None = None,
    kv_dtype: str | None = None,
    streaming_chunk: int | None = None,
    decode_last: int = 0,
    progress: bool = True,
) -> dict:
    """Generate the answer of every prompt in every mode; returns {"modes": {mode: result}}.

    prompts_for(length) gives the prompts of one context length (at most `length` tokens); they are
    generated in batches of `batch_size` (default: all at once). Every mode but full keeps `kv_budget` x
    `length` tokens per KV head, or `kv_budget` tokens where it is a count (None: duo's budget; see
    `duo_jax.eval.modes`); `scores` are the HeadKV head scores for headkv / duo_headkv; `kv_dtype` ("int8" /
    "int4") quantizes every mode's cache (`duo_jax.eval.modes.check_kv_dtype_modes`). `score(generated, prompt)`
    gives a cell's score in [0, 1]; a cell is correct when `correct(generated, prompt)` says so (default:
    `score_contains`). `decode_last`: the modes prefilled in one chunk (h2o, tova) run DuoAttention's appendix
    protocol for the prompts' last tokens (`duo_jax.eval.samples.decode_last_protocol`). Each mode's result holds
    its settings and cache bytes per length, prefill / decode seconds, the cells, and accuracy overall, per length
    and per depth.
    """
    from tqdm.auto import tqdm

    from duo_jax import generate

    modes = check_modes(modes)
    check_kv_dtype_modes(modes, kv_dtype)  # before any generation
    lengths = list(lengths)
    prompts = {n: prompts_for(n) for n in lengths}
    total = len(modes) * sum(len(p) for p in prompts.values())
    results = {
        m: dict(settings={}, cache_bytes={}, full_cache_bytes={}, prefill_s=0.0, decode_s=0.0, compile_s=0.0, cells=[])
        for m in modes
    }
    with tqdm(total=total, desc="generating", unit="prompt", disable=not progress) as bar:
        for length in lengths:
            batch = batch_size or len(prompts[length])
            context = length + max_new_tokens
            for mode in modes:
                settings = mode_settings(
                    mode,
                    model.config,
                    pattern,
                    sparsity=sparsity,
                    sink=sink,
                    recent=recent,
                    context=context,
                    kv_budget=budget_tokens(kv_budget, length),
                    scores=scores,
                    kv_dtype=kv_dtype,
                    streaming_chunk=streaming_chunk,
                )
                tail = 0
                if settings.one_chunk_prefill:  # the paper's appendix runs its NIAH baselines so
                    settings, tail = decode_last_protocol(settings, decode_last)
                result = results[mode]
                result["settings"][length] = settings.describe()
                bar.set_postfix_str(f"{mode} @ {length}")
                for start in range(0, len(prompts[length]), batch):
                    group = prompts[length][start : start + batch]
                    out = generate(
                        model,
                        [p.tokens.tolist() for p in group],
                        max_new_tokens=max_new_tokens,
                        chunk_size=length if settings.one_chunk_prefill else chunk_size,
                        context=context,
                        prompt_tail_steps=tail,
                        pad_batch=False,  # each length compiles its own shapes: padded rows would reuse nothing
                        **settings.generate_kwargs(),
                    )
                    result["cache_bytes"][length] = out.stats["cache_bytes"] // len(group)  # per sequence
                    result["full_cache_bytes"][length] = out.stats["full_cache_bytes"] // len(group)
                    for key in ("prefill_s", "decode_s", "compile_s"):
                        result[key] += out.stats[key]
                    texts = out.text if out.text is not None else [" ".join(map(str, t)) for t in out.tokens]
                    for prompt, text in zip(group, texts):
                        result["cells"].append(
                            dict(
                                length=length,
                                depth=prompt.depth,
                                answer=prompt.answer,
                                generated=text,
                                score=float(score(text, prompt)),
                                correct=bool(
                                    score_contains(text, prompt.answer, question=prompt.question)
                                    if correct is None
                                    else correct(text, prompt)
                                ),
                            )
                        )
                    bar.update(len(group))
    for result in results.values():
        result["accuracy"] = aggregate(result["cells"])
        result["accuracy_by_length"] = aggregate(result["cells"], "length")
        result["accuracy_by_depth"] = aggregate(result["cells"], "depth")
    return dict(modes=results)


def accuracy_table(results: dict, lengths: Sequence[int]) -> str:
    """Markdown: one row per mode, accuracy per length, overall, and KV cache per sequence at the longest."""
    longest = lengths[-1]
    rows = []
    for mode, r in results["modes"].items():
        by_length = r["accuracy_by_length"]
        rows.append(
            [
                mode,
                *[by_length.get(n) for n in lengths],
                r["accuracy"],
                report.human_bytes(r["cache_bytes"][longest]),
                f"{r['cache_bytes'][longest] / r['full_cache_bytes'][longest]:.1%}",
            ]
        )
    headers = ["mode", *[f"acc @ {n}" for n in lengths], "accuracy", f"KV cache @ {longest}", "of full"]
    return report.markdown_table(headers, rows)


def write_outputs(
    results: dict,
    out_dir: str | Path,
    task: str,
    lengths: Sequence[int],
    depths: Sequence[float],
    other_files: Sequence[Path] = (),
) -> list[Path]:
    """Write a heat map <task>_<mode>.png per mode, <task>_modes.png, then <task>.json (listing these and
    `other_files` under "files"); return the paths."""
    out_dir = Path(out_dir)
    paths, matrices, titles = list(other_files), {}, {}
    for mode, r in results["modes"].items():
        matrices[mode] = score_matrix(r["cells"], lengths, depths)
        titles[mode] = f"{mode}: accuracy {r['accuracy']:.0%}"
        paths.append(
            report.grid_heatmap(
                out_dir / f"{task}_{mode}.png", matrices[mode], lengths, depths, f"{task.upper()} {titles[mode]}"
            )
        )
    paths.append(report.grid_heatmaps(out_dir / f"{task}_modes.png", matrices, lengths, depths, titles))
    paths.append(out_dir / f"{task}.json")
    results["files"] = [str(p) for p in paths]
    report.write_json(paths[-1], results)
    return paths


PROTOCOLS = ("niah", "duoattention")


def run_niah(
    model: Model,
    modes: Sequence[str],
    *,
    pattern: Pattern | None,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    sparsity: float = 0.5,
    sink: int = 64,
    recent: int = 256,
    max_new_tokens: int | None = None,
    chunk_size: int = 512,
    haystack: str | None = None,
    batch_size: int | None = None,
    kv_budget: float | None = None,
    scores: Pattern | None = None,
    kv_dtype: str | None = None,
    streaming_chunk: int | None = None,
    protocol: str = "niah",
    decode_last: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """The NIAH grid in every mode; writes niah.json and the heat maps into `out_dir` when given.
    kv_budget: tokens kept per KV head by every mode but full, a fraction of each prompt's length or a
    number of tokens (`duo_jax.eval.modes.budget_tokens`; None: duo's);
    kv_dtype: "int8" / "int4" quantizes every mode's KV cache (None: the model's dtype); streaming_chunk: the duo
    modes' (`duo_jax.eval.modes.mode_settings`).
    protocol: "niah", this repository's prompts (`duo_jax.data.niah`: exactly `length` tokens, the needle at a
    sentence end; haystack default the essays' held-out half, 32 new tokens); "duoattention", DuoAttention's script
    (`duo_jax.data.niah_duoattention`: its needle, prompt and scoring; haystack default every essay, whole files,
    51 new tokens). decode_last: h2o and tova decode the prompts' last tokens one at a time, DuoAttention's
    appendix protocol for its NIAH baselines (50; `evaluate_grid`)."""
    if model.tokenizer is None:
        raise DuoJaxError("NIAH needs the model's tokenizer (none was found with the weights)")
    if protocol not in PROTOCOLS:
        raise DuoJaxError(f"unknown NIAH protocol {protocol!r}: choose from {', '.join(PROTOCOLS)}")
    check_decode_last(decode_last)
    duoattention = protocol == "duoattention"
    haystack = haystack or ("paul_graham" if duoattention else EVALUATION_HAYSTACK)
    max_new_tokens = max_new_tokens or (niah_duoattention.MAX_NEW_TOKENS if duoattention else 32)
    lengths, depths = sorted(set(lengths)), sorted(set(float(d) for d in depths))
    overlap = warn_if_calibrated_on(haystack, check_modes(modes), pattern, scores)
    if duoattention:
        text = niah_duoattention.repeated(model.tokenizer, concatenated_files(haystack), max(lengths))

        def prompts_for(length):
            context = niah_duoattention.context_ids(model.tokenizer, text, length)
            return [niah_duoattention.make_prompt(model.tokenizer, context, length, depth) for depth in depths]

        def score(text, prompt):
            return niah_duoattention.score(text)

        def correct(text, prompt):
            return niah_duoattention.score(text) >= NEEDLE_PASS_FRACTION

    else:
        hay = haystack_tokens(model.tokenizer, haystack, max(lengths))
        bos = bos_id(model.tokenizer)

        def prompts_for(length):
            return [make_needle_prompt(model.tokenizer, hay, length, depth, bos_id=bos) for depth in depths]

        def score(text, prompt):
            return score_needle(text, prompt.answer, question=prompt.question)

        correct = None

    start = time.perf_counter()
    results = evaluate_grid(
        model,
        modes,
        lengths,
        prompts_for,
        pattern=pattern,
        sparsity=sparsity,
        sink=sink,
        recent=recent,
        max_new_tokens=max_new_tokens,
        chunk_size=chunk_size,
        score=score,
        correct=correct,
        batch_size=batch_size,
        kv_budget=kv_budget,
        scores=scores,
        kv_dtype=kv_dtype,
        streaming_chunk=streaming_chunk,
        decode_last=decode_last,
        progress=progress,
    )
    results = dict(
        task="niah",
        decode_last=decode_last,
        protocol=protocol,
        model=model.config.name,
        source=model.source,
        haystack=haystack,
        calibration_overlap=overlap,
        lengths=lengths,
        depths=depths,
        sparsity=sparsity,
        sink=sink,
        recent=recent,
        kv_budget=kv_budget,
        kv_dtype=kv_dtype,
        streaming_chunk=streaming_chunk,
        max_new_tokens=max_new_tokens,
        chunk_size=chunk_size,
        dtype=str(model.params.dtype),
        wall_s=time.perf_counter() - start,
        machine=report.machine_info(),
        **results,
    )
    if out_dir is not None:
        write_outputs(results, out_dir, "niah", lengths, depths)
    return results

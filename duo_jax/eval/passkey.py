"""Passkey retrieval accuracy per context length, compared across attention modes in one run.

A prompt (`duo_jax.data.make_passkey_prompt`) hides a random numeric passkey in the repeated filler of the
passkey literature and ends with "What is the pass key? The pass key is". Each length is probed at several
depths (evenly spaced in [0, 1]), each prompt with its own passkey drawn from a generator seeded by
(seed, length), so every mode sees the same prompts. A cell is correct when the generated answer contains
the passkey as a whole number (`score_passkey`). Writes passkey.json, a depth x length heat map per mode,
the side-by-side heat maps and passkey_accuracy.png (accuracy against length, one line per mode).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from duo_jax.data.niah import MAX_PASSKEY_DIGITS, make_passkey_prompt, score_passkey
from duo_jax.errors import DuoJaxError
from duo_jax.eval import report
from duo_jax.eval.niah import bos_id, evaluate_grid, write_outputs
from duo_jax.loading import Model
from duo_jax.pattern import Pattern
from duo_jax.sampling import check_number

DEFAULT_LENGTHS = (1024, 2048, 4096)


def passkey_depths(n: int) -> list[float]:
    """`n` depths evenly spaced over [0, 1] (n = 1: the middle)."""
    if n < 1:
        raise DuoJaxError(f"need at least one depth per length, got {n}")
    return [0.5] if n == 1 else [float(d) for d in np.linspace(0.0, 1.0, n)]


def check_passkey_options(seed: int, digits: int) -> None:
    """The passkeys' seed (an integer >= 0: numpy's generator takes no negative seed) and digits (1 to
    `MAX_PASSKEY_DIGITS`, one int64 draw)."""
    check_number("seed", seed, integer=True, minimum=0)
    check_number("digits", digits, integer=True, minimum=1, maximum=MAX_PASSKEY_DIGITS)


def run_passkey(
    model: Model,
    modes: Sequence[str],
    *,
    pattern: Pattern | None,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths_per_length: int = 5,
    digits: int = 5,
    seed: int = 0,
    sparsity: float = 0.5,
    sink: int = 64,
    recent: int = 256,
    max_new_tokens: int = 12,
    chunk_size: int = 512,
    batch_size: int | None = None,
    kv_budget: float | None = None,
    scores: Pattern | None = None,
    kv_dtype: str | None = None,
    streaming_chunk: int | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Passkey accuracy per length in every mode; writes passkey.json and the figures into `out_dir` when given.
    kv_budget: tokens kept per KV head by every mode but full, a fraction of each prompt's length or a
    number of tokens (`duo_jax.eval.modes.budget_tokens`; None: duo's);
    kv_dtype: "int8" / "int4" quantizes every mode's KV cache (None: the model's dtype); streaming_chunk: the duo
    modes' (`duo_jax.eval.modes.mode_settings`)."""
    if model.tokenizer is None:
        raise DuoJaxError("passkey retrieval needs the model's tokenizer (none was found with the weights)")
    check_passkey_options(seed, digits)
    lengths, depths = sorted(set(lengths)), passkey_depths(depths_per_length)
    bos = bos_id(model.tokenizer)

    def prompts_for(length):
        rng = np.random.default_rng([seed, length])
        return [make_passkey_prompt(model.tokenizer, length, depth, rng, digits=digits, bos_id=bos) for depth in depths]

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
        score=lambda text, p: float(score_passkey(text, p.answer)),
        batch_size=batch_size,
        kv_budget=kv_budget,
        scores=scores,
        kv_dtype=kv_dtype,
        streaming_chunk=streaming_chunk,
        progress=progress,
    )
    results = dict(
        task="passkey",
        model=model.config.name,
        source=model.source,
        lengths=lengths,
        depths=depths,
        digits=digits,
        seed=seed,
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
        plot = report.line_plot(
            Path(out_dir) / "passkey_accuracy.png",
            lengths,
            {m: [r["accuracy_by_length"][n] for n in lengths] for m, r in results["modes"].items()},
            xlabel="context length (tokens)",
            ylabel="accuracy",
            logx=True,
            title=f"passkey retrieval, {model.config.name}",
        )
        write_outputs(results, out_dir, "passkey", lengths, depths, [plot])
    return results

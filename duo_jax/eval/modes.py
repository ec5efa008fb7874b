"""The attention modes an evaluation compares, each at the same KV-cache budget where that is the point.

The modes are ``full`` (the reference), ``duo``, ``streaming`` (every head a streaming head) and every other method
of the registry. `mode_settings` builds a mode for a context and a budget: duo's by default (`streaming_budget`),
a fraction of the evaluated length or a number of tokens (`budget_tokens`). `check_modes` and `check_kv_dtype_modes`
validate the requested modes; `warn_if_calibrated_on` warns when a mode's calibration shares text with what is
evaluated. How each mode meets the budget, exactly: docs/evaluation.md, "Modes and budgets".
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from duo_jax import methods
from duo_jax.cache import round_capacity
from duo_jax.config import ModelConfig
from duo_jax.data.haystack import CalibrationOverlapWarning, overlaps
from duo_jax.errors import DuoJaxError
from duo_jax.generation import build_method
from duo_jax.methods import Method
from duo_jax.methods.duo import fit_window, num_retrieval_heads  # noqa: F401  (re-exported: duo's budget rules)
from duo_jax.pattern import Pattern
from duo_jax.quant import check_kv_dtype

# The registered methods, plus "streaming": duo with every head a streaming head (absolute positions).
MODES = ("full", "duo", "streaming", *(m for m in methods.METHODS if m not in ("full", "duo")))


def one_chunk_prefill(mode: str) -> bool:
    """Whether the evaluations prefill mode `mode`'s prompt in one chunk (the registry's `one_chunk_prefill`: exact
    prefill, evicted once at its end; docs/evaluation.md). ``streaming`` runs duo, chunk by chunk."""
    return mode != "streaming" and methods.entry(mode).one_chunk_prefill


@dataclasses.dataclass(frozen=True)
class ModeSettings:
    """What one mode runs with at one context: a registered method and its options (`duo_jax.generate`'s
    keyword arguments), plus what the evaluation reports of it."""

    name: str
    method: str  # the registered method (`duo_jax.methods.METHODS`) the mode runs
    options: tuple[tuple[str, Any], ...] = ()  # that method's options (pattern, sparsity, sink, kv_budget, ...)
    kv_budget: int | None = None  # tokens per KV head on average; None: full attention

    def option(self, key: str, default=None):
        return dict(self.options).get(key, default)

    @property
    def pattern(self) -> Pattern | None:
        return self.option("pattern")

    @property
    def sparsity(self) -> float:
        return self.option("sparsity", 0.0)

    @property
    def sink(self) -> int | None:
        return self.option("sink", self.option("start"))

    @property
    def recent(self) -> int | None:
        return self.option("recent")

    @property
    def one_chunk_prefill(self) -> bool:
        return one_chunk_prefill(self.method)

    def retrieval_mask(self) -> np.ndarray | None:
        """bool [layers, kv_heads] (True: retrieval head), or None when the mode has no head pattern."""
        return None if self.pattern is None else self.pattern.retrieval_mask(self.sparsity)

    def generate_kwargs(self) -> dict:
        """Keyword arguments for `duo_jax.generate`."""
        return dict(method=self.method, **dict(self.options))

    def build(self, config: ModelConfig, context: int, model=None) -> Method:
        """The engine's KV-cache method for this mode with a capacity of `context` tokens (`model`: for the
        methods that calibrate on it)."""
        kwargs = self.generate_kwargs()
        return build_method(config, kwargs.pop("method"), context=context, model=model, **kwargs)

    def describe(self) -> dict:
        """JSON-friendly summary (no gates)."""
        return dict(
            name=self.name,
            method=self.method,
            sparsity=None if self.pattern is None else self.sparsity,
            sink=self.sink,
            recent=self.recent,
            kv_budget=self.kv_budget,
            kv_dtype=self.option("kv_dtype"),
            streaming_chunk=self.option("streaming_chunk"),
        )


def streaming_budget(config: ModelConfig, sparsity: float, context: int, *, sink: int, recent: int) -> int:
    """Tokens per head that give an all-streaming cache the bytes of duo's at `context` (docs/evaluation.md):
    floor((R*C + (N - R)*(sink + recent)) / N), C = round_capacity(context)."""
    heads = config.num_layers * config.num_kv_heads
    retrieval = num_retrieval_heads(config, sparsity)
    slots = retrieval * round_capacity(context) + (heads - retrieval) * (sink + recent)
    return slots // heads


def check_modes(names: Sequence[str]) -> list[str]:
    """The mode names, validated, without duplicates, in the order given."""
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise DuoJaxError(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}" if unknown else "no modes given")
    return names


def check_kv_dtype_modes(modes: Sequence[str], kv_dtype: str | None) -> str | None:
    """`kv_dtype` (None, "int8" or "int4"), checked against the modes: each must run a method with a quantized
    cache (the registry's `quantized_kv`; ``streaming`` runs duo). Raises a `DuoJaxError` naming the others."""
    if check_kv_dtype(kv_dtype) is None:
        return None
    refused = [m for m in check_modes(modes) if m != "streaming" and not methods.entry(m).quantized_kv]
    if refused:
        able = [m for m in MODES if m == "streaming" or methods.entry(m).quantized_kv]
        raise DuoJaxError(
            f"mode(s) {', '.join(refused)} have no quantized KV cache (kv_dtype={kv_dtype!r}); "
            f"evaluate them without --kv-dtype, or choose modes from {', '.join(able)}"
        )
    return kv_dtype


def mode_settings(
    name: str,
    config: ModelConfig,
    pattern: Pattern | None,
    *,
    sparsity: float,
    sink: int,
    recent: int,
    context: int,
    kv_budget: int | None = None,
    scores: Pattern | None = None,
    kv_dtype: str | None = None,
    streaming_chunk: int | None = None,
) -> ModeSettings:
    """The settings of mode `name` for prompts whose prompt + generated tokens fit in `context`.

    kv_budget: tokens per KV head (None: duo's budget, docs/evaluation.md); each method meets it by its
    own rule (`duo_jax.methods.registry`: `entry(name).budget`). `pattern` is needed by the methods built on
    one (duo, duo_headkv: a resolved `Pattern`), `scores` (HeadKV head scores) by headkv and duo_headkv.
    kv_dtype: "int8" / "int4" for a quantized cache (`check_kv_dtype_modes`), None for the model's dtype.
    streaming_chunk: duo's (`DuoAttention.streaming_chunk`); the other modes have none.
    """
    quantized = () if check_kv_dtype_modes([name], kv_dtype) is None else (("kv_dtype", kv_dtype),)
    settings = _mode_settings(
        name,
        config,
        pattern,
        sparsity=sparsity,
        sink=sink,
        recent=recent,
        context=context,
        kv_budget=kv_budget,
        scores=scores,
    )
    chunked = () if streaming_chunk is None or settings.method != "duo" else (("streaming_chunk", streaming_chunk),)
    return dataclasses.replace(settings, options=settings.options + quantized + chunked)


def _mode_settings(
    name: str,
    config: ModelConfig,
    pattern: Pattern | None,
    *,
    sparsity: float,
    sink: int,
    recent: int,
    context: int,
    kv_budget: int | None,
    scores: Pattern | None,
) -> ModeSettings:
    if sink < 0 or recent < 1:
        raise DuoJaxError(f"need sink >= 0 and recent >= 1, got sink={sink}, recent={recent}")
    check_modes([name])
    if name == "full":
        return ModeSettings("full", "full")
    spec = None if name == "streaming" else methods.entry(name)
    if spec is not None and spec.takes_pattern:
        if pattern is None:
            raise DuoJaxError(
                f"mode {name!r} needs a head pattern: pass --pattern PATH (or 'default' for the model's shipped one)"
            )
        pattern.validate(config)
    duo_budget = streaming_budget(config, sparsity, context, sink=sink, recent=recent)
    budget = duo_budget if kv_budget is None else int(kv_budget)
    if budget < 2:
        raise DuoJaxError(f"a KV budget of {budget} token(s) per head is too small (need >= 2)")
    if spec is None:  # StreamingLLM at absolute positions: every head a streaming head of duo's kind
        streaming_sink = min(sink, budget - 1)
        options = dict(
            pattern=Pattern.full(config.num_layers, config.num_kv_heads),
            sparsity=1.0,
            sink=streaming_sink,
            recent=budget - streaming_sink,
        )
        return ModeSettings("streaming", "duo", tuple(options.items()), budget)
    if spec.budget is None:
        raise DuoJaxError(
            f"mode {name!r} has no KV-budget rule, and the evaluations run every mode at a budget: register its method "
            "with budget= (duo_jax.methods.registry.register; registry.kv_budget_only where its kv_budget option is "
            "the budget itself; docs/adding-a-method.md, section 6)"
        )
    if "scores" in spec.options and scores is None:
        raise DuoJaxError(
            f"mode {name!r} needs HeadKV head scores: pass --scores PATH (written by "
            "python -m duo_jax.head_scores), or 'default' for the model's shipped ones"
        )
    options = spec.budget(
        config,
        budget,
        context=context,
        sink=sink,
        recent=recent,
        sparsity=sparsity,
        pattern=pattern,
        scores=scores,
        fitted=kv_budget is not None,
    )
    return ModeSettings(name, name, tuple(options.items()), budget)


def calibration_sources(modes: Sequence[str], pattern: Pattern | None, scores: Pattern | None) -> dict[str, str]:
    """{what was calibrated: the haystack it was calibrated on} for the calibrated inputs `modes` use; an input
    whose metadata does not name its text (e.g. the original repository's patterns) is left out."""
    sources = {}
    specs = [methods.entry(m) for m in modes if m in methods.METHODS]
    if pattern is not None and any(s.takes_pattern for s in specs) and (pattern.meta or {}).get("dataset_name"):
        sources["the DuoAttention pattern"] = pattern.meta["dataset_name"]
    if scores is not None and any("scores" in s.options for s in specs) and (scores.meta or {}).get("haystack"):
        sources["the HeadKV head scores"] = scores.meta["haystack"]
    for spec in specs:
        if spec.calibrated_on:
            sources[f"{spec.name}'s calibration"] = spec.calibrated_on
    return sources


def warn_if_calibrated_on(
    evaluated: str, modes: Sequence[str], pattern: Pattern | None, scores: Pattern | None
) -> list[str]:
    """Warn (`CalibrationOverlapWarning`) for each calibrated input of `modes` fitted on text that `evaluated`
    (a haystack source) shares; returns the warnings (results record them)."""
    found = [
        f"{what} was calibrated on {source!r}, which shares text with the evaluated {evaluated!r}: the "
        f"result is not held out (evaluate on 'paul_graham:evaluation' with inputs calibrated on "
        f"'paul_graham:calibration')"
        for what, source in calibration_sources(modes, pattern, scores).items()
        if overlaps(source, evaluated)
    ]
    for message in found:
        warnings.warn(message, CalibrationOverlapWarning, stacklevel=3)
    return found


def check_kv_budget(kv_budget: float | None) -> None:
    """A KV budget is a fraction in (0, 1] of the evaluated tokens, a whole number of tokens per KV head >= 2 (the
    "KV size" of the SnapKV, PyramidKV and HeadKV papers, the same for every prompt), or None (duo's own budget)."""
    if kv_budget is None or 0 < kv_budget <= 1:
        return
    if not (kv_budget >= 2 and float(kv_budget).is_integer()):
        raise DuoJaxError(
            f"a KV budget is a fraction in (0, 1] of the evaluated tokens or a whole number of tokens per KV head "
            f">= 2, got {kv_budget}"
        )


def is_token_budget(kv_budget: float | None) -> bool:
    """Whether `kv_budget` (checked by `check_kv_budget`) is a number of tokens rather than a fraction."""
    return kv_budget is not None and kv_budget > 1


def check_kv_budgets(kv_budgets: Sequence[float | None]) -> None:
    """Each budget checked (`check_kv_budget`), and all fractions or all token counts: an evaluation's figure
    draws them on one axis."""
    for budget in kv_budgets:
        check_kv_budget(budget)
    kinds = {is_token_budget(b) for b in kv_budgets if b is not None}
    if len(kinds) > 1:
        raise DuoJaxError(
            f"KV budgets {', '.join(f'{b:g}' for b in kv_budgets if b is not None)} mix fractions of the prompt with "
            "token counts: evaluate each kind in a run of its own"
        )


def budget_tokens(kv_budget: float | None, length: int) -> int | None:
    """The budget in tokens per KV head for `length` evaluated tokens: a fraction `kv_budget` of them (at least 2),
    or `kv_budget` itself where it is a token count (None: None)."""
    check_kv_budget(kv_budget)
    if kv_budget is None:
        return None
    return int(kv_budget) if is_token_budget(kv_budget) else max(2, int(kv_budget * length))

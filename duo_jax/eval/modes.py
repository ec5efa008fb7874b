"""The attention modes an evaluation compares, each at the same KV-cache budget where that is the point.

- ``full``: every head is a retrieval head (``pattern=None``): the reference.
- ``duo``: DuoAttention: the pattern binarised at `sparsity` (the fraction of streaming heads); retrieval
  heads keep every token, streaming heads keep ``sink + recent``.
- ``streaming``: StreamingLLM, every head a streaming head (a pattern at sparsity 1, absolute positions),
  with its window widened to the budget.
- the engine's other methods (`duo_jax.methods`): ``streaming_llm`` (re-indexed positions), ``h2o``, ``tova``,
  ``snapkv``, ``pyramidkv``, ``headkv``, ``duo_headkv`` and ``infinigen``, each at the budget.

The budget is a number of cached tokens per KV head on average (the methods' `kv_budget`):

- by default, **duo's budget**. With N = layers x KV heads heads of which R are retrieval heads (r = R / N), a
  cache of capacity C tokens (the context rounded up to `duo_jax.cache.CAPACITY_BLOCK`) and duo's window
  S = sink + recent, duo stores R*C + (N - R)*S token slots per K and per V, i.e. on average per head

      budget = r*C + (1 - r)*S   tokens,

  rounded down to a whole token (`streaming_budget`). The streaming mode keeps duo's `sink` and uses
  ``recent = budget - sink``, so its cache is never larger than duo's and smaller by less than N slots
  (exactly equal whenever N divides R*C + (N - R)*S, e.g. SmolLM2-135M (N = 90) at sparsity 0.5). R depends
  only on the sparsity (`Pattern.retrieval_mask` keeps exactly round((1 - s) * N) heads).
- with ``kv_budget=F`` (0 < F <= 1), **F x the evaluated length** in tokens (the prompt for NIAH / passkey,
  the window for perplexity). duo then picks the sparsity at which r*C + (1 - r)*S meets it
  (`duo_jax.methods.duo_sparsity_for_budget`), shrinking its window S to half the budget when S is larger
  (`fit_window`), so that some heads can still be retrieval heads.

duo_headkv (DuoAttention whose retrieval heads keep HeadKV budgets) keeps the pattern at `sparsity`, duo's
window on its streaming heads (fitted the same way), and gives its retrieval heads (N*budget - (N - R)*S) / R tokens each on
average, so its total matches the budget too. h2o and tova prefill the whole prompt in one chunk (exact
attention, one eviction at its end, as the DuoAttention paper runs them); the others use the evaluation's chunk.
What each mode really stores is measured (``cache_bytes`` in the results), not assumed.

Evaluations run on the evaluation half of the essays by default (`duo_jax.data.EVALUATION_HAYSTACK`), and
`warn_if_calibrated_on` warns when a mode's calibration (the DuoAttention pattern's training text, the HeadKV
scores' haystack, InfiniGen's skew sample) shares text with what is evaluated.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import numpy as np

from duo_jax.cache import round_capacity
from duo_jax.config import ModelConfig
from duo_jax.data.haystack import CALIBRATION_HAYSTACK, CalibrationOverlapWarning, overlaps
from duo_jax.errors import DuoJaxError
from duo_jax.generation import build_method
from duo_jax.methods import InfiniGen, Method, duo_sparsity_for_budget
from duo_jax.methods.infinigen import skew_on_text
from duo_jax.pattern import Pattern

MODES = ("full", "duo", "streaming", "streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "headkv",
         "duo_headkv", "infinigen")
ONE_CHUNK_PREFILL = ("h2o", "tova")  # exact prefill, evict once at its end (see the module docstring)


@dataclasses.dataclass(frozen=True)
class ModeSettings:
    """What one mode runs with at one context: the arguments `duo_jax.generate` takes, plus its mask."""

    name: str
    pattern: Pattern | None  # duo / streaming / duo_headkv: the head pattern; None otherwise
    sparsity: float
    sink: int
    recent: int
    kv_budget: int | None = None  # tokens per KV head on average; None: full attention
    method: str = ""  # the engine's method name ("" for full / duo / streaming: derived from the pattern)
    options: tuple[tuple[str, Any], ...] = ()  # further make_method options (e.g. HeadKV scores)
    instance: Method | None = None  # a built method (InfiniGen, which needs calibration)

    @property
    def one_chunk_prefill(self) -> bool:
        return self.method in ONE_CHUNK_PREFILL

    def retrieval_mask(self) -> np.ndarray | None:
        """bool [layers, kv_heads] (True: retrieval head), or None when the mode has no head pattern."""
        return None if self.pattern is None else self.pattern.retrieval_mask(self.sparsity)

    def generate_kwargs(self) -> dict:
        """Keyword arguments for `duo_jax.generate`."""
        if self.instance is not None:
            return dict(method=self.instance)
        if self.method:
            return dict(method=self.method, **dict(self.options))
        if self.pattern is None:
            return dict(method="full")
        return dict(method="duo", pattern=self.pattern, sparsity=self.sparsity, sink=self.sink, recent=self.recent)

    def build(self, config: ModelConfig, context: int) -> Method:
        """The engine's KV-cache method for this mode with a capacity of `context` tokens."""
        return build_method(config, context=context, **self.generate_kwargs())

    def describe(self) -> dict:
        """JSON-friendly summary (no gates)."""
        windowed = self.pattern is not None or self.method == "streaming_llm"
        return dict(name=self.name, method=self.method or ("full" if self.pattern is None else "duo"),
                    sparsity=None if self.pattern is None else self.sparsity,
                    sink=self.sink if windowed else None, recent=self.recent if windowed else None,
                    kv_budget=self.kv_budget)


def num_retrieval_heads(config: ModelConfig, sparsity: float) -> int:
    """How many retrieval heads any pattern keeps at `sparsity` (independent of the gate values)."""
    return int(Pattern.full(config.num_layers, config.num_kv_heads).retrieval_mask(sparsity).sum())


def streaming_budget(config: ModelConfig, sparsity: float, context: int, *, sink: int, recent: int) -> int:
    """Tokens per head that give an all-streaming cache the bytes of duo's at `context` (module docstring):
    floor((R*C + (N - R)*(sink + recent)) / N), C = round_capacity(context)."""
    heads = config.num_layers * config.num_kv_heads
    retrieval = num_retrieval_heads(config, sparsity)
    slots = retrieval * round_capacity(context) + (heads - retrieval) * (sink + recent)
    return slots // heads


def fit_window(budget: int, sink: int, recent: int) -> tuple[int, int]:
    """duo's (sink, recent) for a `budget` of tokens per head: unchanged when sink + recent <= budget / 2,
    else both scaled down to fill half the budget (recent >= 1)."""
    if sink + recent <= budget // 2:
        return sink, recent
    scale = (budget // 2) / (sink + recent)
    return int(sink * scale), max(1, int(recent * scale))


def check_modes(names: Sequence[str]) -> list[str]:
    """The mode names, validated, without duplicates, in the order given."""
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise DuoJaxError(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}" if unknown
                          else "no modes given")
    return names


def mode_settings(name: str, config: ModelConfig, pattern: Pattern | None, *, sparsity: float, sink: int,
                  recent: int, context: int, kv_budget: int | None = None, scores: Pattern | None = None,
                  skew: tuple[np.ndarray, np.ndarray] | None = None) -> ModeSettings:
    """The settings of mode `name` for prompts whose prompt + generated tokens fit in `context`.

    kv_budget: tokens per KV head (None: duo's budget, see the module docstring). `pattern` is needed by duo
    and duo_headkv (a resolved `Pattern`), `scores` (HeadKV head scores) by headkv and duo_headkv, `skew`
    (`duo_jax.methods.infinigen.skew` of the model) by infinigen.
    """
    if sink < 0 or recent < 1:
        raise DuoJaxError(f"need sink >= 0 and recent >= 1, got sink={sink}, recent={recent}")
    if name not in MODES:
        raise DuoJaxError(f"unknown mode {name!r}: choose from {', '.join(MODES)}")
    if name == "full":
        return ModeSettings("full", None, 0.0, sink, recent)
    if name in ("duo", "duo_headkv"):
        if pattern is None:
            raise DuoJaxError(f"mode {name!r} needs a head pattern: pass --pattern PATH (or 'default' for the "
                              "model's shipped one)")
        pattern.validate(config)
    duo_budget = streaming_budget(config, sparsity, context, sink=sink, recent=recent)
    budget = duo_budget if kv_budget is None else int(kv_budget)
    if budget < 2:
        raise DuoJaxError(f"a KV budget of {budget} token(s) per head is too small (need >= 2)")
    if name == "duo":
        if kv_budget is None:
            return ModeSettings("duo", pattern, sparsity, sink, recent, duo_budget)
        sink, recent = fit_window(budget, sink, recent)
        sparsity = duo_sparsity_for_budget(budget, context=round_capacity(context), window=sink + recent)
        return ModeSettings("duo", pattern, sparsity, sink, recent, budget)
    if name == "streaming":
        streaming_sink = min(sink, budget - 1)
        return ModeSettings("streaming", Pattern.full(config.num_layers, config.num_kv_heads), 1.0,
                            streaming_sink, budget - streaming_sink, budget)
    if name == "streaming_llm":
        start = min(4, budget - 1)  # StreamingLLM's 4 attention sinks
        return ModeSettings(name, None, 1.0, start, budget - start, budget, method=name,
                            options=(("kv_budget", budget), ("sink", start)))
    if name in ("headkv", "duo_headkv") and scores is None:
        raise DuoJaxError(f"mode {name!r} needs HeadKV head scores: pass --scores PATH (written by "
                          "python -m duo_jax.head_scores), or 'default' for the model's shipped ones")
    if name == "duo_headkv":
        if kv_budget is not None:
            sink, recent = fit_window(budget, sink, recent)
        heads = config.num_layers * config.num_kv_heads
        retrieval = num_retrieval_heads(config, sparsity)
        per_retrieval = (heads * budget - (heads - retrieval) * (sink + recent)) // max(retrieval, 1)
        if retrieval == 0 or per_retrieval < 1:
            raise DuoJaxError(f"duo_headkv at sparsity {sparsity} with a window of {sink + recent} cannot meet a "
                              f"budget of {budget} tokens per head: lower the sparsity or the window")
        return ModeSettings(name, pattern, sparsity, sink, recent, budget, method=name,
                            options=(("pattern", pattern), ("sparsity", sparsity), ("sink", sink),
                                     ("recent", recent), ("scores", scores), ("kv_budget", per_retrieval)))
    if name == "infinigen":
        if skew is None:
            raise DuoJaxError("mode 'infinigen' needs the model's skewing matrices (duo_jax.methods.infinigen.skew)")
        instance = InfiniGen.from_skew(*skew, context=context, kv_budget=budget)
        return ModeSettings(name, None, 0.0, sink, recent, budget, method=name, instance=instance)
    options = (("kv_budget", budget),) + ((("scores", scores),) if name == "headkv" else ())
    return ModeSettings(name, None, 0.0, sink, recent, budget, method=name, options=options)


def calibration_sources(modes: Sequence[str], pattern: Pattern | None, scores: Pattern | None) -> dict[str, str]:
    """{what was calibrated: the haystack it was calibrated on} for the calibrated inputs `modes` use; an input
    whose metadata does not name its text (e.g. the original repository's patterns) is left out."""
    sources = {}
    if pattern is not None and {"duo", "duo_headkv"} & set(modes) and (pattern.meta or {}).get("dataset_name"):
        sources["the DuoAttention pattern"] = pattern.meta["dataset_name"]
    if scores is not None and {"headkv", "duo_headkv"} & set(modes) and (scores.meta or {}).get("haystack"):
        sources["the HeadKV head scores"] = scores.meta["haystack"]
    if "infinigen" in modes:
        sources["InfiniGen's skew"] = CALIBRATION_HAYSTACK  # `skew_on_text`
    return sources


def warn_if_calibrated_on(evaluated: str, modes: Sequence[str], pattern: Pattern | None,
                          scores: Pattern | None) -> list[str]:
    """Warn (`CalibrationOverlapWarning`) for each calibrated input of `modes` fitted on text that `evaluated`
    (a haystack source) shares; returns the warnings (results record them)."""
    found = [f"{what} was calibrated on {source!r}, which shares text with the evaluated {evaluated!r}: the "
             f"result is not held out (evaluate on 'paul_graham:evaluation' with inputs calibrated on "
             f"'paul_graham:calibration')"
             for what, source in calibration_sources(modes, pattern, scores).items() if overlaps(source, evaluated)]
    for message in found:
        warnings.warn(message, CalibrationOverlapWarning, stacklevel=3)
    return found


def budget_tokens(kv_budget: float | None, length: int) -> int | None:
    """The budget in tokens per KV head for a fraction `kv_budget` of `length` evaluated tokens (None: None)."""
    if kv_budget is None:
        return None
    if not 0 < kv_budget <= 1:
        raise DuoJaxError(f"kv_budget is a fraction of the evaluated length in (0, 1], got {kv_budget}")
    return max(2, int(kv_budget * length))


def infinigen_skew(model) -> tuple[np.ndarray, np.ndarray]:
    """InfiniGen's offline skewing of `model`, on a sample of the essays (`skew_on_text`)."""
    return skew_on_text(model.params, model.config, model.tokenizer)

"""The attention modes an evaluation compares, each at the same KV-cache budget where that is the point.

- ``full``: every head is a retrieval head (``pattern=None``): the reference.
- ``duo``: DuoAttention: the pattern binarised at `sparsity` (the fraction of streaming heads); retrieval
  heads keep every token, streaming heads keep ``sink + recent``.
- ``streaming``: StreamingLLM: every head is a streaming head (a pattern at sparsity 1), with its window
  widened so that its cache holds **exactly as many bytes as duo's** at the same context.

The budget matching. With N = layers x KV heads heads of which R are retrieval heads (r = R / N), a cache of
capacity C tokens (the context rounded up to `duo_jax.cache.CAPACITY_BLOCK`) and duo's window
S = sink + recent, duo stores R*C + (N - R)*S token slots per K and per V, i.e. on average per head

    budget = r*C + (1 - r)*S   tokens.

The streaming mode gives every head that many slots: it keeps duo's `sink` and uses ``recent = budget - sink``.
Both caches then take ``N * budget`` slots. `budget` is rounded down to a whole token, so the streaming cache
is never larger than duo's and smaller by less than N slots (less than one token per head); it is exactly
equal whenever N divides R*C + (N - R)*S, e.g. SmolLM2-135M (N = 90) at sparsity 0.5.
R depends only on the sparsity (`Pattern.retrieval_mask` keeps exactly round((1 - s) * N) heads), so the
streaming mode needs no trained pattern.

The streaming mode runs the engine's ``duo`` method at sparsity 1 (every head a streaming head, keys at their
absolute positions), so it differs from ``duo`` only in which heads keep everything and in its window. The
engine's ``streaming_llm`` method re-indexes positions inside the cache instead; that matters only past the
model's trained context, which these evaluations never reach.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from duo_jax.cache import round_capacity
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.generation import build_method
from duo_jax.methods import Method
from duo_jax.pattern import Pattern

MODES = ("full", "duo", "streaming")


@dataclasses.dataclass(frozen=True)
class ModeSettings:
    """What one mode runs with at one context: the arguments `duo_jax.generate` takes, plus its mask."""

    name: str
    pattern: Pattern | None  # None: full attention
    sparsity: float
    sink: int
    recent: int

    def retrieval_mask(self) -> np.ndarray | None:
        """bool [layers, kv_heads] (True: retrieval head), or None for full attention."""
        return None if self.pattern is None else self.pattern.retrieval_mask(self.sparsity)

    def generate_kwargs(self) -> dict:
        """Keyword arguments for `duo_jax.generate` (the engine's "full" or "duo" method)."""
        if self.pattern is None:
            return dict(method="full")
        return dict(method="duo", pattern=self.pattern, sparsity=self.sparsity, sink=self.sink, recent=self.recent)

    def build(self, config: ModelConfig, context: int) -> Method:
        """The engine's KV-cache method for this mode with a capacity of `context` tokens."""
        return build_method(config, context=context, **self.generate_kwargs())

    def describe(self) -> dict:
        """JSON-friendly summary (no gates)."""
        return dict(name=self.name, sparsity=None if self.pattern is None else self.sparsity,
                    sink=None if self.pattern is None else self.sink,
                    recent=None if self.pattern is None else self.recent)


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


def check_modes(names: Sequence[str]) -> list[str]:
    """The mode names, validated, without duplicates, in the order given."""
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise DuoJaxError(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}" if unknown
                          else "no modes given")
    return names


def mode_settings(name: str, config: ModelConfig, pattern: Pattern | None, *, sparsity: float, sink: int,
                  recent: int, context: int) -> ModeSettings:
    """The settings of mode `name` for prompts whose prompt + generated tokens fit in `context`.

    `pattern` is needed by ``duo`` only (a resolved `Pattern`, checked against `config`).
    """
    if sink < 0 or recent < 1:
        raise DuoJaxError(f"need sink >= 0 and recent >= 1, got sink={sink}, recent={recent}")
    if name == "full":
        return ModeSettings("full", None, 0.0, sink, recent)
    if name == "duo":
        if pattern is None:
            raise DuoJaxError("mode 'duo' needs a head pattern: pass --pattern PATH (or 'default' for the "
                              "model's shipped one)")
        pattern.validate(config)
        return ModeSettings("duo", pattern, sparsity, sink, recent)
    if name == "streaming":
        budget = streaming_budget(config, sparsity, context, sink=sink, recent=recent)
        streaming_sink = min(sink, budget - 1)
        return ModeSettings("streaming", Pattern.full(config.num_layers, config.num_kv_heads), 1.0,
                            streaming_sink, budget - streaming_sink)
    raise DuoJaxError(f"unknown mode {name!r}: choose from {', '.join(MODES)}")

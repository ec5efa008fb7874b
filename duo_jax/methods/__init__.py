"""KV-cache methods, one module each, all run by the same engine (`duo_jax.engine.extend`).

`make_method(name, config, context=..., **options)` builds one; `METHODS` lists the names:
  full           every head keeps every token
  duo            DuoAttention: a head pattern binarised at `sparsity`; retrieval heads full, streaming
                 heads `sink` + `recent` tokens (absolute positions)
  streaming_llm  StreamingLLM: every head keeps `start` sinks + `recent` tokens, positions re-indexed
"""

from __future__ import annotations

import numpy as np

from duo_jax.cache import make_layout
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step, cache_nbytes
from duo_jax.methods.duo import DuoAttention
from duo_jax.methods.streaming_llm import StreamingLLM
from duo_jax.pattern import Pattern

METHODS = ("full", "duo", "streaming_llm")
_OPTIONS = {"full": set(), "duo": {"pattern", "sparsity", "sink", "recent"},
            "streaming_llm": {"start", "recent"}}

__all__ = ["METHODS", "DuoAttention", "Method", "Step", "StreamingLLM", "cache_nbytes", "make_method"]


def make_method(name: str, config: ModelConfig, *, context: int, **options) -> Method:
    """The method `name` for `config` with a retrieval capacity of `context` tokens.

    Options (each method takes only its own): duo: pattern (a `Pattern` already validated against the
    model), sparsity, sink, recent; streaming_llm: start, recent.
    """
    if name not in METHODS:
        raise DuoJaxError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    unknown = set(options) - _OPTIONS[name]
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS[name])) or "none"
        raise DuoJaxError(f"method {name!r} does not take {', '.join(sorted(unknown))} (its options: {allowed})")
    if name == "full":
        return DuoAttention(make_layout(config, None, sink=0, recent=0, context=context))
    if name == "duo":
        pattern: Pattern | None = options.get("pattern")
        if pattern is None:
            raise DuoJaxError("method 'duo' needs a head pattern (pattern=PATH, a Pattern, or 'default')")
        mask = pattern.retrieval_mask(options.get("sparsity", 0.5))
        layout = make_layout(config, mask, sink=options.get("sink", 64), recent=options.get("recent", 256),
                             context=context)
        return DuoAttention(layout, tuple(map(tuple, np.asarray(mask, bool).tolist())))
    start, recent = options.get("start", 4), options.get("recent", 256)
    if start < 0 or recent < 0:
        raise DuoJaxError(f"start and recent must be >= 0, got start={start}, recent={recent}")
    return StreamingLLM(config.num_layers, config.num_kv_heads, config.head_dim, start, recent)

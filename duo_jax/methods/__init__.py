"""KV-cache methods, one module each, all run by the same engine (`duo_jax.engine.extend`).

`make_method(name, config, context=..., **options)` builds one; `METHODS` lists the names:
  full           every head keeps every token
  duo            DuoAttention: a head pattern binarised at `sparsity`; retrieval heads full, streaming
                 heads `sink` + `recent` tokens (absolute positions)
  streaming_llm  StreamingLLM: every head keeps `start` sinks + `recent` tokens, positions re-indexed
  h2o            heavy hitters by accumulated attention + the `recent` newest tokens, `kv_budget` per head
  tova           the tokens the newest query attends to most (layer-wide), `kv_budget` per head
  snapkv         exact prefill, then per KV head the kv_budget tokens the last `window` queries vote for
                 (window included)
  pyramidkv      snapkv with per-layer budgets shrinking bottom to top (beta 20), kv_budget on average
  headkv         snapkv with per-head budgets from HeadKV scores (scores=PATH from python -m duo_jax.head_scores)
  duo_headkv     duo whose retrieval heads keep HeadKV budgets (kv_budget per retrieval head) instead of every
                 token
InfiniGen needs the model's weights to calibrate, so it is built as an instance and passed as `method=`:
  InfiniGen.calibrate(params, config, sample_tokens, context=..., kv_budget=..., partial_ratio=0.2): SVD-skewed
  partial keys speculate which tokens each decode step fetches from a host-memory full cache (the authors' Llama
  rules by default: alpha 5, layers 0-1 dense, partial channels from the top |QA| and |KA| columns)
"""

from __future__ import annotations

import numpy as np

from duo_jax.cache import make_layout, round_capacity
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step, cache_nbytes
from duo_jax.methods.duo import DuoAttention
from duo_jax.methods.eviction import H2O, TOVA
from duo_jax.methods.headkv import make_duo_headkv, make_headkv, resolve_scores
from duo_jax.methods.infinigen import InfiniGen
from duo_jax.methods.snapkv import make_pyramidkv, make_snapkv
from duo_jax.methods.streaming_llm import StreamingLLM
from duo_jax.pattern import Pattern
from duo_jax.quant import check_kv_dtype

QUANTIZED_KV_METHODS = ("full", "duo", "streaming_llm")  # kv_dtype="int8" / "int4" (`duo_jax.quant`)
METHODS = ("full", "duo", "streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "headkv", "duo_headkv")
_OPTIONS = {"full": set(), "duo": {"pattern", "sparsity", "sink", "recent", "kv_budget"},
            "streaming_llm": {"start", "recent", "kv_budget"}, "h2o": {"kv_budget", "recent"},
            "tova": {"kv_budget"},
            "snapkv": {"kv_budget", "window", "kernel", "pooling"},
            "pyramidkv": {"kv_budget", "window", "kernel", "pooling", "beta"},
            "headkv": {"kv_budget", "scores", "beta", "window", "kernel", "pooling"},
            "duo_headkv": {"pattern", "sparsity", "sink", "recent", "scores", "kv_budget", "beta", "window",
                           "kernel", "pooling"}}
_COMPRESSION = {"snapkv": make_snapkv, "pyramidkv": make_pyramidkv, "headkv": make_headkv,
                "duo_headkv": make_duo_headkv}

__all__ = ["H2O", "InfiniGen", "METHODS", "TOVA", "DuoAttention", "Method", "Step", "StreamingLLM", "cache_nbytes", "duo_sparsity_for_budget",
           "make_method"]


def make_method(name: str, config: ModelConfig, *, context: int, **options) -> Method:
    """The method `name` for `config` with a retrieval capacity of `context` tokens.

    Options (each method takes only its own): duo: pattern (a `Pattern` already validated against the
    model), sparsity, sink, recent; streaming_llm: start, recent; h2o: kv_budget (required), recent
    (default kv_budget // 2, the paper's equal split); tova: kv_budget (required). `kv_budget` (average tokens kept per
    KV head at `context` tokens) makes budgets comparable across methods: duo then picks the sparsity whose
    mix r * C + (1 - r) * (sink + recent) meets it (C: `context` rounded up to the cache capacity block),
    streaming_llm sets recent = kv_budget - start. `kv_dtype` ("int8" / "int4"; full, duo and streaming_llm)
    quantizes the cache (`duo_jax.quant`).
    """
    if name not in METHODS:
        raise DuoJaxError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    kv_dtype = check_kv_dtype(options.pop("kv_dtype", None))
    if kv_dtype is not None and name not in QUANTIZED_KV_METHODS:
        raise DuoJaxError(f"method {name!r} does not support a quantized KV cache (kv_dtype={kv_dtype!r}); "
                          f"use one of {', '.join(QUANTIZED_KV_METHODS)}, or kv_dtype=None")
    unknown = set(options) - _OPTIONS[name]
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS[name])) or "none"
        raise DuoJaxError(f"method {name!r} does not take {', '.join(sorted(unknown))} (its options: {allowed})")
    if name == "full":
        return DuoAttention(make_layout(config, None, sink=0, recent=0, context=context, kv_dtype=kv_dtype))
    budget = options.get("kv_budget")
    if budget is not None and not 0 < budget:
        raise DuoJaxError(f"kv_budget (tokens kept per KV head) must be positive, got {budget}")
    if name in _COMPRESSION:
        if name in ("headkv", "duo_headkv"):
            scores = resolve_scores(options.get("scores"), config)
            if scores is None:
                raise DuoJaxError(f"method {name!r} needs head scores: scores=PATH (written by "
                                  "python -m duo_jax.head_scores), 'default' (the model's shipped ones) or a Pattern")
            options = dict(options, scores=scores)
        if name == "duo_headkv" and options.get("pattern") is None:
            raise DuoJaxError("method 'duo_headkv' needs a head pattern (pattern=PATH, a Pattern, or 'default')")
        return _COMPRESSION[name](config, context=context, **options)
    if name == "duo":
        pattern: Pattern | None = options.get("pattern")
        if pattern is None:
            raise DuoJaxError("method 'duo' needs a head pattern (pattern=PATH, a Pattern, or 'default')")
        sink, recent = options.get("sink", 64), options.get("recent", 256)
        sparsity = options.get("sparsity", 0.5) if budget is None else duo_sparsity_for_budget(
            budget, context=round_capacity(context), window=sink + recent)  # the slots a retrieval head has
        mask = pattern.retrieval_mask(sparsity)
        layout = make_layout(config, mask, sink=sink, recent=recent, context=context, kv_dtype=kv_dtype)
        return DuoAttention(layout, tuple(map(tuple, np.asarray(mask, bool).tolist())))
    dims = (config.num_layers, config.num_kv_heads, config.head_dim)
    if name in ("h2o", "tova"):
        if budget is None:
            raise DuoJaxError(f"method {name!r} needs kv_budget (tokens kept per KV head)")
        if name == "tova":
            return TOVA(*dims, int(budget))
        recent = options.get("recent", int(budget) // 2)
        if not 0 <= recent <= budget:
            raise DuoJaxError(f"h2o's recent window must lie in [0, kv_budget={budget}], got {recent}")
        return H2O(*dims, int(budget), recent)
    start = options.get("start", 4)
    recent = options.get("recent", 256) if budget is None else budget - start
    if start < 0 or recent < 0:
        raise DuoJaxError(f"start and recent must be >= 0, got start={start}, recent={recent}")
    return StreamingLLM(*dims, start, recent, kv_dtype)


def duo_sparsity_for_budget(kv_budget: float, *, context: int, window: int) -> float:
    """The sparsity at which DuoAttention keeps `kv_budget` tokens per KV head on average at `context` tokens:
    retrieval fraction r with r * context + (1 - r) * window = kv_budget (clipped to [0, 1])."""
    if context <= window:
        return 1.0  # streaming heads already hold the whole context
    r = (kv_budget - window) / (context - window)
    return float(1.0 - min(max(r, 0.0), 1.0))

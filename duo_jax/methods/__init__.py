"""KV-cache methods, one module each, all run by the same engine (`duo_jax.engine`), registered by name in
`duo_jax.methods.registry` by their own modules.

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
  infinigen      SVD-skewed partial keys speculate which tokens each decode step fetches from a host-memory
                 full cache (the authors' Llama rules by default: alpha 5, layers 0-1 dense, partial channels
                 from the top |QA| and |KA| columns); calibrates on the model (make_method(..., model=model)),
                 or build one with InfiniGen.calibrate(params, config, sample_tokens, ...)

Adding a method is one module: its spec (a frozen dataclass `Method`), its cache, its state, and a builder
decorated with `registry.register(name, options=..., summary=...)`, imported below.
"""

from __future__ import annotations

# The method modules register themselves on import (order: the listing above).
from duo_jax.methods import duo, eviction, headkv, infinigen, snapkv, streaming_llm  # noqa: F401,I001
from duo_jax.methods.base import Method, Step, cache_nbytes
from duo_jax.methods.duo import DuoAttention, duo_sparsity_for_budget
from duo_jax.methods.eviction import H2O, TOVA
from duo_jax.methods.infinigen import InfiniGen
from duo_jax.methods.registry import entry, make_method, names
from duo_jax.methods.streaming_llm import StreamingLLM

METHODS = names()
QUANTIZED_KV_METHODS = tuple(m for m in METHODS if entry(m).quantized_kv)  # kv_dtype="int8" / "int4" (`duo_jax.quant`)

__all__ = [
    "H2O",
    "InfiniGen",
    "METHODS",
    "QUANTIZED_KV_METHODS",
    "TOVA",
    "DuoAttention",
    "Method",
    "Step",
    "StreamingLLM",
    "cache_nbytes",
    "duo_sparsity_for_budget",
    "entry",
    "make_method",
]

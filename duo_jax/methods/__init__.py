"""KV-cache methods, one module each, all run by the same engine (`duo_jax.engine`), registered by name in
`duo_jax.methods.registry` by their own modules.

`make_method(name, config, context=..., **options)` builds one; `METHODS` lists the names, `describe()` each
one's summary (what the CLIs' help prints); docs/methods.md says what each keeps, its options and its paper.

A method's code is one module: its spec (a frozen dataclass subclassing `Method`, whose docstring lists the
hooks to write), its cache, and a builder decorated with `registry.register(name, summary=...)`, imported below;
besides, it has its test file, a section in docs/methods.md and a row in the README's table (the checklist:
docs/adding-a-method.md).
"""

from __future__ import annotations

# The method modules register themselves on import, in this order (`names()`, the help texts' lists).
# isort: off
from duo_jax.methods import duo, streaming_llm, eviction, snapkv, headkv, infinigen  # noqa: F401

# isort: on
from duo_jax.methods.base import KVRotation, Method, Step, cache_nbytes, kv_rotation_for
from duo_jax.methods.duo import DuoAttention, duo_sparsity_for_budget
from duo_jax.methods.eviction import H2O, TOVA
from duo_jax.methods.infinigen import InfiniGen
from duo_jax.methods.registry import describe, entry, make_method, names
from duo_jax.methods.streaming_llm import StreamingLLM

METHODS = names()
QUANTIZED_KV_METHODS = tuple(m for m in METHODS if entry(m).quantized_kv)  # kv_dtype="int8" / "int4" (`duo_jax.quant`)

__all__ = [
    "H2O",
    "InfiniGen",
    "KVRotation",
    "METHODS",
    "QUANTIZED_KV_METHODS",
    "TOVA",
    "DuoAttention",
    "Method",
    "Step",
    "StreamingLLM",
    "cache_nbytes",
    "describe",
    "duo_sparsity_for_budget",
    "entry",
    "kv_rotation_for",
    "make_method",
    "names",
]

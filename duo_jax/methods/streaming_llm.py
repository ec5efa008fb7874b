"""StreamingLLM with its own position handling: attention sinks + a rolling window, positions re-indexed.

Every head keeps the first `start` tokens and the last `recent` ones (the same sink + ring-buffer cache as
DuoAttention's streaming heads), but keys are cached *before* RoPE and rotated by their place in the cache
at every step: the cache is numbered 0, 1, ... in chronological order (sinks first, then the ring oldest
first) and the new tokens continue that numbering. Positions therefore never exceed start + recent + chunk,
so a stream can run past the model's trained context. (DuoAttention's streaming heads instead keep absolute
positions: `duo` with sparsity 1.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from duo_jax.cache import WindowAsData
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step, concat_slots, kv_rotation_for, write_slots
from duo_jax.methods.duo import StreamingWindow
from duo_jax.methods.registry import register
from duo_jax.model import Rotary, apply_rotary, rotary
from duo_jax.quant import as_stored, check_kv_dtype, dequantize, kv_bytes_per_vector, kv_zeros


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StreamingLayerCache:
    k: jax.Array  # [B, start + recent, K, E], before RoPE (or a QuantizedKV of that shape)
    v: jax.Array  # [B, start + recent, K, E]


@dataclasses.dataclass(frozen=True)
class StreamingShared:
    window: StreamingWindow
    # RoPE tables at re-indexed positions, built once per step for every layer (`duo_jax.model.rotary`):
    key_rope: Rotary  # [B, S + T, E/2]: the cache-order position of each slot, then of each new token
    query_rope: Rotary  # [B, T, E/2]


@dataclasses.dataclass(frozen=True, eq=False)
class StreamingLLM(WindowAsData, Method):
    """`start` sinks + `recent` tokens per head; with `ring_slots`, a ring of that many slots whose window is runtime
    data (`duo_jax.cache.WindowAsData`: methods differing only in start and recent share compiled steps)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    start: int = 4
    recent: int = 256
    kv_dtype: str | None = None  # "int8" / "int4": quantized (`duo_jax.quant`)
    ring_slots: int | None = None  # the ring's slots when the window is data (>= start + recent)

    name = "streaming_llm"
    _window_fields = ("start", "recent")
    # A model's sliding window applies to absolute positions, as the model was trained (`Step.positions_spec`).
    absolute_positions = False  # re-indexed: generation may run past the trained context

    def state(self):
        return self.window_state()

    def init_cache(self, batch: int, dtype) -> tuple[StreamingLayerCache, ...]:
        shape = (batch, self.window_slots, self.num_kv_heads, self.head_dim)

        def zeros():
            return jnp.zeros(shape, dtype) if self.kv_dtype is None else kv_zeros(shape, self.kv_dtype, dtype)

        return tuple(StreamingLayerCache(zeros(), zeros()) for _ in range(self.num_layers))

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        vector = kv_bytes_per_vector(self.head_dim, check_kv_dtype(self.kv_dtype), bytes_per_elem)
        return batch * 2 * self.num_layers * self.num_kv_heads * self.window_slots * vector

    def begin_step(self, step: Step) -> StreamingShared:
        start, recent = self.window_of(step.state)
        slots = self.window_slots
        window = StreamingWindow.build(step, start, recent, slots=slots)
        slot_pos = window.key_positions[:, :slots]  # absolute positions, -1 where empty
        # Chronological rank of each cached token: sinks keep their index; the ring's tokens are the
        # consecutive positions [oldest, lengths), numbered after the sinks.
        num_sinks = jnp.minimum(step.lengths, start)[:, None]
        oldest = jnp.maximum(start, step.lengths - recent)[:, None]
        slot_rank = jnp.where(slot_pos < start, slot_pos, num_sinks + slot_pos - oldest)
        num_cached = jnp.sum(slot_pos >= 0, axis=1, keepdims=True)
        new_rank = num_cached + jnp.arange(step.positions.shape[1])[None, :]  # [B, T]
        key_positions = jnp.concatenate([jnp.maximum(slot_rank, 0), new_rank], axis=1)
        return StreamingShared(window, rotary(key_positions, step.inv_freq), rotary(new_rank, step.inv_freq))

    def attend(self, layer, q, k, v, cache: StreamingLayerCache, step: Step, shared: StreamingShared):
        rotation = kv_rotation_for(self.kv_dtype, self.head_dim)
        k, v = rotation.into(k, v)  # a quantized cache holds k R and v R
        k, v = as_stored(k, cache.k), as_stored(v, cache.v)  # quantized once, when the cache is
        keys = concat_slots(cache.k, k)  # [B, S + T, K, E], before RoPE
        values = concat_slots(cache.v, v)
        q = apply_rotary(q, shared.query_rope)
        # Every key is re-rotated by RoPE every step, so a quantized window is dequantized (and turned back
        # from k R to k) whole: it holds start + recent tokens, not the context.
        keys = rotation.back(dequantize(keys))
        keys = apply_rotary(keys, shared.key_rope)
        out = shared.window.attend(q, keys, values, step)
        out = rotation.back(out)
        return out, StreamingLayerCache(
            write_slots(cache.k, shared.window.write_slots, k), write_slots(cache.v, shared.window.write_slots, v)
        )


def streaming_llm_budget(config: ModelConfig, kv_budget: int, **inputs) -> dict:
    """StreamingLLM's 4 attention sinks (fewer for a tiny budget), the rest of the budget recent tokens."""
    start = min(4, kv_budget - 1)
    return dict(start=start, recent=kv_budget - start)


@register(
    "streaming_llm",
    windows={"sink": "start", "recent": "recent"},
    budget=streaming_llm_budget,
    summary="StreamingLLM: every head keeps start sinks + recent tokens, positions re-indexed",
)
def make_streaming_llm(
    config: ModelConfig,
    *,
    context: int,
    start: int = 4,
    recent: int | None = None,
    kv_budget: int | None = None,
    kv_dtype: str | None = None,
    ring_slots: int | None = None,
) -> StreamingLLM:
    """`start` attention sinks + `recent` tokens per head (default 256; kv_budget - start when a budget is given,
    which then takes no `recent`). `ring_slots`: a ring of that many slots (>= start + recent) whose window is runtime
    data, so that methods that differ only in start and recent share compiled steps; None: start + recent slots, the
    window compiled in."""
    if kv_budget is not None and recent is not None:
        raise DuoJaxError(
            f"streaming_llm takes kv_budget or recent, not both (kv_budget={kv_budget} keeps start={start} sinks and "
            f"{kv_budget - start} recent tokens): pass one"
        )
    if kv_budget is not None:
        recent = kv_budget - start
    elif recent is None:
        recent = 256
    if start < 0 or recent < 1:
        raise DuoJaxError(
            f"start must be >= 0 and recent >= 1 (a ring of the newest tokens), got start={start}, recent={recent}"
            + (f" from kv_budget={kv_budget}" if kv_budget is not None else "")
        )
    return StreamingLLM(config.num_layers, config.num_kv_heads, config.head_dim, start, recent, kv_dtype, ring_slots)

"""DuoAttention: retrieval heads keep every token, streaming heads keep sinks + recent tokens.

Each layer's KV heads are reordered once (`reorder_heads`) so its retrieval heads come first; the split
cache is `duo_jax.cache`. For T new tokens per sequence:

  retrieval heads: keys written to the full cache, attention over every cached token up to the query;
  streaming heads: attention over the streaming cache (sinks + the last `recent` tokens before the chunk)
                   plus the chunk itself (causal), then the chunk is folded into the ring buffer.

So a query at position i in a chunk that starts at position c sees, on a streaming head, key j iff
j <= i and (j < sink or j >= c - recent). Decode is the chunk of one token (c = i): sinks, the last
`recent` tokens and itself. Prefill of a streaming head costs O(T * (sink + recent + chunk)), and its cache
never holds more than sink + recent tokens. Full attention is this method with every head a retrieval head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax import attention
from duo_jax.cache import (CacheLayout, DuoLayerCache, expected_cache_bytes, init_cache,
                           streaming_slot_positions, streaming_write_slots)
from duo_jax.config import ModelConfig
from duo_jax.methods.base import Method, Step, concat_slots, write_slots
from duo_jax.model import Params, apply_rope
from duo_jax.quant import as_stored, kv_rotation, rotate


def head_order(retrieval_mask: np.ndarray) -> np.ndarray:
    """Per layer, KV head indices with the retrieval heads first (each group in original order): [L, K]."""
    mask = np.asarray(retrieval_mask, bool)
    return np.stack([np.concatenate([np.flatnonzero(m), np.flatnonzero(~m)]) for m in mask])


def reorder_heads(params: Params, config: ModelConfig, retrieval_mask: np.ndarray | None) -> Params:
    """Permute each layer's q/k/v output heads and o_proj input heads so its retrieval heads come first.

    The model computes the same function; only the head order changes, so the two head groups become
    contiguous slices. A query head moves with its KV head (GQA groups stay together).
    """
    if retrieval_mask is None:
        return params
    kv_order = head_order(retrieval_mask)  # [L, K]
    G = config.group_size
    q_order = (kv_order[:, :, None] * G + np.arange(G)).reshape(config.num_layers, config.num_heads)  # [L, H]

    def permute(axis):
        """Per layer, index head axis `axis` of a weight; an int8 weight's scale with size 1 there (a
        contracted axis, `duo_jax.quant.QuantizedWeight`) is the same for every head and stays."""
        take = jax.vmap(lambda w, order: jnp.take(w, order, axis=axis))
        return lambda w, order: jax.tree.map(lambda a: a if a.shape[axis + 1] == 1 else take(a, order), w)

    take_heads, take_rows = permute(1), permute(0)  # the head axis of [D, heads, E]; the leading one
    layers = params.layers
    biases = {} if layers.bq is None else dict(bq=take_rows(layers.bq, q_order), bk=take_rows(layers.bk, kv_order),
                                               bv=take_rows(layers.bv, kv_order))
    layers = dataclasses.replace(
        layers,
        wq=take_heads(layers.wq, q_order),
        wk=take_heads(layers.wk, kv_order),
        wv=take_heads(layers.wv, kv_order),
        wo=take_rows(layers.wo, q_order),  # [H, E, D]
        **biases,  # [heads, E]; the per-head q/k norms are shared by every head: nothing to permute
    )
    return dataclasses.replace(params, layers=layers)


def retrieval_attention(q, k, v, step: Step) -> jax.Array:
    """Query t (position lengths + t) sees every cached key up to its own position (within the model's
    sliding window). q [B, T, H_r, E], k / v the full cache [B, C, K_r, E] with this chunk already written."""
    return attention.attend(q, k, v, step.prefix_spec(), impl=step.impl)


@dataclasses.dataclass(frozen=True)
class StreamingWindow:
    """Per-step bookkeeping of a sink + ring-buffer cache, shared by every layer."""

    key_positions: jax.Array  # int32 [B, S + T]: absolute position of each cache slot, then each new token; -1: empty
    write_slots: jax.Array  # int32 [B, T]: ring slot of each new token (out of range: not kept)

    @classmethod
    def build(cls, step: Step, sink: int, recent: int) -> "StreamingWindow":
        # Keys are [cache slots, chunk]. The cache holds only sinks and tokens within `recent` of the
        # chunk start, so "j <= i" over filled slots is exactly the Λ-with-chunk rule.
        key_positions = jnp.concatenate([streaming_slot_positions(step.lengths, sink, recent),
                                         jnp.where(step.valid, step.positions, -1)], axis=1)
        write = streaming_write_slots(step.positions, step.valid, step.new_lengths, sink, recent)
        return cls(key_positions, write)

    def attend(self, q, keys, values, step: Step) -> jax.Array:
        """q [B, T, H, E] over the ring + chunk keys / values [B, S + T, K, E]."""
        return attention.attend(q, keys, values, step.positions_spec(self.key_positions), impl=step.impl)


@dataclasses.dataclass(frozen=True)
class DuoShared:
    retrieval_slots: jax.Array  # int32 [B, T]: slot = position; padding goes out of range (dropped)
    window: StreamingWindow


@dataclasses.dataclass(frozen=True)
class DuoAttention(Method):
    """DuoAttention with a fixed retrieval / streaming split (`layout.num_retrieval` heads per layer)."""

    layout: CacheLayout
    retrieval_mask: tuple[tuple[bool, ...], ...] | None = None  # [L][K]; None: every head retrieval

    name = "duo"
    supports_sliding_window = True

    @property
    def max_tokens(self) -> int:
        return self.layout.capacity

    def prepare_params(self, params: Params, config: ModelConfig) -> Params:
        mask = None if self.retrieval_mask is None else np.array(self.retrieval_mask, bool)
        return reorder_heads(params, config, mask)

    def init_cache(self, batch: int, dtype) -> tuple[DuoLayerCache, ...]:
        return init_cache(self.layout, batch, dtype)

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        return expected_cache_bytes(self.layout, batch, bytes_per_elem)

    def begin_step(self, step: Step) -> DuoShared:
        return DuoShared(jnp.where(step.valid, step.positions, self.layout.capacity),
                         StreamingWindow.build(step, self.layout.sink, self.layout.recent))

    def attend(self, layer, q, k, v, cache: DuoLayerCache, step: Step, shared: DuoShared):
        n = self.layout.num_retrieval[layer]
        G = q.shape[2] // k.shape[2]
        q, k = apply_rope(q, step.positions, step.inv_freq), apply_rope(k, step.positions, step.inv_freq)
        rotation = None if self.layout.kv_dtype is None else kv_rotation(self.layout.head_dim)
        if rotation is not None:  # a quantized cache holds k R and v R (`duo_jax.quant.kv_rotation`)
            q, k, v = rotate(q, rotation), rotate(k, rotation), rotate(v, rotation)
        rk = write_slots(cache.retrieval_k, shared.retrieval_slots, k[:, :, :n])
        rv = write_slots(cache.retrieval_v, shared.retrieval_slots, v[:, :, :n])
        sk, sv = cache.streaming_k, cache.streaming_v
        heads = []
        if n > 0:
            heads.append(retrieval_attention(q[:, :, : n * G], rk, rv, step))
        new_k, new_v = as_stored(k[:, :, n:], sk), as_stored(v[:, :, n:], sv)  # quantized once, when it is
        if n < self.layout.num_kv_heads:
            keys, values = concat_slots(sk, new_k), concat_slots(sv, new_v)
            heads.append(shared.window.attend(q[:, :, n * G:], keys, values, step))
        sk = write_slots(sk, shared.window.write_slots, new_k)
        sv = write_slots(sv, shared.window.write_slots, new_v)
        out = jnp.concatenate(heads, axis=2)
        return (out if rotation is None else rotate(out, rotation.T)), DuoLayerCache(rk, rv, sk, sv)

"""The DuoAttention forward pass over a split KV cache: one function for prefill chunks and decode steps.

`extend` runs T new tokens per sequence through the model. Per layer, the query/key/value heads are split
(retrieval heads first, see `reorder_heads`):

  retrieval heads: keys written to the full cache, attention over every cached token up to the query;
  streaming heads: attention over the streaming cache (sinks + the last `recent` tokens before the chunk)
                   plus the chunk itself (causal), then the chunk is folded into the ring buffer.

So a query at position i in a chunk that starts at position c sees, on a streaming head, key j iff
j <= i and (j < sink or j >= c - recent). Decode is the chunk of one token (c = i): sinks, the last
`recent` tokens and itself. Prefill of a streaming head costs O(T * (sink + recent + chunk)), and its cache
never holds more than sink + recent tokens. The layers are unrolled (not scanned) because each layer's cache
has its own number of retrieval heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax import attention
from duo_jax.cache import CAPACITY_BLOCK, CacheLayout, DuoCache, streaming_slot_positions, streaming_write_slots
from duo_jax.config import ModelConfig
from duo_jax.model import (Params, dense_attention, embed, mlp, output_projection, qkv_projection, rms_norm,
                           rope_inv_freq, unembed)


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
    take_heads = jax.vmap(lambda w, order: w[:, order])  # per layer, index the head axis of [D, heads, E]
    layers = params.layers
    layers = dataclasses.replace(
        layers,
        wq=take_heads(layers.wq, q_order),
        wk=take_heads(layers.wk, kv_order),
        wv=take_heads(layers.wv, kv_order),
        wo=jax.vmap(lambda w, order: w[order])(layers.wo, q_order),  # [H, E, D]
    )
    return dataclasses.replace(params, layers=layers)


def unstack_layers(params: Params) -> Params:
    """`Params` whose `.layers` is a tuple of per-layer `LayerParams` (what `extend` takes).

    The engine unrolls its layers; slicing a stacked weight inside the jitted step copies it on every call
    on CPU (measured: 14x slower matmuls), so the layers are split once, outside the step.
    """
    num_layers = params.layers.wq.shape[0]
    layers = tuple(jax.tree.map(lambda w, l=l: w[l], params.layers) for l in range(num_layers))
    return dataclasses.replace(params, layers=layers)


def prepare_params(params: Params, config: ModelConfig, retrieval_mask: np.ndarray | None) -> Params:
    """The model's weights as `extend` takes them: heads reordered for the mask, layers unstacked."""
    return unstack_layers(reorder_heads(params, config, retrieval_mask))


def _write(cache: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """cache [B, S, N, E] with new [B, T, N, E] written at slots [B, T]; out-of-range slots are dropped."""
    batch = jnp.arange(cache.shape[0])[:, None]
    return cache.at[batch, slots].set(new.astype(cache.dtype), mode="drop")


def _retrieval_attention(q, k, v, lengths, new_lengths, impl: str):
    """Retrieval heads: query t (position lengths + t) sees every cached key up to its own position.

    q [B, T, H_r, E], k / v the full cache [B, C, K_r, E] with this chunk already written."""
    if q.shape[1] == 1:  # decode: split-K over the cache, skipping blocks past each sequence's length
        blocks = k.shape[1] // CAPACITY_BLOCK
        splits = max(d for d in range(1, 17) if blocks % d == 0)  # a divisor: the cache is never padded
        return attention.decode_attention(q[:, 0], k, v, new_lengths, impl=impl, block_k=CAPACITY_BLOCK,
                                          num_splits=splits)[:, None]
    return attention.flash_attention(q, k, v, causal=True, q_offset=lengths, kv_len=new_lengths, impl=impl)


@functools.partial(jax.jit, static_argnames=("config", "layout", "all_logits", "impl"), donate_argnames=("cache",))
def extend(params: Params, cache: DuoCache, lengths: jax.Array, tokens: jax.Array, n_valid: jax.Array, *,
           config: ModelConfig, layout: CacheLayout, all_logits: bool = False, impl: str = "auto"):
    """Feed tokens [B, T] at positions lengths[b] + t, of which the first n_valid[b] are real (rest padding).

    `params` come from `prepare_params` (heads reordered for the layout's split, layers unstacked). Returns (logits, cache, lengths):
    logits float32 [B, V] at each sequence's last real token ([B, T, V] for every token when all_logits),
    the updated cache, and lengths + n_valid. `impl` picks the retrieval heads' attention (see
    `duo_jax.attention`: Pallas kernels on GPU, the jnp reference elsewhere).
    """
    B, T = tokens.shape
    G, sink, recent = config.group_size, layout.sink, layout.recent
    positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    valid = jnp.arange(T)[None, :] < n_valid[:, None]  # [B, T]
    new_lengths = lengths + n_valid
    inv_freq = rope_inv_freq(config)

    retrieval_slots = jnp.where(valid, positions, layout.capacity)  # slot = position; padding is dropped
    # Streaming heads: keys are [cache slots, chunk]. The cache holds only sinks and tokens within `recent`
    # of the chunk start, so "j <= i" over valid slots is exactly the Λ-with-chunk rule.
    key_positions = jnp.concatenate([streaming_slot_positions(lengths, sink, recent), positions], axis=1)
    key_valid = jnp.concatenate([key_positions[:, : layout.streaming_slots] >= 0, valid], axis=1)
    streaming_mask = key_valid[:, None, :] & (key_positions[:, None, :] <= positions[:, :, None])  # [B, T, S+T]
    streaming_slots = streaming_write_slots(positions, valid, new_lengths, sink, recent)

    x = embed(params, tokens)  # [B, T, D]
    new_cache = {name: [] for name in ("retrieval_k", "retrieval_v", "streaming_k", "streaming_v")}
    for l in range(layout.num_layers):
        layer = params.layers[l]
        n = layout.num_retrieval[l]
        q, k, v = qkv_projection(rms_norm(x, layer.attn_norm, config.rms_norm_eps), layer, positions, inv_freq)
        rk = _write(cache.retrieval_k[l], retrieval_slots, k[:, :, :n])
        rv = _write(cache.retrieval_v[l], retrieval_slots, v[:, :, :n])
        sk, sv = cache.streaming_k[l], cache.streaming_v[l]
        heads = []
        if n > 0:
            heads.append(_retrieval_attention(q[:, :, : n * G], rk, rv, lengths, new_lengths, impl))
        if n < layout.num_kv_heads:
            keys = jnp.concatenate([sk, k[:, :, n:].astype(sk.dtype)], axis=1)
            values = jnp.concatenate([sv, v[:, :, n:].astype(sv.dtype)], axis=1)
            heads.append(dense_attention(q[:, :, n * G:], keys, values, streaming_mask))
        sk = _write(sk, streaming_slots, k[:, :, n:])
        sv = _write(sv, streaming_slots, v[:, :, n:])
        for name, array in zip(new_cache, (rk, rv, sk, sv)):
            new_cache[name].append(array)
        x = x + output_projection(jnp.concatenate(heads, axis=2), layer)
        x = x + mlp(rms_norm(x, layer.mlp_norm, config.rms_norm_eps), layer)

    if not all_logits:
        last = jnp.maximum(n_valid - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
    logits = unembed(params, config, x)
    cache = DuoCache(**{name: tuple(arrays) for name, arrays in new_cache.items()})
    return (logits if all_logits else logits[:, 0]), cache, new_lengths

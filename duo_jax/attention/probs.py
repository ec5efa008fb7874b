"""Attention with its probabilities, for the methods that score tokens by the attention they receive.

H2O, TOVA, SnapKV's window votes, HeadKV's head scores and InfiniGen's fetch need the softmax itself, which
neither the Pallas kernels nor the blocked XLA path (`duo_jax.attention.xla`) return. They score small key
sets (a budget of kept tokens, an observation window), so one dense masked softmax serves them all.

`attention_received` is the one that meets a long query set: H2O and TOVA prefill a whole prompt in one
chunk, and need only each key's attention summed over the queries, never the [T, S] probabilities. It runs
the same softmax over blocks of queries, so its memory is O(block x S), not O(T x S).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from duo_jax.attention.xla import merge_blocks, query_blocks


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis of fp32 `scores` where `mask` (broadcast) is True; rows with no True give 0."""
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    return probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)


def attention_probs(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array):
    """q [B, T, H, E], per-head keys k / v [B, K, S, E], mask [B, K, T, S] -> (out [B, T, H, E],
    probs float32 [B, K, G, T, S]). Rows with no visible key give zeros."""
    B, T, H, E = q.shape
    K = k.shape[1]
    q = q.reshape(B, T, K, H // K, E)
    scores = jnp.einsum("btkge,bkse->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(E)
    probs = masked_softmax(scores, mask[:, :, None])
    out = jnp.einsum("bkgts,bkse->btkge", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, E).astype(q.dtype), probs


def attention_received(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    sees: Callable[[jax.Array], jax.Array],
    weights: jax.Array,
    *,
    block: int = 512,
):
    """`attention_probs` with the probabilities summed over the queries, one block of `block` queries at a time.

    q [B, T, H, E] at positions q_positions int32 [B, T]; keys k / v [B, K, S, E]; sees(positions [B, Tb]) ->
    bool [B, K, Tb, S], the keys queries at those positions see; weights float32 [B, T] (0 for padding) ->
    (out [B, T, H, E], received float32 [B, K, S] = sum over t and the group's heads g of
    weights[b, t] * probs[b, k, g, t, s])."""
    T = q.shape[1]

    def one(q, positions, weights):
        out, probs = attention_probs(q, k, v, sees(positions))
        return out, jnp.einsum("bkgts,bt->bks", probs, weights)

    if T <= block:
        return one(q, q_positions, weights)

    def step(received, xs):  # the sum is carried, not stacked per block
        out, block_received = one(*xs)
        return received + block_received, out

    # [blocks, B, block, ...]: padded queries weigh 0 and their rows are dropped
    blocks = query_blocks(q, block, 0), query_blocks(q_positions, block, None), query_blocks(weights, block, 0.0)
    received, out = jax.lax.scan(step, jnp.zeros(k.shape[:3], jnp.float32), blocks)
    return merge_blocks(out, T), received

"""Attention with its probabilities, for the methods that score tokens by the attention they receive.

H2O, TOVA, SnapKV's window votes, HeadKV's head scores and InfiniGen's fetch need the softmax itself, which
neither the Pallas kernels nor the blocked XLA path (`duo_jax.attention.xla`) return. They score small key
sets (a budget of kept tokens, an observation window), so one dense masked softmax serves them all.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


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

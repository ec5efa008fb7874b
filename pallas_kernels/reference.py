"""Pure-jnp reference attention with explicit, materialised boolean masks.

Independent of the kernels: every score is computed and masked densely, in
float32. Used by the tests and as the XLA path of `duo_jax.attention`.
Queries whose mask row is empty get an all-zero output (as the kernels do).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def causal_mask(seq_q: int, seq_k: int, q_offset=0, kv_len=None) -> jax.Array:
    """[B or 1, T, S] bool: query i (position q_offset + i) sees key j <= its position, j < kv_len."""
    q_offset = jnp.reshape(jnp.asarray(q_offset, jnp.int32), (-1, 1, 1))
    pos = q_offset + jnp.arange(seq_q)[None, :, None]  # [B, T, 1]
    key = jnp.arange(seq_k)[None, None, :]  # [1, 1, S]
    mask = key <= pos
    if kv_len is not None:
        mask &= key < jnp.reshape(jnp.asarray(kv_len, jnp.int32), (-1, 1, 1))
    return mask


def lambda_mask(seq_q: int, seq_k: int, *, sink: int, recent: int, q_offset=0) -> jax.Array:
    """[B or 1, T, S] bool Λ mask: j <= p and (j < sink or p - j < recent), p = q_offset + i."""
    q_offset = jnp.reshape(jnp.asarray(q_offset, jnp.int32), (-1, 1, 1))
    pos = q_offset + jnp.arange(seq_q)[None, :, None]
    key = jnp.arange(seq_k)[None, None, :]
    return (key <= pos) & ((key < sink) | (pos - key < recent))


def lambda_mask_np(seq_len: int, sink: int, recent: int) -> np.ndarray:
    """NumPy [T, T] Λ self-attention mask (for block counting in tests)."""
    i = np.arange(seq_len)[:, None]
    j = np.arange(seq_len)[None, :]
    return (j <= i) & ((j < sink) | (i - j < recent))


def attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """Masked softmax attention. q [B, T, Hq, D], k/v [B, S, Hkv, D], mask [B or 1, T, S]."""
    batch, seq_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    # Query head h = kv_head * G + g shares KV head kv_head.
    q = q.reshape(batch, seq_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    s = jnp.einsum("btkgd,bskd->bkgts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    mask = mask[:, None, None, :, :]  # [B, 1, 1, T, S]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # Empty rows.
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(l == 0.0, 1.0, l)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return o.reshape(batch, seq_q, num_heads, head_dim).astype(q.dtype)


def flash_attention_reference(q, k, v, *, causal: bool = True, q_offset=0, kv_len=None, scale: float | None = None):
    """Reference for `flash_attention` (same arguments, no tiling)."""
    seq_q, seq_k = q.shape[1], k.shape[1]
    if causal:
        mask = causal_mask(seq_q, seq_k, q_offset, kv_len)
    else:
        limit = seq_k if kv_len is None else kv_len
        limit = jnp.reshape(jnp.asarray(limit, jnp.int32), (-1, 1, 1))
        mask = jnp.broadcast_to(jnp.arange(seq_k)[None, None, :] < limit, (limit.shape[0], seq_q, seq_k))
    return attention_reference(q, k, v, mask, scale=scale)


def lambda_attention_reference(q, k, v, *, sink: int, recent: int, q_offset=0, scale: float | None = None):
    """Reference for `lambda_attention` (streaming heads' Λ mask)."""
    mask = lambda_mask(q.shape[1], k.shape[1], sink=sink, recent=recent, q_offset=q_offset)
    return attention_reference(q, k, v, mask, scale=scale)


def decode_attention_reference(q, k, v, lengths, *, scale: float | None = None):
    """Reference for `decode_attention`: q [B, Hq, D] sees keys j < lengths[b]."""
    lengths = jnp.reshape(jnp.asarray(lengths, jnp.int32), (-1, 1, 1))
    mask = jnp.arange(k.shape[1])[None, None, :] < lengths  # [B, 1, S]
    return attention_reference(q[:, None], k, v, mask, scale=scale)[:, 0]

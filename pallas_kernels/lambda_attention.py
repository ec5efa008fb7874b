"""Λ-shaped (sink + recent window) attention for DuoAttention's streaming heads.

Query at position p sees key j iff j <= p and (j < sink or p - j < recent).
Each query block visits only the KV blocks holding sink tokens and the band of
blocks around its diagonal, so the cost is O(T * (sink + recent)) rather than
O(T^2). Forward and backward are the block-sparse Pallas kernels of
`flash_attention.py`; only the mask and the block schedule differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.flash_attention import block_sparse_attention


def lambda_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    sink: int,
    recent: int,
    q_offset=0,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    one_loop: bool = False,
) -> jax.Array:
    """Streaming-head attention with the Λ mask, differentiable (custom VJP).

    Args:
      q: [B, T, Hq, D]; query i sits at absolute position q_offset + i.
      k, v: [B, S, Hkv, D]; key j at position j (usually S == T, q_offset == 0).
      sink: number of attention-sink tokens at the start, >= 0.
      recent: size of the local window, >= 1 (a query always sees itself);
        recent >= T gives plain causal attention.
      q_offset: int, int32 scalar or int32 [B] (may be traced).
      scale: softmax scale, default 1 / sqrt(D).
      block_q, block_k: tile sizes; T and S need not be multiples of them.
      interpret: None = interpret mode exactly when running on CPU.
      num_warps, num_stages, one_loop: the Triton launch (GPU only) and the tile loop, as `flash_attention`'s.

    Returns:
      [B, T, Hq, D] like q.
    """
    return block_sparse_attention(
        q,
        k,
        v,
        causal=True,
        sink=sink,
        recent=recent,
        q_offset=q_offset,
        kv_len=None,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        one_loop=one_loop,
    )


def _visited_blocks(seq_len: int, block_q: int, block_k: int, sink: int | None, recent: int | None) -> int:
    q_blocks = jnp.arange(_common.cdiv(seq_len, block_q), dtype=jnp.int32)
    sink_end, band_start, end = _common.kv_block_schedule(
        q_blocks,
        q_offset=0,
        kv_len=seq_len,
        seq_q=seq_len,
        block_q=block_q,
        block_k=block_k,
        causal=True,
        sink=sink,
        recent=recent,
    )
    return int(jnp.sum(sink_end + end - band_start))


def lambda_visited_blocks(seq_len: int, sink: int, recent: int, block_q: int, block_k: int) -> int:
    """(query block, KV block) pairs the Λ kernel visits for T == S self-attention.

    Computed with the kernel's own block schedule; equals the number of tiles
    the Λ mask touches.
    """
    _common.check_window(sink, recent)
    _common.check_block("block_q", block_q)
    _common.check_block("block_k", block_k)
    return _visited_blocks(seq_len, block_q, block_k, sink, recent)


def causal_visited_blocks(seq_len: int, block_q: int, block_k: int) -> int:
    """Tiles visited by causal flash attention (for comparison with Λ)."""
    _common.check_block("block_q", block_q)
    _common.check_block("block_k", block_k)
    return _visited_blocks(seq_len, block_q, block_k, None, None)

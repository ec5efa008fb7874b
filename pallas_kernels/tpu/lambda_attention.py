"""Λ-shaped (sink + recent window) attention on TPU for DuoAttention's streaming heads.

Query at position p sees key j iff j <= p and (j < sink or p - j < recent).
Splash attention with the Λ mask as a computable mask when `q_offset` is a
Python int (gate training, whole-sequence prefill), the own scalar-prefetch
kernel when it is traced; both visit only the sink blocks and the diagonal
band, O(T * (sink + recent)). See `flash_attention.masked_attention`.
"""

from __future__ import annotations

import jax

from pallas_kernels.tpu.flash_attention import masked_attention


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
    interpret=None,
) -> jax.Array:
    """Streaming-head attention with the Λ mask on TPU, differentiable (custom VJP).

    Args:
      q: [B, T, Hq, D]; query i sits at absolute position q_offset + i.
      k, v: [B, S, Hkv, D]; key j at position j (usually S == T, q_offset == 0).
      sink: number of attention-sink tokens at the start, >= 0.
      recent: size of the local window, >= 1; recent >= T gives plain causal attention.
      q_offset: int, int32 scalar or int32 [B] (may be traced).
      scale: softmax scale, default 1 / sqrt(D).
      block_q, block_k: tile sizes, multiples of 128; T and S need not be multiples of them.
      interpret: None = TPU interpret mode unless running on (or lowering for) a TPU, where the
        kernels compile; True = JAX's generic interpreter (works under jax.checkpoint); a
        pltpu.InterpretParams = TPU interpret mode with those settings (see `_mosaic`).

    Returns:
      [B, T, Hq, D] like q.
    """
    return masked_attention(
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
    )

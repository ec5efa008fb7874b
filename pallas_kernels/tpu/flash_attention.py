"""Dense (causal) flash attention on TPU: splash attention, or our own Mosaic kernel.

`flash_attention` has the signature and semantics of the GPU kernel (`pallas_kernels.flash_attention`);
`masked_attention` is the one place that chooses, for it and for `lambda_attention`: splash attention when
``q_offset`` and ``kv_len`` are Python ints and every query sees a key, otherwise the own kernel
(`block_sparse.py`: traced or per-sequence offsets and lengths, explicit positions, quantized caches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels.tpu import _mosaic, splash
from pallas_kernels.tpu.block_sparse import block_sparse_attention


def _static_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _every_query_sees_a_key(*, seq_q: int, q_offset: int, kv_len: int, sink: int | None, recent: int | None) -> bool:
    if kv_len < 1 or q_offset < 0:
        return False
    if recent is None or sink > 0:  # Key 0 is visible to every query.
        return True
    # Λ without sinks: the last query (position q_offset + T - 1) must reach key kv_len - 1.
    return q_offset + seq_q - kv_len < recent


def masked_attention(
    q,
    k,
    v,
    *,
    causal: bool,
    sink: int | None,
    recent: int | None,
    q_offset,
    kv_len,
    scale: float | None,
    block_q: int,
    block_k: int,
    interpret,
    q_positions=None,
    k_positions=None,
    k_scale=None,
    v_scale=None,
    kv_quant: str | None = None,
) -> jax.Array:
    """Checks the arguments and runs splash attention or the own kernel (see the module docstring)."""
    _common.check_cache(q, k, v, k_scale, v_scale, kv_quant, q_ndim=4)
    positions = None
    if k_positions is not None:
        if tuple(k_positions.shape) != k.shape[:2]:
            raise ValueError(
                f"k_positions must be int32 [B, S] = {k.shape[:2]} (one position per key "
                f"slot), got shape {tuple(k_positions.shape)}."
            )
        if q_positions is None:
            q_positions = (
                _common.per_batch(q_offset, q.shape[0], 0)[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
            )
        if tuple(q_positions.shape) != q.shape[:2]:
            raise ValueError(f"q_positions must be int32 [B, T] = {q.shape[:2]}, got shape {tuple(q_positions.shape)}.")
        positions = (q_positions, k_positions)
    elif q_positions is not None:
        raise ValueError("q_positions goes with k_positions (keys at explicit positions); without them, pass q_offset.")
    _mosaic.check_tpu_block("block_q", block_q)
    _mosaic.check_tpu_block("block_k", block_k)
    if recent is not None:
        _common.check_window(sink, recent)
    batch, seq_q, _, head_dim = q.shape
    seq_k = k.shape[1]
    scale = _common.default_scale(head_dim, scale)
    interpret = _mosaic.interpret_mode(interpret)
    window = dict(
        causal=causal, sink=sink, recent=recent, scale=scale, block_q=block_q, block_k=block_k, interpret=interpret
    )
    static_len = seq_k if kv_len is None else kv_len
    if (
        positions is None
        and kv_quant is None
        and splash.available()
        and _static_int(q_offset)
        and _static_int(static_len)
        and _every_query_sees_a_key(
            seq_q=seq_q, q_offset=int(q_offset), kv_len=min(int(static_len), seq_k), sink=sink, recent=recent
        )
    ):
        return splash.splash_attention(q, k, v, q_offset=int(q_offset), kv_len=min(int(static_len), seq_k), **window)
    return block_sparse_attention(
        q,
        k,
        v,
        q_offset=_common.per_batch(q_offset, batch, 0),
        kv_len=_common.per_batch(kv_len, batch, seq_k),
        positions=positions,
        scales=(k_scale, v_scale),
        kv_quant=kv_quant,
        **window,
    )


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    q_offset=0,
    kv_len=None,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
    interpret=None,
    q_positions=None,
    k_positions=None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    kv_quant: str | None = None,
) -> jax.Array:
    """Dense (causal) flash attention on TPU, differentiable (custom VJP).

    Args:
      q: [B, T, Hq, D] queries; query i sits at absolute position q_offset + i.
      k, v: [B, S, Hkv, D] keys and values, key j at position j; Hq % Hkv == 0.
      causal: query at position p sees keys j <= p.
      q_offset: int, int32 scalar or int32 [B] (may be traced).
      kv_len: None (= S), int, int32 scalar or int32 [B] (may be traced): keys j >= kv_len are
        masked out; key blocks entirely past it are skipped.
      scale: softmax scale, default 1 / sqrt(D).
      block_q, block_k: tile sizes, multiples of 128 (TPU tiling; shrunk for short sequences;
        T and S need not be multiples, they are padded and masked).
      interpret: None = TPU interpret mode unless running on (or lowering for) a TPU, where the
        kernels compile; True = JAX's generic interpreter (works under jax.checkpoint); a
        pltpu.InterpretParams = TPU interpret mode with those settings (see `_mosaic`).
      k_positions: None, or int32 [B, S]: the absolute position of each key slot (-1: empty),
        for keys not stored in position order (a ring cache + a chunk); the mask then compares
        positions, and every key block up to kv_len is visited (the GPU kernel likewise, forward
        only).
      q_positions: with k_positions only: int32 [B, T], each query's position (default
        q_offset + i).
      k_scale, v_scale: with `kv_quant`, the codes' scales [B, S, Hkv, 1] (one per token and head).
      kv_quant: None (k / v are values), "int8" or "int4": k / v are the cache's int8 codes,
        [B, S, Hkv, D] ("int8") or [B, S, Hkv, D/2] ("int4", two per byte), each tile dequantized in
        the kernel (codes * scale, in q's dtype) before its dots; the own kernel (never splash),
        forward only.

    Returns:
      [B, T, Hq, D] like q. Queries that see no key get 0.
    """
    return masked_attention(
        q,
        k,
        v,
        causal=causal,
        sink=None,
        recent=None,
        q_offset=q_offset,
        kv_len=kv_len,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        q_positions=q_positions,
        k_positions=k_positions,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_quant=kv_quant,
    )

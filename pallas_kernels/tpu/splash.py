"""Causal and Λ attention through JAX's splash attention (forward and backward).

Used where the mask is a static function of (query index, key index): a Python-int ``q_offset`` and key length;
traced or per-sequence ones go to `block_sparse.py`. `DuoMask` is a computable mask that answers tiles all visible
or all hidden from their corners; the batch is folded into the heads so one multi-head launch serves everything;
q is scaled first (splash has no scale argument). Design: docs/kernels.md, "Splash attention (static masks)".
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.tpu import _mosaic

try:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _masks

    _ComputableMask = _masks._ComputableMask
except (ImportError, AttributeError):  # pragma: no cover - a JAX without splash / computable masks.
    _splash = _masks = _ComputableMask = None


def available() -> bool:
    """Whether this JAX has splash attention with computable masks (else the own kernel serves)."""
    return _ComputableMask is not None


class DuoMask(_ComputableMask if _ComputableMask is not None else object):
    """Query i (position q_offset + i) sees key j iff j < kv_len, j <= position when causal, and,
    for Λ (recent not None), j < sink or position - j < recent. All parameters are Python ints."""

    def __init__(
        self, shape: tuple[int, int], *, q_offset: int, kv_len: int, causal: bool, sink: int | None, recent: int | None
    ):
        self.params = (q_offset, kv_len, causal, sink, recent)

        def mask_function(q_ids, kv_ids):  # numpy on the host, jnp tiles in the kernel
            pos = q_ids + q_offset
            mask = (kv_ids < kv_len) & (q_ids >= 0)  # q_ids >= 0 holds: broadcasts rows x cols
            if causal:
                mask = mask & (kv_ids <= pos)
            if recent is not None:
                mask = mask & ((kv_ids < sink) | (pos - kv_ids < recent))
            return mask

        super().__init__(shape=shape, mask_function=mask_function)

    def __getitem__(self, idx) -> np.ndarray:
        """The mask of one tile, as splash's host pass asks for it. A tile in which every query sees
        every key, or none, is answered from its corners without evaluating the function (most tiles of
        a long Λ or causal mask are one or the other)."""
        q_slice, kv_slice = idx if isinstance(idx, tuple) and len(idx) == 2 else (None, None)
        if not all(
            isinstance(x, slice)
            and x.step in (None, 1)
            and isinstance(x.start, int)
            and isinstance(x.stop, int)
            and 0 <= x.start < x.stop <= size
            for x, size in zip((q_slice, kv_slice), self.shape)
        ):
            return super().__getitem__(idx)
        q_offset, kv_len, causal, sink, recent = self.params
        first_pos, last_pos = q_slice.start + q_offset, q_slice.stop - 1 + q_offset
        first_key, last_key = kv_slice.start, kv_slice.stop - 1
        full = (
            last_key < kv_len
            and (not causal or last_key <= first_pos)
            and (recent is None or last_key < sink or last_pos - first_key < recent)
        )
        empty = (
            first_key >= kv_len
            or (causal and first_key > last_pos)
            or (recent is not None and first_key >= sink and first_pos - last_key >= recent)
        )
        if full or empty:
            return np.full((q_slice.stop - q_slice.start, kv_slice.stop - kv_slice.start), full)
        return super().__getitem__(idx)

    def __eq__(self, other: object) -> bool:
        return type(other) is DuoMask and (self.shape, self.params) == (other.shape, other.params)

    def __hash__(self) -> int:
        return hash((DuoMask, self.shape, self.params))


def _kernel(mask: DuoMask, num_heads: int, block_q: int, block_k: int, interpret):
    """A splash kernel for `num_heads` query heads [H, T, D] sharing one mask.

    Built per call, not cached: it holds the mask's block tables as arrays of the trace it is built
    in. Splash caches the host pass that computes them (keyed by the mask's hash)."""
    sizes = _splash.BlockSizes(
        block_q=block_q,
        block_kv=block_k,
        block_kv_compute=block_k,
        block_q_dkv=block_q,
        block_kv_dkv=block_k,
        block_kv_dkv_compute=block_k,
        block_q_dq=block_q,
        block_kv_dq=block_k,
    )
    return _splash.make_splash_mha_single_device(
        _masks.MultiHeadMask([mask] * num_heads), block_sizes=sizes, interpret=interpret
    )


def splash_attention(
    q,
    k,
    v,
    *,
    causal: bool,
    sink: int | None,
    recent: int | None,
    q_offset: int,
    kv_len: int,
    scale: float,
    block_q: int,
    block_k: int,
    interpret,
):
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D], with static q_offset and kv_len.

    Every query must see at least one key (splash leaves a row with no key undefined); the callers
    in this package route other cases to the own kernel.
    """
    batch, seq_q, num_heads, head_dim = q.shape
    seq_k = k.shape[1]
    block_q = _mosaic.tpu_block(block_q, seq_q)
    block_k = _mosaic.tpu_block(block_k, seq_k)
    q = _mosaic.pad_axis(q * jnp.asarray(scale, q.dtype), 1, block_q)
    k, v = (_mosaic.pad_axis(x, 1, block_k) for x in (k, v))
    mask = DuoMask(
        (q.shape[1], k.shape[1]), q_offset=q_offset, kv_len=min(kv_len, seq_k), causal=causal, sink=sink, recent=recent
    )
    kernel = _kernel(mask, batch * num_heads, block_q, block_k, interpret)

    def fold(x):  # [B, L, H, D] -> [B * H, L, D]
        return _mosaic.heads_major(x).reshape(-1, x.shape[1], head_dim)

    o = kernel(fold(q), fold(k), fold(v))  # [B * Hq, T, D]
    o = o.reshape(batch, num_heads, -1, head_dim)[:, :, :seq_q]
    return _mosaic.heads_major(o)

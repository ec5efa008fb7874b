"""Split-K decode attention as our own Mosaic TPU kernel, forward only.

One new token per sequence attends to its cache: q [B, Hq, D], k and v [B, S, Hkv, D], `lengths` [B] valid keys
per sequence. The cache is read in place, viewed as [B, S, Hkv * D]; a quantized cache (`kv_quant`, the layout of
`duo_jax.quant.QuantizedKV`) likewise, dequantized per tile. Splits run as a "parallel" grid axis and merge with
log-sum-exp rescaling. Design: docs/kernels.md, "Split-K decode (TPU)".
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _common
from pallas_kernels.tpu import _mosaic


def _split_kernel(
    lengths_ref,  # scalar prefetch
    q_ref,
    k_ref,
    v_ref,
    *refs,  # inputs (+ scales when quantized), outputs, scratch
    scale: float,
    block_k: int,
    blocks_per_split: int,
    kv_quant: str | None,
):
    if kv_quant is None:
        (o_ref, m_ref, l_ref, m_scr, l_scr, acc_scr), k_scale_ref, v_scale_ref = refs, None, None
    else:
        k_scale_ref, v_scale_ref, o_ref, m_ref, l_ref, m_scr, l_scr, acc_scr = refs
    b, split, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first_key = (split * blocks_per_split + step) * block_k
    num_kv_heads, parts, group, width = q_ref.shape  # [Hkv, parts, G, D / parts]

    @pl.when(step == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, _common.MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def head_tile(ref, scale_ref, h):  # KV head h's keys or values [bk, D / parts] per part
        codes, column = ref[:, pl.ds(h * width, width)], None
        if scale_ref is not None:  # its scales [bk, 1]: lane h of the [bk, Hkv] tile, by a masked lane sum
            scales = scale_ref[...].astype(jnp.float32)
            lane = lax.broadcasted_iota(jnp.int32, scales.shape, 1)
            column = jnp.sum(jnp.where(lane == h, scales, 0.0), axis=1, keepdims=True)
        return _common.dequantize_tile(codes, column, kv_quant, q_ref.dtype)

    @pl.when(first_key < lengths_ref[b])
    def _accumulate():
        cols = first_key + lax.broadcasted_iota(jnp.int32, (group, block_k), 1)
        mask = cols < lengths_ref[b]
        for h in range(num_kv_heads):  # static: KV head h and its G query heads
            ks, vs = head_tile(k_ref, k_scale_ref, h), head_tile(v_ref, v_scale_ref, h)
            s = (
                functools.reduce(
                    operator.add,
                    [
                        jnp.einsum("gd,kd->gk", q_ref[h, i], k, preferred_element_type=jnp.float32)
                        for i, k in enumerate(ks)
                    ],
                )
                * scale
            )
            s = jnp.where(mask, s, _common.MASK_VALUE)
            m = m_scr[h]  # [G, 1]
            m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            correction = jnp.exp(m - m_new)
            l_scr[h] = correction * l_scr[h] + p.sum(axis=-1, keepdims=True)
            for i, v in enumerate(vs):
                acc_scr[h, i] = correction * acc_scr[h, i] + jnp.einsum(
                    "gk,kd->gd", p.astype(v.dtype), v, preferred_element_type=jnp.float32
                )
            m_scr[h] = m_new

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish():  # Unnormalised; the reduction divides by the combined l.
        o_ref[...] = acc_scr[...]
        m_ref[...] = m_scr[...]
        l_ref[...] = l_scr[...]


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    block_k: int = 128,
    num_splits: int = 16,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    kv_quant: str | None = None,
    interpret=None,
) -> jax.Array:
    """Single-token attention over a KV cache on TPU, split along the keys.

    Args:
      q: [B, Hq, D] one query per sequence.
      k, v: [B, S, Hkv, D] cache; Hq % Hkv == 0. With `kv_quant`, the cache's int8 codes instead:
        [B, S, Hkv, D] for "int8", [B, S, Hkv, D/2] for "int4" (two per byte, `_common.unpack_int4_halves`).
      lengths: int32 [B] (may be traced); sequence b attends to keys j < lengths[b] (clipped to
        S). A sequence with length 0 gets a zero output.
      scale: softmax scale, default 1 / sqrt(D).
      block_k: keys per grid step, a multiple of 128 (shrunk for short caches).
      num_splits: the most chunks the keys are split into, each a whole number of blocks (the last may
        have fewer).
      k_scale, v_scale: with `kv_quant`, the codes' scales [B, S, Hkv, 1] (one per token and head).
      kv_quant: None (k / v are values), "int8" or "int4": each tile of codes is dequantized in the kernel
        (codes * scale, in q's dtype) before its dots; the cache is never dequantized whole.
      interpret: None = TPU interpret mode unless running on (or lowering for) a TPU, where the
        kernels compile; True = JAX's generic interpreter (works under jax.checkpoint); a
        pltpu.InterpretParams = TPU interpret mode with those settings (see `_mosaic`).

    Returns:
      [B, Hq, D] like q.
    """
    _common.check_cache(q, k, v, k_scale, v_scale, kv_quant, q_ndim=3)
    _mosaic.check_tpu_block("block_k", block_k)
    _common.check_block("num_splits", num_splits)
    batch, num_heads, head_dim = q.shape
    seq_k, num_kv_heads = k.shape[1], k.shape[2]
    parts = _common.kv_parts(kv_quant)
    width = head_dim // parts
    scale = _common.default_scale(head_dim, scale)
    interpret = _mosaic.interpret_mode(interpret)
    lengths = jnp.minimum(_common.per_batch(lengths, batch, seq_k), seq_k)

    block_k = _mosaic.tpu_block(block_k, seq_k)
    num_blocks = _common.cdiv(seq_k, block_k)
    blocks_per_split, num_splits = _common.split_blocks(num_blocks, num_splits)
    # [B, S, Hkv, W] -> [B, S', Hkv * W]: free reshape (W = D, or D/2 for int4 codes; scales: W = 1); S' pads S
    # to whole blocks (a no-op for a cache of whole blocks). The last split may be shorter: its steps past the
    # cache map to the last valid block and are skipped, so any cache size gets about num_splits splits.
    cache = [k, v] + ([] if kv_quant is None else [k_scale, v_scale])
    cache = [_mosaic.pad_axis(x, 1, block_k).reshape(batch, -1, num_kv_heads * x.shape[-1]) for x in cache]

    def kv_map(b, split, step, lengths_ref):  # Blocks past the length repeat the last valid one.
        last_valid = jnp.maximum(_common.cdiv(lengths_ref[b], block_k) - 1, 0)
        return b, jnp.minimum(split * blocks_per_split + step, last_valid), 0

    # Query heads grouped by KV head, each head's D elements in `parts` (int4's nibble halves):
    # [B, Hkv, parts, G, D / parts]; the kernel indexes KV head h and part i on leading dims.
    group = num_heads // num_kv_heads
    q = jnp.swapaxes(q.reshape(batch, num_kv_heads, group, parts, width), 2, 3)
    kv_tiles = [pl.BlockSpec((None, block_k, x.shape[-1]), kv_map) for x in cache]
    per_split = lambda *shape: pl.BlockSpec(  # noqa: E731
        (None, None, num_kv_heads) + shape, lambda b, split, step, _: (b, split) + (0,) * (1 + len(shape))
    )
    partial_out = lambda *shape: jax.ShapeDtypeStruct(  # noqa: E731
        (batch, num_splits, num_kv_heads) + shape, jnp.float32
    )
    o, m, l = pl.pallas_call(
        functools.partial(
            _split_kernel, scale=scale, block_k=block_k, blocks_per_split=blocks_per_split, kv_quant=kv_quant
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, num_splits, blocks_per_split),
            in_specs=[
                pl.BlockSpec((None, num_kv_heads, parts, group, width), lambda b, split, step, _: (b, 0, 0, 0, 0))
            ]
            + kv_tiles,
            out_specs=[per_split(parts, group, width), per_split(group, 1), per_split(group, 1)],
            scratch_shapes=[
                pltpu.VMEM((num_kv_heads, group, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, group, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, parts, group, width), jnp.float32),
            ],
        ),
        out_shape=[partial_out(parts, group, width), partial_out(group, 1), partial_out(group, 1)],
        compiler_params=_mosaic.compiler_params(("parallel", "parallel", "arbitrary"), interpret),
        interpret=interpret,
        name="tpu_decode_attention_split",
    )(lengths, q, *cache)

    # Combine the splits: weight each by exp(m_split - m_max) (0 if it saw no key).
    weight = jnp.where(l > 0.0, jnp.exp(m - m.max(axis=1, keepdims=True)), 0.0)  # [B, splits, Hkv, G, 1]
    l_total = jnp.sum(weight * l, axis=1)  # [B, Hkv, G, 1]
    o = jnp.einsum("bshg,bshpgd->bhgpd", weight[..., 0], o)  # the parts back in order: [B, Hkv, G, parts, D/parts]
    o = o / jnp.where(l_total == 0.0, 1.0, l_total)[..., None]
    return o.reshape(batch, num_heads, head_dim).astype(q.dtype)

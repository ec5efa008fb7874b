"""Pieces shared by the attention kernels: argument checks, masks, block schedules.

The block schedule is written once, with `lax`/`jnp` integer ops that work both
on traced scalars inside a kernel (program ids, `q_offset`, `kv_len`) and on
concrete arrays, so `lambda_visited_blocks` counts exactly what the kernel visits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Finite "minus infinity" for masked logits: keeps m - m_new and s - m free of
# inf - inf; masked probabilities are zeroed explicitly with jnp.where anyway.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def cdiv(a, b):
    """Ceil division of non-negative integers (Python ints or int32 arrays)."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return lax.div(a + b - 1, b)


def check_block(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def check_window(sink: int, recent: int) -> None:
    """Λ window: `sink >= 0` tokens at the start, `recent >= 1` (a query always sees itself)."""
    if not isinstance(sink, (int, np.integer)) or sink < 0:
        raise ValueError(f"sink must be an integer >= 0, got {sink!r}.")
    if not isinstance(recent, (int, np.integer)) or recent < 1:
        raise ValueError(f"recent must be an integer >= 1 (a query always sees itself), got {recent!r}.")


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, *, q_ndim: int = 4) -> None:
    """q [B, T, Hq, D] (or [B, Hq, D] when q_ndim == 3), k and v [B, S, Hkv, D]."""
    if q.ndim != q_ndim or k.ndim != 4 or v.ndim != 4:
        q_layout = "[B, T, Hq, D]" if q_ndim == 4 else "[B, Hq, D]"
        raise ValueError(f"expected q {q_layout} and k, v [B, S, Hkv, D]; got q {q.shape}, k {k.shape}, v {v.shape}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}.")
    batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if k.shape[0] != batch or k.shape[-1] != head_dim:
        raise ValueError(f"q and k/v disagree on batch or head_dim: q {q.shape}, k {k.shape}.")
    num_kv_heads = k.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"the number of query heads ({num_q_heads}) must be a multiple of the "
            f"number of key/value heads ({num_kv_heads}) for grouped-query attention."
        )


def split_blocks(num_blocks: int, num_splits: int) -> tuple[int, int]:
    """Split-K's chunks: `num_blocks` key blocks in at most `num_splits` chunks of whole blocks, the last one
    possibly shorter, so any cache size gets about num_splits of them -> (blocks per chunk, chunks)."""
    blocks_per_split = cdiv(num_blocks, min(num_splits, num_blocks))
    return blocks_per_split, cdiv(num_blocks, blocks_per_split)


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def per_batch(x, batch: int, default: int) -> jax.Array:
    """Broadcasts an int, an int32 scalar or an int32 [B] array to int32 [B]."""
    x = default if x is None else x
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch,))


def exact_block(size: int, largest: int = 128) -> int | None:
    """The key block that tiles `size` slots exactly: the largest power of two <= `largest` that divides it, or
    None when that is under 16 (Triton's smallest dot)."""
    block = largest
    while block >= 16:
        if size % block == 0:
            return block
        block //= 2
    return None


def fit_block(block: int, length: int) -> int:
    """Shrinks a block to the smallest power of two (>= 16) covering `length`."""
    return min(block, max(16, 1 << max(length - 1, 0).bit_length()))


def tiling_block(block: int, length: int) -> int:
    """A key block for `length` slots: one that tiles them exactly where there is one (`exact_block`: no padded
    copy), else `fit_block`'s."""
    return exact_block(length, block) or fit_block(block, length)


def pad_to_block(x: jax.Array, block: int, value=0) -> jax.Array:
    """x with axis 1 padded up to a multiple of `block` with `value` (x itself when it is one)."""
    extra = -x.shape[1] % block
    if not extra:
        return x
    return jnp.pad(x, ((0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 2), constant_values=value)


def attention_mask(
    rows,
    cols,
    *,
    q_offset,
    kv_len,
    seq_q: int,
    causal: bool,
    sink: int | None,
    recent: int | None,
    q_pos=None,
    k_pos=None,
):
    """Which (query row, key column) pairs attend; rows [bq, 1], cols [1, bk].

    Query row i sits at absolute position q_offset + i, or at q_pos (like rows)
    when given; key column j at j, or at k_pos (like cols) when given: keys at
    explicit positions, -1 for an empty slot (a ring cache). Columns >= kv_len
    are empty either way. Rows >= seq_q (padding) see nothing, so their lse is
    +inf and their probabilities are exactly zero in the backward pass.
    """
    pos = q_offset + rows if q_pos is None else q_pos
    mask = (rows < seq_q) & (cols < kv_len)
    if k_pos is None:
        k_pos = cols
    else:
        mask &= k_pos >= 0
    if causal:
        mask &= k_pos <= pos
    if recent is not None:  # Λ: sinks, or within the recent window.
        mask &= (k_pos < sink) | (pos - k_pos < recent)
    return mask


def kv_block_schedule(
    q_block,
    *,
    q_offset,
    kv_len,
    seq_q: int,
    block_q: int,
    block_k: int,
    causal: bool,
    sink: int | None,
    recent: int | None,
):
    """KV blocks that query block `q_block` visits: [0, sink_end) ∪ [band_start, end).

    Returns (sink_end, band_start, end), with sink_end <= band_start <= end, so
    the number of visited blocks is sink_end + end - band_start.
    For dense attention sink_end == band_start == 0.
    """
    first_row = q_block * block_q
    last_row = jnp.minimum(first_row + block_q, seq_q) - 1
    num_keys = kv_len
    if causal:  # The last row sees keys up to its own position.
        num_keys = jnp.minimum(num_keys, q_offset + last_row + 1)
    end = cdiv(jnp.maximum(num_keys, 0), block_k)
    if recent is None:
        zero = jnp.zeros_like(end)
        return zero, zero, end
    # The first row sees keys from position first_row - recent + 1 on.
    band_start = lax.div(jnp.maximum(q_offset + first_row - recent + 1, 0), block_k)
    band_start = jnp.minimum(band_start, end)
    sink_end = jnp.minimum(cdiv(sink, block_k), band_start)
    return sink_end, band_start, end


def unmasked_kv_blocks(
    q_block,
    *,
    q_offset,
    kv_len,
    seq_q: int,
    block_q: int,
    block_k: int,
    causal: bool,
    sink: int | None,
    recent: int | None,
    schedule,
):
    """The visited KV blocks (`schedule` = `kv_block_schedule`'s (sink_end, band_start, end)) that every row
    of query block `q_block` sees whole, so that their tiles need no mask: (sink_whole, lo, hi), the sink
    blocks [0, sink_whole) and the band blocks [lo, hi) (band_start <= lo <= hi <= end). Dense attention:
    the leading blocks before the causal edge. Λ: the sink blocks holding only sink keys, and the band blocks
    every row sees within `recent` (with 128-wide tiles and recent 256, one of the band's three). Empty ranges
    for a query block holding padded rows (those must see nothing)."""
    sink_end, band_start, end = schedule
    first_row = q_block * block_q
    last_row = first_row + block_q - 1
    keys = kv_len  # every row sees keys [0, keys) but for the Λ window
    if causal:  # The first row sees keys up to its own position.
        keys = jnp.minimum(keys, q_offset + first_row + 1)
    hi = jnp.clip(lax.div(jnp.maximum(keys, 0), block_k), band_start, end)
    lo = band_start
    sink_whole = jnp.zeros_like(sink_end)
    if recent is not None:  # the last row sees a non-sink key within recent - 1 positions
        lo = jnp.maximum(band_start, cdiv(jnp.maximum(q_offset + last_row - recent + 1, 0), block_k))
        sink_whole = jnp.minimum(lax.div(jnp.maximum(jnp.minimum(sink, keys), 0), block_k), sink_end)
    padded = first_row + block_q > seq_q
    lo = jnp.where(padded, band_start, jnp.minimum(lo, hi))
    return jnp.where(padded, 0, sink_whole), lo, jnp.where(padded, band_start, hi)


def q_block_schedule(
    kv_block,
    *,
    q_offset,
    kv_len,
    num_q_blocks: int,
    block_q: int,
    block_k: int,
    causal: bool,
    sink: int | None,
    recent: int | None,
):
    """Query blocks [start, end) that can see some key of block `kv_block`."""
    first_key = kv_block * block_k
    start = jnp.zeros_like(first_key)
    if causal:  # Rows at positions >= first_key.
        start = lax.div(jnp.maximum(first_key - q_offset, 0), block_q)
    end = jnp.full_like(first_key, num_q_blocks)
    if recent is not None:
        # Outside the sinks, a key is seen up to recent - 1 positions after it.
        last_row = first_key + block_k - 1 + recent - 1 - q_offset
        band_end = jnp.where(last_row < 0, 0, lax.div(jnp.maximum(last_row, 0), block_q) + 1)
        end = jnp.where(first_key < sink, end, jnp.minimum(band_end, end))
    end = jnp.where(first_key < kv_len, end, start)  # Block entirely past kv_len.
    return start, end


# --- quantized KV tiles ------------------------------------------------------------------------------
# A quantized cache (`duo_jax.quant.QuantizedKV`) holds, per token and KV head, absmax codes along the head
# dimension D and one scale: "int8" codes [.., D], or "int4" codes packed two per byte [.., D/2], byte j holding
# element j in its low nibble and element j + D/2 in its high one. The decode and flash (prefill) kernels read
# codes and scales and dequantize one key tile at a time, as "parts": int4's two nibble halves (elements [0, D/2)
# and [D/2, D)) stay separate, so a kernel dots each with the matching half of the query (split outside the
# kernel) and never concatenates inside it (Triton has no general concatenate).

KV_QUANT = (None, "int8", "int4")


def kv_parts(kv_quant: str | None) -> int:
    """How many parts a head's D elements come in: 2 for packed int4 (the nibble halves), else 1."""
    if kv_quant not in KV_QUANT:
        raise ValueError(f"kv_quant must be one of {KV_QUANT}, got {kv_quant!r}.")
    return 2 if kv_quant == "int4" else 1


def unpack_int4_halves(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Packed int4 codes [.., D/2] (int8) -> (elements [0, D/2), elements [D/2, D)) as int32 in [-8, 7]: the low
    nibbles, then the high ones (sign-extended by arithmetic shifts, in 32 bits, which every backend shifts)."""
    x = packed.astype(jnp.int32)
    return lax.shift_right_arithmetic(lax.shift_left(x, 28), 28), lax.shift_right_arithmetic(x, 4)


def dequantize_tile(codes: jax.Array, scale: jax.Array | None, kv_quant: str | None, dtype) -> list[jax.Array]:
    """A tile of keys or values in `kv_parts(kv_quant)` parts, each [bk, D / parts] in `dtype`: the array itself
    when not quantized, else codes [bk, D or D/2] times scale [bk, 1], computed in float32 and rounded once to
    `dtype` (the values `duo_jax.quant.QuantizedKV.dequantize` gives)."""
    if kv_quant is None:
        return [codes]
    parts = unpack_int4_halves(codes) if kv_quant == "int4" else (codes,)
    scale = scale.astype(jnp.float32)
    return [(part.astype(jnp.float32) * scale).astype(dtype) for part in parts]


def load_tile(ref, scale_ref, rows, kv_quant: str | None, dtype) -> list[jax.Array]:
    """Rows `rows` (a `pl.ds`) of a kernel's keys or values ref [.., W] (and, quantized, of its scales ref
    [.., 1]) as `dequantize_tile`'s parts."""
    return dequantize_tile(ref[rows, :], None if scale_ref is None else scale_ref[rows, :], kv_quant, dtype)


def check_cache(
    q: jax.Array, k: jax.Array, v: jax.Array, k_scale, v_scale, kv_quant: str | None, *, q_ndim: int
) -> None:
    """Checks a kernel's cache arguments: q [B, T, Hq, D] (q_ndim 4) or [B, Hq, D] (3, decode) and k / v
    [B, S, Hkv, D] values when `kv_quant` is None (no scales), else int8 codes [B, S, Hkv, D] ("int8") or
    [B, S, Hkv, D/2] ("int4") with scales [B, S, Hkv, 1]."""
    parts = kv_parts(kv_quant)
    if kv_quant is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale / v_scale are for a quantized cache: pass kv_quant='int8' or 'int4' with them.")
        return check_qkv(q, k, v, q_ndim=q_ndim)
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {kv_quant} cache needs its scales: pass k_scale and v_scale [B, S, Hkv, 1].")
    head_dim = q.shape[-1]
    if head_dim % parts:
        raise ValueError(f"int4 codes pack two elements per byte: head_dim must be even, got {head_dim}.")
    for name, codes, scales in (("k", k, k_scale), ("v", v, v_scale)):
        if codes.dtype != jnp.int8 or codes.ndim != 4 or codes.shape[-1] != head_dim // parts:
            raise ValueError(
                f"{kv_quant} {name} codes must be int8 [B, S, Hkv, {head_dim // parts}] for q "
                f"{q.shape}, got {codes.dtype} {codes.shape}."
            )
        if scales.shape != codes.shape[:-1] + (1,):
            raise ValueError(f"{name}_scale must be [B, S, Hkv, 1] = {codes.shape[:-1] + (1,)}, got {scales.shape}.")
    values = [jax.ShapeDtypeStruct(x.shape[:-1] + (head_dim,), q.dtype) for x in (k, v)]
    check_qkv(q, *values, q_ndim=q_ndim)

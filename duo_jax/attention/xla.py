"""Attention compiled by XLA whose work and memory follow the tokens held, not the cache's capacity.

`attention(q, k, v, spec)` is a blocked online softmax (flash attention written in `lax`): for each block of
queries it visits only the key blocks `spec` can see, a trip count computed at run time from the positions and key
lengths, and scores one tile at a time in fp32, reading the cache in its own dtype (codes dequantized, pages
gathered, one tile at a time). Its `custom_vjp` walks the same blocks from the saved log-sum-exp, so gradients
(gate training's Λ attention) need no [T, S] matrix either; `attention_with_lse` returns the log-sum-exp of one
shard of the keys for merging. It serves every spec, cache kind and backend: the dispatch's fallback
(docs/attention.md, "The XLA path").

Letters: B batch, T queries, S key slots, K KV heads, G query heads per KV head, E head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from duo_jax.attention.masks import MaskSpec
from duo_jax.attention.pages import PagedKV
from duo_jax.quant import QuantizedKV, dequantize
from pallas_kernels._backend import on_gpu

# Queries per block, and at most this many key slots per tile where tiles do not follow the query blocks
# (`key_block`): a 512-token prefill chunk (`generate`'s default) is one query block (docs/attention.md).
BLOCK_Q, BLOCK_K = 512, 512

# Finite "minus infinity": keeps m - m_new free of inf - inf; masked probabilities are zeroed explicitly.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
# `attention_with_lse`'s log-sum-exp for a query that sees no key (finite: merging shards where no shard has a key
# gives weights exp(0), not exp(-inf + inf))
NO_KEY_LSE = _MASKED


def _cdiv(a, b):
    return (a + b - 1) // b


def _key_blocks(spec: MaskSpec, q_pos: jax.Array, block_k: int):
    """The key blocks a query block must visit, as two ranges [a1, b1) and [a2, b2) of block indices
    (int32 scalars, traced): the sink blocks and the band up to the last filled, causally visible key."""
    hi_key = jnp.max(spec.kv_len)
    if spec.causal and spec.k_positions is None:
        hi_key = jnp.minimum(hi_key, jnp.max(q_pos) + 1)
    hi = _cdiv(jnp.maximum(hi_key, 0), block_k)
    zero = jnp.zeros((), jnp.int32)
    if spec.k_positions is not None:  # slots hold arbitrary positions (a ring, an eviction cache): no skipping
        return zero, zero, zero, hi
    q_min = jnp.min(q_pos)
    lo = zero
    if spec.window is not None:
        lo = jnp.maximum(q_min - spec.window + 1, 0) // block_k
    if not spec.is_lambda:
        return zero, zero, lo, hi
    num_sink_blocks = _cdiv(spec.sink, block_k)
    band_lo = jnp.maximum(q_min - spec.recent + 1, 0) // block_k
    return lo, jnp.minimum(num_sink_blocks, hi), jnp.maximum(jnp.maximum(num_sink_blocks, lo), band_lo), hi


def _slice_keys(x, first, size: int) -> jax.Array:
    """x[:, first:first + size], dequantized when x is a `QuantizedKV` (codes and scales sliced, then only
    this tile converted), gathered through the block tables when x is a `PagedKV` (only this tile's rows of
    the pool are read: the pages are never copied whole into a contiguous cache). The barrier keeps the slice
    inside the loop: XLA:CPU computes bf16 ops in f32 and would otherwise hoist the convert of the whole
    loop-invariant cache out of the loop, so temp memory would grow with the capacity."""
    x, first = lax.optimization_barrier((x, first))
    if isinstance(x, PagedKV):
        return x.read(first, size)
    return dequantize(jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, first, size, axis=1), x))


def _tile(spec: MaskSpec, q_pos, k, v, i, ranges, block_k: int):
    """Key tile i of the schedule: (first slot, keys [B, bk, K, E], values, visibility [B, T, bk])."""
    a1, b1, a2, _ = ranges
    n1 = jnp.maximum(b1 - a1, 0)
    block = jnp.where(i < n1, a1 + i, a2 + i - n1)
    start = block * block_k
    first = jnp.minimum(start, k.shape[1] - block_k)  # the last block is shifted back to stay in bounds ...
    slots = first + jnp.arange(block_k, dtype=jnp.int32)
    fresh = slots >= start  # ... and its slots already seen are masked out
    k_tile, v_tile = _slice_keys(k, first, block_k), _slice_keys(v, first, block_k)
    if spec.k_positions is None:
        k_pos = jnp.broadcast_to(slots, (q_pos.shape[0], block_k))
    else:
        k_pos = lax.dynamic_slice_in_dim(spec.k_positions, first, block_k, axis=1)
    filled = fresh[None, :] & (slots[None, :] < spec.kv_len[:, None]) & (k_pos >= 0)
    visible = spec.visible(q_pos[:, :, None], k_pos[:, None, :], filled[:, None, :])
    return first, k_tile, v_tile, visible


def balanced_block(num_keys: int, block_k: int) -> int:
    """The key block for `num_keys` slots: as many blocks as `block_k` needs, of equal size (rounded up to 8), so
    that a last block shifted back over the previous one scores few slots twice."""
    blocks = _cdiv(num_keys, block_k)
    return min(num_keys, _cdiv(_cdiv(num_keys, blocks), 8) * 8)


def key_block(spec: MaskSpec, num_keys: int, block_q: int, block_k: int) -> int:
    """The key tile for `spec` over `num_keys` slots. Over a contiguous cache (slot = position) the causal
    boundary of a query block falls on a tile boundary when tiles are as long as query blocks and start at
    multiples of it (chunks start at multiples of the chunk size): a block then scores its visible tiles and one
    diagonal tile, nothing past it (docs/attention.md, "Block sizes and key tiles"). Slots holding arbitrary
    positions (a ring, an eviction cache, DuoAttention's streaming keys + chunk) are all visited:
    `balanced_block`."""
    if spec.k_positions is None and spec.causal and block_q > 1:
        return min(num_keys, block_q)
    return balanced_block(num_keys, block_k)


def _trip_count(ranges):
    a1, b1, a2, b2 = ranges
    return jnp.maximum(b1 - a1, 0) + jnp.maximum(b2 - a2, 0)


def _forward_block(spec, q, q_pos, k, v, scale, block_k):
    """One query block: q [B, T, K, G, E] -> (out [B, T, K, G, E] in q's dtype, lse float32 [B, K, G, T])."""
    B, T, K, G, E = q.shape
    ranges = _key_blocks(spec, q_pos, block_k)
    # The query heads of a KV head and the block's queries as the rows of one matrix, [B, K, G*T, E], laid out
    # once: each tile is then one [G*T, E] x [E, bk] matmul per (b, k); contracting the [B, T, K, G, E] layout
    # in place makes XLA:CPU re-lay the queries out every tile.
    rows = jnp.einsum("btkge->bkgte", q).reshape(B, K, G * T, E)
    # fp32 queries take the scale once here rather than every score of every tile (rounding q * scale to a
    # narrower dtype would change the scores, so bf16 queries are scaled after the matmul).
    folded = rows.dtype == jnp.float32
    if folded:
        rows = rows * jnp.float32(scale)

    # A decode step on a GPU scores and weighs a tile by multiplying and summing instead of by matmuls: with G rows
    # per KV head its cost is reading the tile, and a reduction takes in the elementwise ops before it, so a tile of
    # codes can be dequantized inside the kernel that reads it rather than written out dequantized first as a
    # matmul's operand (docs/attention.md, "Inside a tile"). Elsewhere matmuls.
    by_reduction = T == 1 and on_gpu()

    def update(carry, s, v_tile, masked: bool):
        """The online softmax over one tile's scores s [B, K, G, T, bk]: masked ones are _MASKED."""
        m, l, acc = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # A masked score is _MASKED, so exp(s - m_new) is exactly 0 for it once the row has seen a visible key;
        # a row that has not (m_new still _MASKED) is shifted by 0 instead, so its masked scores exp to 0 too.
        shift = jnp.where(m_new > _MASKED, m_new, 0.0) if masked else m_new
        p = jnp.exp(s - shift[..., None])
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=-1)
        p = p.reshape(B, K, G * T, -1)
        if by_reduction:  # sum_s p[b, k, x, s] v[b, s, k, e]
            pv = jnp.sum(p[..., None] * jnp.einsum("bske->bkse", v_tile)[:, :, None].astype(jnp.float32), axis=3)
        else:
            pv = jnp.einsum("bkxs,bske->bkxe", p.astype(v_tile.dtype), v_tile, preferred_element_type=jnp.float32)
        return m_new, l, acc * correction[..., None] + pv.reshape(B, K, G, T, E)

    def scores(k_tile):  # [B, K, G, T, bk], scaled
        if by_reduction:  # sum_e rows[b, k, x, e] k[b, s, k, e]
            keys = jnp.einsum("bske->bkse", k_tile)[:, :, None].astype(jnp.float32)
            s = jnp.sum(rows[:, :, :, None].astype(jnp.float32) * keys, axis=-1)
        else:
            s = jnp.einsum("bkxe,bske->bkxs", rows, k_tile, preferred_element_type=jnp.float32)
        return (s if folded else s * scale).reshape(B, K, G, T, -1)

    def body(i, carry):
        _, k_tile, v_tile, visible = _tile(spec, q_pos, k, v, i, ranges, block_k)
        s = scores(k_tile)
        if T == 1 and on_gpu():
            # A decode step's mask is one row per head: on a GPU cheaper than the branch below, whose predicate
            # XLA:GPU reads back to the host every trip (BENCHMARKS.md, "Llama-3-8B shape: decode and prefill,
            # duo vs full"). Elsewhere the branch stays.
            return update(carry, jnp.where(visible[:, None, None], s, _MASKED), v_tile, masked=True)
        # Tiles every query of the block sees whole (all but the causal diagonal, the ragged end and a window's
        # edge) skip the mask.
        return lax.cond(
            jnp.all(visible),
            lambda c: update(c, s, v_tile, masked=False),
            lambda c: update(c, jnp.where(visible[:, None, None], s, _MASKED), v_tile, masked=True),
            carry,
        )

    init = (
        jnp.full((B, K, G, T), _MASKED, jnp.float32),
        jnp.zeros((B, K, G, T), jnp.float32),
        jnp.zeros((B, K, G, T, E), jnp.float32),
    )
    if k.shape[1] <= block_k:
        # One tile holds every slot (a streaming head's ring + chunk, short sequences): score it under the
        # mask, with no loop and no branch, which on a GPU would read a trip count or predicate back to the host.
        _, k_tile, v_tile, visible = _tile(spec, q_pos, k, v, 0, (0, 0, 0, 1), block_k)
        m, l, acc = update(init, jnp.where(visible[:, None, None], scores(k_tile), _MASKED), v_tile, masked=True)
    else:
        m, l, acc = lax.fori_loop(0, _trip_count(ranges), body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # a row with no visible key gives zeros
    lse = m + jnp.log(jnp.maximum(l, 1e-30))
    return jnp.einsum("bkgte->btkge", out).astype(q.dtype), lse


def _backward_block(spec, q, q_pos, k, v, scale, block_k, out, lse, d_out, dk, dv):
    """Gradients of one query block; dk / dv float32 [B, S, K, E] accumulate over query blocks."""
    ranges = _key_blocks(spec, q_pos, block_k)
    delta = jnp.einsum("btkge,btkge->bkgt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_out = d_out.astype(jnp.float32)

    def body(i, carry):
        dq, dk, dv = carry
        first, k_tile, v_tile, visible = _tile(spec, q_pos, k, v, i, ranges, block_k)
        s = jnp.einsum("btkge,bske->bkgts", q, k_tile, preferred_element_type=jnp.float32) * scale
        p = jnp.where(visible[:, None, None], jnp.exp(s - lse[..., None]), 0.0)
        dv_tile = jnp.einsum("bkgts,btkge->bske", p, d_out)
        dp = jnp.einsum("btkge,bske->bkgts", d_out, v_tile.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bkgts,bske->btkge", ds, k_tile.astype(jnp.float32))
        dk_tile = jnp.einsum("bkgts,btkge->bske", ds, q.astype(jnp.float32))
        # Masked (already seen) slots of a shifted last tile got p = 0, so adding the whole tile is exact.
        dk = lax.dynamic_update_slice_in_dim(dk, lax.dynamic_slice_in_dim(dk, first, block_k, 1) + dk_tile, first, 1)
        dv = lax.dynamic_update_slice_in_dim(dv, lax.dynamic_slice_in_dim(dv, first, block_k, 1) + dv_tile, first, 1)
        return dq, dk, dv

    dq = jnp.zeros(q.shape, jnp.float32)
    return lax.fori_loop(0, _trip_count(ranges), body, (dq, dk, dv))


def query_blocks(x, block_q: int, fill):
    """[B, T, ...] -> [nq, B, block_q, ...], padding T with `fill` (positions: the last one)."""
    B, T = x.shape[:2]
    nq = _cdiv(T, block_q)
    pad = nq * block_q - T
    if pad:
        tail = (
            jnp.broadcast_to(x[:, -1:], (B, pad) + x.shape[2:])
            if fill is None
            else jnp.full((B, pad) + x.shape[2:], fill, x.dtype)
        )
        x = jnp.concatenate([x, tail], axis=1)
    return jnp.moveaxis(x.reshape((B, nq, block_q) + x.shape[2:]), 1, 0)


def merge_blocks(x, T: int):
    """[nq, B, block_q, ...] -> [B, T, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, spec, scale, block_q, block_k):
    return _attention_fwd(q, k, v, spec, scale, block_q, block_k)[0]


def _attention_fwd(q, k, v, spec, scale, block_q, block_k):
    B, T, K, G, E = q.shape
    q_blocks = query_blocks(q, block_q, 0)
    pos_blocks = query_blocks(spec.q_positions, block_q, None)

    def one(args):
        return _forward_block(spec, args[0], args[1], k, v, scale, block_k)

    out, lse = lax.map(one, (q_blocks, pos_blocks))
    out = merge_blocks(out, T)
    return out, (q, k, v, spec, out, lse)


def _attention_bwd(scale, block_q, block_k, residuals, d_out):
    q, k, v, spec, out, lse = residuals
    T = q.shape[1]
    blocks = (
        query_blocks(q, block_q, 0),
        query_blocks(spec.q_positions, block_q, None),
        query_blocks(out, block_q, 0),
        query_blocks(d_out, block_q, 0),
        lse,
    )

    def one(carry, args):
        q_b, pos_b, out_b, d_out_b, lse_b = args
        dq, dk, dv = _backward_block(spec, q_b, pos_b, k, v, scale, block_k, out_b, lse_b, d_out_b, *carry)
        return (dk, dv), dq

    zeros = jnp.zeros(k.shape, jnp.float32)
    (dk, dv), dq = lax.scan(one, (zeros, zeros), blocks)
    return merge_blocks(dq, T).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: MaskSpec,
    *,
    scale: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> jax.Array:
    """q [B, T, H, E], k / v [B, S, K, E] (H = K * G, query head h uses KV head h // G) -> [B, T, H, E].

    Visits only the key blocks `spec` can see among the first max(kv_len) slots; rows with no visible
    key give zeros. Queries go in blocks of `block_q`; key tiles are as long as a query block over a
    contiguous causal cache, else at most `block_k` slots, all of one size (`key_block`). Differentiable
    in q, k and v; k / v may be `QuantizedKV` (dequantized one key tile at a time) or `PagedKV` (gathered one
    key tile at a time), not differentiable then.
    """
    B, T, H, E = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    block_q = min(block_q, T)
    block_k = key_block(spec, S, block_q, block_k)
    q = q.reshape(B, T, K, H // K, E)
    if isinstance(k, (QuantizedKV, PagedKV)) or isinstance(v, (QuantizedKV, PagedKV)):  # a cache: inference only
        out = _attention_fwd(q, k, v, spec, scale, block_q, block_k)[0]
    else:
        out = _attention(q, k, v, spec, scale, block_q, block_k)
    return out.reshape(B, T, H, E)


def attention_with_lse(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: MaskSpec,
    *,
    scale: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> tuple[jax.Array, jax.Array]:
    """`attention` and its log-sum-exp float32 [B, T, H] (a huge negative number where a query sees no key):
    the partial result over one shard of the keys, for merging across shards. Forward only."""
    B, T, H, E = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    block_q = min(block_q, T)
    out, residuals = _attention_fwd(
        q.reshape(B, T, K, H // K, E), k, v, spec, scale, block_q, key_block(spec, S, block_q, block_k)
    )
    lse = jnp.transpose(residuals[-1], (1, 0, 4, 2, 3))  # [nq, B, K, G, block_q] -> [B, nq, block_q, K, G]
    return out.reshape(B, T, H, E), lse.reshape(B, -1, H)[:, :T]

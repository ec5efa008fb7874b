"""Split-K decode attention (flash-decoding) in Pallas, forward only.

One new token per sequence attends to its cache: q [B, Hq, D], k and v [B, S, Hkv, D], `lengths` [B] valid keys
per sequence. The grid is (batch, KV head, split); each program returns a partial (o, m, l) over one chunk of the
cache, merged with log-sum-exp rescaling. `split_attention` and `run_splits` are shared with the paged kernel. A
quantized cache (`kv_quant` "int8" / "int4", the layout of `duo_jax.quant.QuantizedKV`) is read as stored and
dequantized per tile. Design: docs/kernels.md, "Split-K decode (GPU)".
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common


def _split_kernel(
    lengths_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,  # inputs (+ scales when quantized), outputs
    scale: float,
    block_k: int,
    blocks_per_split: int,
    kv_quant: str | None,
):
    if kv_quant is None:
        (o_ref, m_ref, l_ref), k_scale_ref, v_scale_ref = refs, None, None
    else:
        k_scale_ref, v_scale_ref, o_ref, m_ref, l_ref = refs
    dtype = q_ref.dtype

    def tile(ref, scale_ref, i):  # keys or values [bk, D / parts] per part, dequantized when quantized
        return _common.load_tile(ref, scale_ref, pl.ds(i * block_k, block_k), kv_quant, dtype)

    split_attention(
        lengths_ref,
        q_ref,
        lambda i: tile(k_ref, k_scale_ref, i),
        lambda i: tile(v_ref, v_scale_ref, i),
        (o_ref, m_ref, l_ref),
        scale=scale,
        block_k=block_k,
        blocks_per_split=blocks_per_split,
    )


def split_attention(
    lengths_ref,
    q_ref,
    k_tile,
    v_tile,
    out_refs,
    *,
    scale: float,
    block_k: int,
    blocks_per_split: int,
    init=None,
    program=None,
):
    """One program's share of split-K decode: the G query rows of q_ref [parts, G, D / parts] over the keys
    of chunk program_id(2) of sequence program_id(0) (`blocks_per_split` blocks of `block_k`, stopping at the
    sequence's length), with `k_tile(i)` / `v_tile(i)` loading block i of the chunk as parts of [bk, D / parts]
    (a slice of a contiguous cache, a dequantized tile, pages read through a block table). Writes the
    unnormalised output, running max and sum to out_refs (o, m, l) for `merge_splits`. `init(qs)`, when
    given, is the softmax state (acc parts, m, l) the loop starts from instead of the empty one: keys the
    program has already scored (the new token of `duo_decode_attention`'s streaming heads). `program`: the
    (sequence, split) program ids, read by a caller that runs this inside a `pl.when` (where the interpreter
    cannot read them)."""
    o_ref, m_ref, l_ref = out_refs
    b, split = (pl.program_id(0), pl.program_id(2)) if program is None else program
    chunk_start = split * blocks_per_split * block_k
    keys_left = jnp.maximum(lengths_ref[b] - chunk_start, 0)  # valid keys in and past this chunk
    qs = [q_ref[i] for i in range(q_ref.shape[0])]  # the query's parts, each [G, D / parts]

    def body(i, carry):
        acc, m, l = carry  # [parts][G, D / parts], [G], [G]
        s = (
            functools.reduce(
                operator.add,
                [jnp.einsum("gd,kd->gk", q, k, preferred_element_type=jnp.float32) for q, k in zip(qs, k_tile(i))],
            )
            * scale
        )
        cols = i * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        mask = cols < keys_left
        s = jnp.where(mask, s, _common.MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = correction * l + p.sum(axis=-1)
        acc = tuple(
            correction[:, None] * a + jnp.einsum("gk,kd->gd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            for a, v in zip(acc, v_tile(i))
        )
        return acc, m_new, l

    num_blocks = jnp.minimum(_common.cdiv(keys_left, block_k), blocks_per_split)
    rows = qs[0].shape[0]
    state = (
        init(qs)
        if init is not None
        else (
            tuple(jnp.zeros(q.shape, jnp.float32) for q in qs),
            jnp.full((rows,), _common.MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )
    )
    acc, m, l = lax.fori_loop(0, num_blocks, body, state)
    for i, a in enumerate(acc):  # Unnormalised; the reduction divides by the combined l.
        o_ref[i] = a
    m_ref[...] = m
    l_ref[...] = l


def group_queries(q: jax.Array, num_kv_heads: int, parts: int, interpret: bool) -> jax.Array:
    """q [B, Hq, D] -> [B, Hkv, parts, G', D / parts]: the query heads grouped by KV head, each head's D
    elements in `parts` (int4's nibble halves). Triton's dot wants at least 16 rows, so on GPU the group is
    zero-padded to a power of two G' >= 16."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    q = jnp.swapaxes(q.reshape(batch, num_kv_heads, group, parts, head_dim // parts), 2, 3)
    rows = group if interpret else _common.fit_block(1 << 30, group)
    if rows != group:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, rows - group), (0, 0)))
    return q


def run_splits(
    kernel,
    in_specs: list,
    args: list,
    q: jax.Array,
    *,
    num_splits: int,
    num_heads: int,
    dtype,
    interpret: bool,
    name: str,
    return_lse: bool,
    extra_outputs: tuple = (),
    aliases: dict[int, int] | None = None,
):
    """Launches a split-K program `kernel` (one `split_attention` per program) over grid (batch, KV head, split)
    with grouped queries q [B, Hkv, parts, G', D / parts] (`group_queries`) among its inputs, then merges the
    splits (`merge_splits`). Its outputs: o float32 [B, Hkv, splits, parts, G', D / parts], m, l float32
    [B, Hkv, splits, G'], then `extra_outputs` ((BlockSpec, ShapeDtypeStruct) pairs), each of which `aliases`
    may alias to an input (input index -> its index among the extra outputs). Returns the merged output (and
    lse), followed by the extra outputs when there are any."""
    batch, num_kv_heads, parts, rows, width = q.shape
    o, m, l, *extras = launch_splits(
        kernel,
        in_specs,
        args,
        (batch, num_kv_heads, num_splits),
        parts=parts,
        rows=rows,
        width=width,
        interpret=interpret,
        name=name,
        extra_outputs=extra_outputs,
        aliases=aliases,
    )
    merged = merge_splits(o, m, l, num_heads=num_heads, dtype=dtype, return_lse=return_lse)
    if not extras:
        return merged
    return (*merged, *extras) if return_lse else (merged, *extras)


def launch_splits(
    kernel,
    in_specs: list,
    args: list,
    grid: tuple[int, ...],
    *,
    parts: int,
    rows: int,
    width: int,
    interpret: bool,
    name: str,
    extra_outputs: tuple = (),
    aliases: dict[int, int] | None = None,
):
    """The split-K launch: `kernel` over `grid` (its first dim the batch), each program writing its partial o
    float32 [parts, rows, width] and m, l float32 [rows] at its grid point: outputs shaped grid + those dims,
    then `extra_outputs` as `run_splits`'."""
    whole = (None,) * len(grid)  # each grid point owns one block of the partials
    o, m, l, *extras = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((*whole, parts, rows, width), lambda *ids: (*ids, 0, 0, 0)),
            pl.BlockSpec((*whole, rows), lambda *ids: (*ids, 0)),
            pl.BlockSpec((*whole, rows), lambda *ids: (*ids, 0)),
            *(spec for spec, _ in extra_outputs),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*grid, parts, rows, width), jnp.float32),
            jax.ShapeDtypeStruct((*grid, rows), jnp.float32),
            jax.ShapeDtypeStruct((*grid, rows), jnp.float32),
            *(shape for _, shape in extra_outputs),
        ],
        input_output_aliases={i: 3 + j for i, j in (aliases or {}).items()},
        compiler_params=_backend.compiler_params(
            interpret=interpret, num_warps=4, num_stages=2, dimension_semantics=("parallel",) * len(grid)
        ),
        interpret=interpret,
        name=name,
    )(*args)
    return (o, m, l, *extras)


def merge_splits(o, m, l, *, num_heads: int, dtype, return_lse: bool):
    """Combines the splits' partials (`split_attention`) into [B, Hq, D] in `dtype` (and the log-sum-exp
    float32 [B, Hq] with `return_lse`): each split weighted by exp(m_split - m_max), 0 if it saw no key."""
    batch, num_kv_heads = o.shape[:2]
    group = num_heads // num_kv_heads
    m_max = m.max(axis=2, keepdims=True)  # [B, Hkv, 1, G']
    weight = jnp.where(l > 0.0, jnp.exp(m - m_max), 0.0)  # [B, Hkv, splits, G']
    l_total = jnp.einsum("bhsg,bhsg->bhg", weight, l)
    o = jnp.einsum("bhsg,bhspgd->bhgpd", weight, o)  # the parts back in order: [B, Hkv, G', parts, D / parts]
    o = o / jnp.where(l_total == 0.0, 1.0, l_total)[..., None, None]
    out = o[:, :, :group].reshape(batch, num_heads, -1).astype(dtype)
    if not return_lse:
        return out
    lse = m_max[:, :, 0] + jnp.log(jnp.maximum(l_total, 1e-30))  # [B, Hkv, G']
    return out, lse[:, :, :group].reshape(batch, num_heads)


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
    interpret: bool | None = None,
    return_lse: bool = False,
):
    """Single-token attention over a KV cache, split along the keys.

    Args:
      q: [B, Hq, D] one query per sequence.
      k, v: [B, S, Hkv, D] cache; Hq % Hkv == 0. With `kv_quant`, the cache's int8 codes instead:
        [B, S, Hkv, D] for "int8", [B, S, Hkv, D/2] for "int4" (two per byte, `_common.unpack_int4_halves`).
      lengths: int32 [B]; sequence b attends to keys j < lengths[b] (clipped to
        S). A sequence with length 0 gets a zero output.
      scale: softmax scale, default 1 / sqrt(D).
      block_k: keys per loop step.
      num_splits: how many chunks the keys are split into (at most); each is a
        whole number of blocks, the last one possibly fewer. S is padded only if
        it is not a multiple of block_k.
      k_scale, v_scale: with `kv_quant`, the codes' scales [B, S, Hkv, 1] (one per token and head).
      kv_quant: None (k / v are values), "int8" or "int4": each key tile is dequantized in the kernel
        (codes * scale, in q's dtype) before its dots; the cache is never dequantized whole.
      interpret: None = interpret mode exactly when running on CPU.

      return_lse: also return the log-sum-exp of each query's scaled scores,
        float32 [B, Hq] (a huge negative number for a sequence with length 0),
        so that attention over several shards of the keys can be merged
        (`duo_jax.sharding.merge_partials`).

    Returns:
      [B, Hq, D] like q, or (that, lse) with `return_lse`.
    """
    _common.check_cache(q, k, v, k_scale, v_scale, kv_quant, q_ndim=3)
    _common.check_block("block_k", block_k)
    _common.check_block("num_splits", num_splits)
    batch, num_heads, head_dim = q.shape
    seq_k, num_kv_heads = k.shape[1], k.shape[2]
    parts = _common.kv_parts(kv_quant)
    width = head_dim // parts
    scale = _common.default_scale(head_dim, scale)
    interpret = _backend.resolve_interpret(interpret)
    lengths = jnp.minimum(_common.per_batch(lengths, batch, seq_k), seq_k)

    block_k = _common.fit_block(block_k, seq_k)
    num_blocks = _common.cdiv(seq_k, block_k)
    # num_splits chunks of whole blocks; the last chunk may be shorter (its program stops at the cache's end,
    # since lengths <= S), so any cache size gets about num_splits programs and the cache is never padded.
    blocks_per_split, num_splits = _common.split_blocks(num_blocks, num_splits)
    chunk = blocks_per_split * block_k
    cache = [k, v] + ([] if kv_quant is None else [k_scale, v_scale])
    # a partial last block would be read past the end: pad (only caches not a multiple of block_k)
    cache = [_common.pad_to_block(x, block_k) for x in cache]

    q_dtype, q = q.dtype, group_queries(q, num_kv_heads, parts, interpret)
    rows = q.shape[3]
    kv_spec = pl.BlockSpec((None, chunk, None, width), lambda b, h, s: (b, s, h, 0))
    scale_spec = pl.BlockSpec((None, chunk, None, 1), lambda b, h, s: (b, s, h, 0))
    in_specs = [
        pl.BlockSpec((batch,), lambda b, h, s: (0,)),  # lengths
        pl.BlockSpec((None, None, parts, rows, width), lambda b, h, s: (b, h, 0, 0, 0)),
        kv_spec,  # k
        kv_spec,  # v
    ] + ([] if kv_quant is None else [scale_spec, scale_spec])
    kernel = functools.partial(
        _split_kernel, scale=scale, block_k=block_k, blocks_per_split=blocks_per_split, kv_quant=kv_quant
    )
    return run_splits(
        kernel,
        in_specs,
        [lengths, q, *cache],
        q,
        num_splits=num_splits,
        num_heads=num_heads,
        dtype=q_dtype,
        interpret=interpret,
        name="decode_attention_split",
        return_lse=return_lse,
    )

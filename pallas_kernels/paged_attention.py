"""Attention over a paged cache in Pallas (Triton on GPU), forward only: decode and chunked prefill.

k_pages and v_pages [Hkv, N, P, D] (head-major pools shared by the batch), block_tables int32 [B, M] (slot s of
sequence b is page block_tables[b, s // P], row s % P); the pages are read where they are, entries past a length
clipped into the pool and masked. `paged_decode_attention` takes one query per sequence (q [B, Hq, D]),
`paged_flash_attention` a chunk (q [B, T, Hq, D]). P and D must be powers of two (Triton's tensor shapes).
Design: docs/kernels.md, "Paged attention (GPU)".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common
from pallas_kernels.decode_attention import group_queries, run_splits, split_attention
from pallas_kernels.flash_attention import Config, forward_program, launch_forward


def check_paged(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array) -> None:
    """q [B, Hq, D], k_pages / v_pages [Hkv, N, P, D] (Hq a multiple of Hkv), block_tables [B, M]."""
    if q.ndim != 3 or k_pages.ndim != 4 or k_pages.shape != v_pages.shape or block_tables.ndim != 2:
        raise ValueError(
            "expected q [B, Hq, D], k_pages and v_pages [Hkv, N, P, D] of one shape and "
            f"block_tables [B, M]; got q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}, "
            f"block_tables {block_tables.shape}."
        )
    if q.shape[0] != block_tables.shape[0] or q.shape[2] != k_pages.shape[3] or q.shape[1] % k_pages.shape[0]:
        raise ValueError(
            f"q {q.shape} does not fit pages {k_pages.shape} and block_tables {block_tables.shape}: "
            "batch, head_dim and the query heads (a multiple of the KV heads) must agree."
        )


def pool_slots(block_tables: jax.Array, positions: jax.Array, num_pages: int, page_size: int) -> jax.Array:
    """The slot (page * P + row) in pools of `num_pages` pages of P = `page_size` rows of each of sequence b's
    `positions` [B, ...] through block_tables [B, M]; num_pages * P (past the pools: not written) where the table
    has no page for it (a position past its M pages, an entry out of [0, num_pages))."""
    batch, max_pages = block_tables.shape
    flat = positions.reshape(batch, -1)
    index = flat // page_size
    page = jnp.take_along_axis(block_tables.astype(jnp.int32), jnp.clip(index, 0, max_pages - 1), axis=1)
    kept = (index < max_pages) & (page >= 0) & (page < num_pages)
    return jnp.where(kept, page * page_size + flat % page_size, num_pages * page_size).reshape(positions.shape)


def pages_per_block(page_size: int, block_k: int) -> int:
    """Pages per key block: block_k // page_size tokens' worth (one page when pages are larger)."""
    return max(1, block_k // page_size)


def paged_tile(tables_ref, ref, pages_per_block: int, i) -> list[jax.Array]:
    """Key (or value) block i of a split-K program's split, [pages_per_block * P, D]: its pages' ids from the
    split's run of table entries, then one gathered load of them from this KV head's pool ref [N, P, D]."""
    pages = tables_ref[pl.ds(i * pages_per_block, pages_per_block)]
    return [ref[pages].reshape(pages_per_block * ref.shape[1], ref.shape[2])]


def split_tables(block_tables: jax.Array, num_pages: int, per_block: int, num_splits: int):
    """Block tables [B, M] cut into split-K's chunks of whole key blocks of `per_block` pages: (tables int32
    [B, splits, pages per split], blocks per split, splits). Every entry is in the pool ("no page"s clipped,
    page 0 padding the table to whole splits): a block may read a few entries past its sequence's length, whose
    keys the length masks."""
    batch, max_pages = block_tables.shape
    num_blocks = _common.cdiv(max_pages, per_block)
    blocks_per_split, num_splits = _common.split_blocks(num_blocks, num_splits)
    pages_per_split = blocks_per_split * per_block
    tables = jnp.minimum(block_tables.astype(jnp.int32), num_pages - 1)
    tables = jnp.pad(tables, ((0, 0), (0, num_splits * pages_per_split - max_pages)))
    return tables.reshape(batch, num_splits, pages_per_split), blocks_per_split, num_splits


def _paged_kernel(
    lengths_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    *,
    scale: float,
    pages_per_block: int,
    blocks_per_split: int,
):
    block_k = pages_per_block * k_ref.shape[1]  # k_ref: this KV head's pool [N, P, D]
    split_attention(
        lengths_ref,
        q_ref,
        functools.partial(paged_tile, tables_ref, k_ref, pages_per_block),
        functools.partial(paged_tile, tables_ref, v_ref, pages_per_block),
        (o_ref, m_ref, l_ref),
        scale=scale,
        block_k=block_k,
        blocks_per_split=blocks_per_split,
    )


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    block_k: int = 128,
    num_splits: int = 16,
    interpret: bool | None = None,
    return_lse: bool = False,
):
    """Single-token attention over paged caches, split along each sequence's pages.

    Args:
      q: [B, Hq, D] one query per sequence.
      k_pages, v_pages: [Hkv, N, P, D] the pool (Hq % Hkv == 0).
      block_tables: int32 [B, M]; entries past a sequence's length may be anything (>= N: none).
      lengths: int32 [B]; sequence b attends to its slots j < lengths[b] (clipped to M * P); 0 gives zeros.
      scale: softmax scale, default 1 / sqrt(D).
      block_k: tokens per loop step (rounded to whole pages: max(1, block_k // P) pages).
      num_splits: how many chunks of whole blocks each sequence's pages are split into (at most).
      interpret: None = interpret mode exactly when running on CPU.
      return_lse: also return the log-sum-exp float32 [B, Hq] (as `decode_attention`).

    Returns:
      [B, Hq, D] like q, or (that, lse) with `return_lse`.
    """
    check_paged(q, k_pages, v_pages, block_tables)
    _common.check_block("block_k", block_k)
    _common.check_block("num_splits", num_splits)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    scale = _common.default_scale(head_dim, scale)
    interpret = _backend.resolve_interpret(interpret)
    lengths = jnp.minimum(_common.per_batch(lengths, batch, max_pages * page_size), max_pages * page_size)

    per_block = pages_per_block(page_size, block_k)
    tables, blocks_per_split, num_splits = split_tables(block_tables, num_pages, per_block, num_splits)
    pages_per_split = tables.shape[2]

    q_dtype, q = q.dtype, group_queries(q, num_kv_heads, 1, interpret)
    rows = q.shape[3]
    pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, s: (h, 0, 0, 0))
    in_specs = [
        pl.BlockSpec((batch,), lambda b, h, s: (0,)),  # lengths
        pl.BlockSpec((None, None, pages_per_split), lambda b, h, s: (b, s, 0)),  # this split's pages
        pl.BlockSpec((None, None, 1, rows, head_dim), lambda b, h, s: (b, h, 0, 0, 0)),  # q
        pool_spec,  # k_pages
        pool_spec,  # v_pages
    ]
    kernel = functools.partial(_paged_kernel, scale=scale, pages_per_block=per_block, blocks_per_split=blocks_per_split)
    return run_splits(
        kernel,
        in_specs,
        [lengths, tables, q, k_pages, v_pages],
        q,
        num_splits=num_splits,
        num_heads=num_heads,
        dtype=q_dtype,
        interpret=interpret,
        name="paged_decode_attention_split",
        return_lse=return_lse,
    )


def _paged_flash_kernel(
    q_offset_ref, kv_len_ref, q_ref, tables_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: Config, pages_per_block: int
):
    width = k_ref.shape[2]  # k_ref: this query head's KV head's pool [N, P, D]

    def load_kv(kv_block):  # key block kv_block: its pages' ids, then one gathered load of each pool
        pages = tables_ref[pl.ds(kv_block * pages_per_block, pages_per_block)]
        return [k_ref[pages].reshape(cfg.block_k, width)], [v_ref[pages].reshape(cfg.block_k, width)]

    forward_program(q_offset_ref, kv_len_ref, q_ref, load_kv, o_ref, lse_ref, cfg=cfg)


def paged_flash_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    *,
    q_offset,
    kv_len,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal attention of a chunk of queries over paged caches (chunked prefill), forward only.

    q [B, T, Hq, D]: query i of sequence b at position q_offset[b] + i; k_pages / v_pages [Hkv, N, P, D];
    block_tables int32 [B, M]; sequence b sees its slots j <= position and j < kv_len[b] (clipped to M * P).
    The flash kernel's program (`flash_attention.forward_program`: grid batch x query head x query block, key
    blocks past kv_len or the causal edge skipped) with key blocks of max(1, block_k // P) pages, each loaded
    through the table with one gathered load. Queries that see no key get 0.
    """
    _common.check_block("block_q", block_q)
    _common.check_block("block_k", block_k)
    if q.ndim != 4:
        raise ValueError(f"expected q [B, T, Hq, D], got {q.shape}.")
    check_paged(q[:, 0], k_pages, v_pages, block_tables)
    batch, seq_q, _, head_dim = q.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    max_pages = block_tables.shape[1]
    interpret = _backend.resolve_interpret(interpret)
    block_q, block_k = _backend.fit_tiles(block_q, block_k, q.dtype, interpret)
    per_block = pages_per_block(page_size, _common.fit_block(block_k, max_pages * page_size))
    cfg = Config(
        seq_q=seq_q,
        causal=True,
        sink=None,
        recent=None,
        scale=_common.default_scale(head_dim, scale),
        block_q=_common.fit_block(block_q, seq_q),
        block_k=per_block * page_size,
        interpret=interpret,
    )
    q_offset = _common.per_batch(q_offset, batch, 0)
    kv_len = jnp.minimum(_common.per_batch(kv_len, batch, max_pages * page_size), max_pages * page_size)
    tables = jnp.minimum(block_tables.astype(jnp.int32), num_pages - 1)  # "no page" entries: masked reads
    tables = _common.pad_to_block(tables, per_block)
    q_padded = _common.pad_to_block(q, cfg.block_q)
    group = q.shape[2] // k_pages.shape[0]
    pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, i: (h // group, 0, 0, 0))
    tables_spec = pl.BlockSpec((None, tables.shape[1]), lambda b, h, i: (b, 0))
    kernel = functools.partial(_paged_flash_kernel, cfg=cfg, pages_per_block=per_block)
    o, _ = launch_forward(
        kernel,
        q_padded,
        [q_offset, kv_len],
        [tables, k_pages, v_pages],
        [tables_spec, pool_spec, pool_spec],
        cfg,
        name="paged_flash_attention_fwd",
    )
    return o[:, :seq_q]


__all__ = ["check_paged", "paged_decode_attention", "paged_flash_attention", "pages_per_block"]

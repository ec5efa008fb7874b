"""DuoAttention's decode step in one Pallas launch: retrieval heads over their cache, streaming heads over
their ring plus the new token, forward only.

The first n KV heads (retrieval) hold every token in a contiguous or paged cache [B, C, n, D], the new token
already written; the other K - n (streaming) hold a ring [B, S, K - n, D] of sink + recent tokens, and the new
token's keys and values come separately (not in the ring yet). One grid of work items (a retrieval head's split of
its cache, or a streaming head's ring) and one merge serve both.
Design: docs/kernels.md, "DuoAttention's decode step in one launch".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common
from pallas_kernels.decode_attention import group_queries, launch_splits, merge_splits, split_attention
from pallas_kernels.paged_attention import check_paged, paged_tile, pages_per_block, pool_slots, split_tables


def lookup(table: tuple[int, ...], i: jax.Array) -> jax.Array:
    """table[i] for a static table and a traced scalar i, as a chain of selects (index maps and kernel bodies
    cannot capture an array constant)."""
    value = jnp.int32(table[0])
    for j in range(1, len(table)):
        value = jnp.where(i == j, jnp.int32(table[j]), value)
    return value


@dataclasses.dataclass(frozen=True)
class WorkItems:
    """The grid's second axis, one program per piece of work: item w < n * S is retrieval head w // S (the caches'
    order) over split w % S of its cache; the K_s items after them are the streaming heads, one each (a ring is one
    split). So no program is launched for a split a streaming head does not have."""

    num_retrieval: int
    num_splits: int
    order: tuple[int, ...]  # the model's KV heads in the caches' order

    @property
    def retrieval_items(self) -> int:
        return self.num_retrieval * self.num_splits

    @property
    def size(self) -> int:
        return self.retrieval_items + len(self.order) - self.num_retrieval

    def is_retrieval(self, w):
        return w < self.retrieval_items

    def split(self, w):
        return jnp.where(self.is_retrieval(w), w % self.num_splits, 0)

    def cache_head(self, w):
        return jnp.where(self.is_retrieval(w), w // self.num_splits, 0)

    def ring_head(self, w):
        return jnp.maximum(w - self.retrieval_items, 0)

    def model_head(self, w):
        """The item's KV head in the model's order."""
        n = self.num_retrieval
        return jnp.where(
            self.is_retrieval(w), lookup(self.order[:n], self.cache_head(w)), lookup(self.order[n:], self.ring_head(w))
        )


def _kernel(
    lengths_ref,
    ring_lengths_ref,
    q_ref,
    *refs,
    scale: float,
    items: WorkItems,
    block_k: int,
    blocks_per_split: int,
    ring_block: int,
    ring_blocks: int,
    pages_per_block: int | None,
    write_ring: bool,
    write_cache: bool,
):
    # refs: the slots written (the ring's with write_ring, then the cache's with write_cache), the retrieval cache
    # (k, v; or the split's page ids and the pools k, v), the ring (k, v), the new token (k, v), then the outputs:
    # o, m, l, and k, v of the ring (write_ring) and of the cache (write_cache), aliased to those inputs
    slot_refs, refs = refs[: write_ring + write_cache], refs[write_ring + write_cache :]
    written = 2 * (write_ring + write_cache)
    written_refs, refs = refs[len(refs) - written :], refs[: len(refs) - written]
    *retrieval, ring_k_ref, ring_v_ref, k_new_ref, v_new_ref, o_ref, m_ref, l_ref = refs
    b, w = pl.program_id(0), pl.program_id(1)
    is_retrieval, split = items.is_retrieval(w), items.split(w)
    out = (o_ref, m_ref, l_ref)

    def new_token(qs):  # split 0 scores the new token first; the other splits stay empty
        (q,) = qs
        first = split == 0
        score = jnp.sum(q.astype(jnp.float32) * k_new_ref[...].astype(jnp.float32)[None, :], axis=-1) * scale
        value = jnp.broadcast_to(v_new_ref[...].astype(jnp.float32)[None, :], q.shape)
        return (
            (jnp.where(first, value, 0.0),),
            jnp.where(first, score, _common.MASK_VALUE),
            jnp.where(first, jnp.ones_like(score), 0.0),
        )

    def write_new_token(slot_ref, outputs, paged=False):
        # split 0, after its keys are read: the new token into its slot (past the cache: kept out; a pool's slot
        # is page * P + row). Other programs read only keys below the slot, so none reads the row written here.
        slot = slot_ref[b]
        size = outputs[0].shape[0] * outputs[0].shape[1] if paged else outputs[0].shape[0]

        @pl.when((split == 0) & (slot < size))
        def _write():
            for ref, new_ref in zip(outputs, (k_new_ref, v_new_ref)):
                row = new_ref[...][None, :].astype(ref.dtype)
                if paged:
                    ref[slot // ref.shape[1], pl.ds(slot % ref.shape[1], 1), :] = row
                else:
                    ref[pl.ds(slot, 1), :] = row

    def rows(ref, size):
        return lambda i: [ref[pl.ds(i * size, size), :]]

    if pages_per_block is None:
        k_ref, v_ref = retrieval
        k_tile, v_tile = rows(k_ref, block_k), rows(v_ref, block_k)
    else:
        tables_ref, k_ref, v_ref = retrieval
        k_tile, v_tile = (functools.partial(paged_tile, tables_ref, ref, pages_per_block) for ref in (k_ref, v_ref))

    @pl.when(is_retrieval)
    def _retrieval():
        split_attention(
            lengths_ref,
            q_ref,
            k_tile,
            v_tile,
            out,
            scale=scale,
            block_k=block_k,
            blocks_per_split=blocks_per_split,
            init=new_token if write_cache else None,  # the cache does not hold the new token yet
            program=(b, split),
        )
        if write_cache:
            write_new_token(slot_refs[-1], written_refs[-2:], paged=pages_per_block is not None)

    @pl.when(jnp.logical_not(is_retrieval))
    def _streaming():
        # The ring is one chunk of `ring_blocks` blocks, the item's split 0
        split_attention(
            ring_lengths_ref,
            q_ref,
            rows(ring_k_ref, ring_block),
            rows(ring_v_ref, ring_block),
            out,
            scale=scale,
            block_k=ring_block,
            blocks_per_split=ring_blocks,
            init=new_token,
            program=(b, split),
        )
        if write_ring:
            write_new_token(slot_refs[0], written_refs[:2])


def duo_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    ring_k: jax.Array,
    ring_v: jax.Array,
    ring_lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    *,
    block_tables: jax.Array | None = None,
    kv_order: tuple[int, ...] | None = None,
    ring_slots: jax.Array | None = None,
    cache_slots: jax.Array | None = None,
    scale: float | None = None,
    block_k: int = 128,
    num_splits: int = 16,
    interpret: bool | None = None,
) -> jax.Array:
    """One new token per sequence over a cache split by KV heads.

    Args:
      q: [B, Hq, D], the query heads grouped by KV head (G = Hq / K each, K = n + K_s): without `kv_order`, in
        the caches' order (the first n * G heads go with the retrieval cache, the others with the ring); with
        it, in the model's order.
      k, v: [B, C, n, D] the retrieval heads' cache, the new token written; C a multiple of `block_k`. With
        `block_tables`, their pools of pages instead: [n, N, P, D] (P a power of two).
      lengths: int32 [B]; the retrieval heads see keys j < lengths[b].
      ring_k, ring_v: [B, S, K_s, D] the streaming heads' ring (S tiled by `_common.exact_block(S)`).
      ring_lengths: int32 [B]; the streaming heads see ring slots j < ring_lengths[b] (<= S) and the new token.
      k_new, v_new: the new token's key and value: [B, K_s, D] on the streaming heads, or with `kv_order` [B, K, D]
        on every KV head in the model's order (the streaming heads' rows are read).
      block_tables: int32 [B, M] for a paged retrieval cache (slot j of sequence b: page block_tables[b, j // P],
        row j % P; `paged_attention`'s layout), or None for a contiguous one.
      kv_order: the model's K KV heads in the caches' order (retrieval cache heads, then ring heads), so that q,
        k_new, v_new and the output stay in the model's order: each head is routed to its cache in the kernel's
        index maps, no gather of heads around it. None: q and the output in the caches' order.
      ring_slots: int32 [B], or None: each sequence's ring slot for the new token (S or more: not kept). The
        kernel then also writes the new token's keys and values there, after reading the ring, into ring_k /
        ring_v (updated in place: donate them), and returns them.
      cache_slots: int32 [B], or None: with it, the retrieval cache k / v does not hold the new token yet (the
        retrieval heads see keys j < lengths[b] there, and the new token from k_new / v_new, which then needs
        `kv_order`), and the kernel writes it at slot cache_slots[b] (C or more: not kept; paged: through the
        block table, not kept where the table has no page), in place, returning k and v after the ring.
      scale: softmax scale, default 1 / sqrt(D).
      block_k, num_splits: the retrieval cache's key block (whole pages when paged) and (at most) how many
        chunks it is split into.
      interpret: None = interpret mode exactly when running on CPU.

    Returns:
      [B, Hq, D] like q (in q's head order); with `ring_slots` / `cache_slots`, a tuple of that, then ring_k and
      ring_v, then k and v, as written.
    """
    batch, num_heads, head_dim = q.shape
    paged = block_tables is not None
    num_retrieval = k.shape[0] if paged else k.shape[2]
    size = ring_k.shape[1]
    order = check_arguments(
        q, k, v, ring_k, ring_v, k_new, v_new, kv_order=kv_order, cache_slots=cache_slots, block_tables=block_tables
    )
    num_kv_heads = len(order)
    ring_tile = _common.exact_block(size)
    if ring_tile is None:
        raise ValueError(f"a ring of {size} slots has no power-of-two key block >= 16 (use the separate kernels)")
    _common.check_block("block_k", block_k)
    scale = _common.default_scale(head_dim, scale)
    interpret = _backend.resolve_interpret(interpret)
    if paged:
        num_pages, page_size = k.shape[1], k.shape[2]
        capacity = block_tables.shape[1] * page_size
        per_block = pages_per_block(page_size, block_k)
        tables, blocks_per_split, num_splits = split_tables(block_tables, num_pages, per_block, num_splits)
        block_k = per_block * page_size
    else:
        capacity = k.shape[1]
        block_k, per_block = _common.fit_block(block_k, capacity), None
        if capacity % block_k:
            raise ValueError(f"the retrieval cache's {capacity} slots are not a multiple of block_k={block_k}")
        blocks_per_split, num_splits = _common.split_blocks(capacity // block_k, num_splits)
    items = WorkItems(num_retrieval, num_splits, order)
    if paged:
        pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, w: (items.cache_head(w), 0, 0, 0))
        tables_spec = pl.BlockSpec((None, None, tables.shape[2]), lambda b, w: (b, items.split(w), 0))  # its pages
        retrieval_specs = [tables_spec, pool_spec, pool_spec]
        retrieval = [tables, k, v]
    else:
        cache_spec = pl.BlockSpec(
            (None, blocks_per_split * block_k, None, head_dim), lambda b, w: (b, items.split(w), items.cache_head(w), 0)
        )
        retrieval_specs, retrieval = [cache_spec, cache_spec], [k, v]
    lengths = jnp.minimum(_common.per_batch(lengths, batch, capacity), capacity)
    ring_lengths = jnp.minimum(_common.per_batch(ring_lengths, batch, size), size)

    q_dtype, q = q.dtype, group_queries(q, num_kv_heads, 1, interpret)
    rows = q.shape[3]
    ring_spec = pl.BlockSpec((None, size, None, head_dim), lambda b, w: (b, 0, items.ring_head(w), 0))
    # the new token's rows: every KV head's in the model's order with kv_order, else the streaming heads' only
    new_row = items.model_head if kv_order is not None else items.ring_head
    new_spec = pl.BlockSpec((None, None, head_dim), lambda b, w: (b, new_row(w), 0))
    lengths_spec = pl.BlockSpec((batch,), lambda b, w: (0,))
    in_specs = [
        lengths_spec,
        lengths_spec,
        pl.BlockSpec((None, None, 1, rows, head_dim), lambda b, w: (b, items.model_head(w), 0, 0, 0)),
        *retrieval_specs,
        ring_spec,
        ring_spec,
        new_spec,
        new_spec,
    ]
    kernel = functools.partial(
        _kernel,
        scale=scale,
        items=items,
        block_k=block_k,
        blocks_per_split=blocks_per_split,
        ring_block=ring_tile,
        ring_blocks=size // ring_tile,
        pages_per_block=per_block,
        write_ring=ring_slots is not None,
        write_cache=cache_slots is not None,
    )
    # Written caches: the slots go in after q, the caches come out after (o, m, l), each aliased to its input.
    # Each write: (slots, their limit, the cache's out spec, the cache k, v, k's input index past the slots).
    ring_at = 3 + len(retrieval)  # ring_k's input index past the slots; the retrieval k, v are the 2 before it
    writes = [(ring_slots, size, ring_spec, ring_k, ring_v, ring_at)] if ring_slots is not None else []
    if cache_slots is not None and paged:  # a slot of the pool: page * P + row, or N * P where none is kept
        slot = pool_slots(block_tables, _common.per_batch(cache_slots, batch, capacity), num_pages, page_size)
        writes.append((slot, num_pages * page_size, pool_spec, k, v, ring_at - 2))
    elif cache_slots is not None:
        whole = pl.BlockSpec((None, capacity, None, head_dim), lambda b, w: (b, 0, items.cache_head(w), 0))
        writes.append((cache_slots, capacity, whole, k, v, ring_at - 2))
    slots = [_common.per_batch(slot, batch, limit) for slot, limit, *_ in writes]
    in_specs[3:3] = [lengths_spec] * len(slots)
    args = [lengths, ring_lengths, q, *slots, *retrieval, ring_k, ring_v, k_new, v_new]
    extra_outputs, aliases = [], {}
    for _, _, spec, key, value, at in writes:
        for offset, x in enumerate((key, value)):
            aliases[len(slots) + at + offset] = len(extra_outputs)
            extra_outputs.append((spec, jax.ShapeDtypeStruct(x.shape, x.dtype)))
    o, m, l, *written = launch_splits(
        kernel,
        in_specs,
        args,
        (batch, items.size),
        parts=1,
        rows=rows,
        width=head_dim,
        interpret=interpret,
        name="duo_decode_attention",
        extra_outputs=tuple(extra_outputs),
        aliases=aliases,
    )
    out = _merge(o, m, l, items, num_heads // num_kv_heads, q_dtype)
    return (out, *written) if written else out


def check_arguments(q, k, v, ring_k, ring_v, k_new, v_new, *, kv_order, cache_slots, block_tables=None):
    """`duo_decode_attention`'s shape checks (the Mosaic GPU kernel's too), each with a message naming the
    argument; returns the model's KV heads in the caches' order."""
    batch, num_heads, head_dim = q.shape
    paged = block_tables is not None
    num_retrieval = k.shape[0] if paged else k.shape[2]
    num_streaming = ring_k.shape[2]
    if num_retrieval == 0 or num_streaming == 0:
        raise ValueError(
            "duo_decode_attention needs retrieval and streaming heads; with one kind, use "
            "decode_attention (retrieval) or flash_attention with k_positions (streaming)"
        )
    if paged:
        check_paged(q[:, : num_retrieval * (num_heads // (num_retrieval + num_streaming))], k, v, block_tables)
    pairs = {"ring_k / ring_v": (ring_k, ring_v)} if paged else {"k / v": (k, v), "ring_k / ring_v": (ring_k, ring_v)}
    for name, (key, value) in pairs.items():
        if key.ndim != 4 or value.shape != key.shape or key.shape[0] != batch or key.shape[3] != head_dim:
            raise ValueError(
                f"{name} must both be [B={batch}, slots, heads, D={head_dim}], got {key.shape} and {value.shape}"
            )
    num_kv_heads = num_retrieval + num_streaming
    new_heads = num_streaming if kv_order is None else num_kv_heads
    if k_new.shape != (batch, new_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(
            f"k_new / v_new must be [B, {'K_s' if kv_order is None else 'K'}, D] = {(batch, new_heads, head_dim)}, "
            f"got {k_new.shape} and {v_new.shape}"
        )
    if cache_slots is not None and kv_order is None:
        raise ValueError("cache_slots needs kv_order (the retrieval heads' rows of k_new / v_new)")
    if kv_order is not None and sorted(kv_order) != list(range(num_kv_heads)):
        raise ValueError(f"kv_order must list the {num_kv_heads} KV heads once each, got {kv_order}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    return tuple(range(num_kv_heads)) if kv_order is None else tuple(kv_order)


def _merge(o, m, l, items: WorkItems, group: int, dtype) -> jax.Array:
    """The items' partials (o [B, W, 1, G', D], m, l [B, W, G']) -> [B, Hq, D] in the model's head order: each
    retrieval head's splits merged, each streaming head's one split normalised, the heads put back in order."""
    batch, n, num_splits = o.shape[0], items.num_retrieval, items.num_splits
    parts = []
    for first, heads, splits in ((0, n, num_splits), (items.retrieval_items, len(items.order) - n, 1)):
        pieces = [x[:, first : first + heads * splits] for x in (o, m, l)]
        pieces = [x.reshape(batch, heads, splits, *x.shape[2:]) for x in pieces]
        parts.append(merge_splits(*pieces, num_heads=heads * group, dtype=dtype, return_lse=False))
    merged = jnp.concatenate(parts, axis=1)  # [B, Hq, D], the heads in the caches' order
    place = {head: i for i, head in enumerate(items.order)}
    if list(place) == sorted(place):
        return merged
    return jnp.concatenate([merged[:, place[h] * group : (place[h] + 1) * group] for h in range(len(place))], axis=1)

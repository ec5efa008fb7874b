"""DuoAttention's decode step in one Pallas Mosaic GPU launch (Hopper), for a JAX whose Pallas has no Triton backend:
`pallas_kernels.duo_decode_attention`'s attention over a contiguous retrieval cache that already holds the new token,
heads in the model's order (`kv_order`). The caller writes the caches (the Triton kernel writes them itself).

One warpgroup per work item (`duo_decode.WorkItems`: a retrieval head's split of its cache, or a streaming head's
ring), the item's G query rows padded to wgmma's 64. Key and value tiles come in by TMA, up to `stages` tiles ahead
of the one being scored; the scores Q Kᵀ and the weighted values P V are each one wgmma (Kᵀ: the key tile in shared
memory read transposed), with the online softmax in registers, in base 2. A ring's item starts from the new token's
score (it is not in the ring). The items' partials (o, m, l) are merged as the Triton kernel's are
(`duo_decode._merge`).
Design: docs/kernels.md, "DuoAttention's decode step without Triton".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common
from pallas_kernels.duo_decode import WorkItems, _merge, check_arguments

ROWS = 64  # wgmma's M: the item's G query rows, zero-padded
LOG2E = math.log2(math.e)
SMEM_BYTES = 227 * 1024  # shared memory a Hopper block can hold
RING_BLOCK = 64  # a ring's key tile: P V's wgmma contracts over a multiple of 64 keys


def _kernel(
    lengths_ref,
    ring_lengths_ref,
    q_ref,
    k_ref,
    v_ref,
    ring_k_ref,
    ring_v_ref,
    k_new_ref,
    v_new_ref,
    o_ref,
    m_ref,
    l_ref,
    q_smem,
    k_smem,
    v_smem,
    new_smem,
    o_smem,
    stat_smem,
    q_barrier,
    k_barriers,
    v_barriers,
    new_barriers,
    *,
    items: WorkItems,
    block_k: int,
    blocks_per_split: int,
    ring_block: int,
    ring_blocks: int,
    stages: int,
    scale: float,
):
    w, b = lax.axis_index("item"), lax.axis_index("batch")
    is_retrieval, split = items.is_retrieval(w), items.split(w)
    head = items.model_head(w)
    dtype = q_smem.dtype
    plgpu.copy_gmem_to_smem(q_ref.at[b, head], q_smem, q_barrier)
    plgpu.barrier_wait(q_barrier)
    row = functools.partial(lax.broadcast_in_dim, shape=(ROWS, q_smem.shape[1]), broadcast_dimensions=(1,))
    column = functools.partial(lax.broadcast_in_dim, broadcast_dimensions=(0,))

    def per_row(value):  # [ROWS] in the layout of a row statistic (m, l)
        return plgpu.layout_cast(jnp.full((ROWS,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))

    def empty():
        """The carry (acc, m, l) before any key; m in base 2."""
        acc = plgpu.layout_cast(jnp.zeros((ROWS, q_smem.shape[1]), jnp.float32), plgpu.Layout.WGMMA)
        return acc, per_row(_common.MASK_VALUE), per_row(0.0)

    def new_token():
        """The carry with the new token (k_new / v_new's row of this head) scored."""
        for i, new_ref in enumerate((k_new_ref, v_new_ref)):
            plgpu.copy_gmem_to_smem(new_ref.at[b, head], new_smem.at[i], new_barriers.at[i])
            plgpu.barrier_wait(new_barriers.at[i])
        q = plgpu.layout_cast(q_smem[...], plgpu.Layout.WGMMA).astype(jnp.float32)
        k_new, v_new = (plgpu.layout_cast(new_smem[i], plgpu.Layout.WGMMA.reduce(0)) for i in (0, 1))
        score = (q * row(k_new.astype(jnp.float32))).sum(axis=1)
        return row(v_new.astype(jnp.float32)), score * (scale * LOG2E), per_row(1.0)

    def attend(keys, values, head_of_cache, first_slot, num_blocks, size, length, carry):
        """The carry over key tiles [first_slot + i * size, ...) of `keys` / `values` (head `head_of_cache`), tiles
        i < num_blocks holding a key below `length`."""
        steps = jnp.clip(_common.cdiv(length - first_slot, size), 0, num_blocks)

        def fetch(i, slot):
            rows = (b, pl.ds(first_slot + i * size, size), head_of_cache)
            plgpu.copy_gmem_to_smem(keys.at[rows], k_smem.at[slot, pl.ds(0, size)], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(values.at[rows], v_smem.at[slot, pl.ds(0, size)], v_barriers.at[slot])

        for i in range(min(stages, num_blocks)):
            pl.when(i < steps)(functools.partial(fetch, i, i))

        def body(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_barriers.at[slot])

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot, pl.ds(0, size)].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((ROWS, size), jnp.float32)) * (scale * LOG2E)
            cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, size), 1, layout=plgpu.Layout.WGMMA)
            seen = first_slot + i * size + cols < length
            s = jnp.where(seen, s, _common.MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(seen, jnp.exp2(s - column(m_new, s.shape)), 0.0)
            correction = jnp.exp2(m - m_new)
            l = l * correction + p.sum(axis=1)
            plgpu.barrier_wait(v_barriers.at[slot])

            def weighted(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot, pl.ds(0, size)])
                return acc_ref[...]

            pv = pl.run_scoped(weighted, plgpu.ACC((ROWS, acc.shape[1]), jnp.float32))
            pl.when(i + stages < steps)(functools.partial(fetch, i + stages, slot))
            return acc * column(correction, acc.shape) + pv, m_new, l

        return lax.fori_loop(0, steps, body, carry)

    def finish(carry):
        acc, m, l = carry
        o_smem[...] = acc
        stat_smem[0] = m * (1.0 / LOG2E)  # natural log units, as `_merge` takes them
        stat_smem[1] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, o_ref.shape[3])], o_ref.at[b, w, 0])  # the G real rows
        plgpu.copy_smem_to_gmem(stat_smem.at[0], m_ref.at[b, w])
        plgpu.copy_smem_to_gmem(stat_smem.at[1], l_ref.at[b, w])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(is_retrieval)
    def _retrieval():
        cache_head = items.cache_head(w)
        span = blocks_per_split * block_k
        carry = attend(k_ref, v_ref, cache_head, split * span, blocks_per_split, block_k, lengths_ref[b], empty())
        finish(carry)

    @pl.when(jnp.logical_not(is_retrieval))
    def _streaming():
        ring_head = items.ring_head(w)
        carry = attend(ring_k_ref, ring_v_ref, ring_head, 0, ring_blocks, ring_block, ring_lengths_ref[b], new_token())
        finish(carry)


def unsupported(q, k, v, ring_k, ring_v, *, kv_order, block_k: int = 64, stages: int = 4) -> str | None:
    """Why the kernel cannot take these arrays (q [..., Hq, D], the caches) and settings, or None: the one list of
    its limits, which the kernel raises and the dispatch falls back on."""
    head_dim, group = q.shape[-1], q.shape[-2] // len(kv_order)
    if q.dtype not in (jnp.bfloat16, jnp.float16) or any(x.dtype != q.dtype for x in (k, v, ring_k, ring_v)):
        return f"q and the caches must be bf16 or fp16 alike, got {q.dtype}, {k.dtype}, {ring_k.dtype}"
    if head_dim % 64 or group > ROWS:
        return f"head dim {head_dim} is not a multiple of 64, or {group} > {ROWS} query heads per KV head"
    if ring_k.shape[1] % RING_BLOCK:
        return f"a ring of {ring_k.shape[1]} slots is not a multiple of {RING_BLOCK}"
    if block_k not in (64, 128) or k.shape[1] % block_k:
        return f"block_k={block_k} must be 64 or 128 and divide the cache's {k.shape[1]} slots"
    tile = max(block_k, RING_BLOCK)
    smem = 2 * stages * tile * head_dim * q.dtype.itemsize + ROWS * head_dim * (q.dtype.itemsize + 4)
    if smem > SMEM_BYTES:
        return (
            f"{stages} stages of {tile}-key tiles at head dim {head_dim} need {smem // 1024} KiB of shared memory, "
            f"over a Hopper block's {SMEM_BYTES // 1024}: use fewer stages or block_k=64"
        )
    return None


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
    kv_order: tuple[int, ...],
    scale: float | None = None,
    block_k: int = 64,
    num_splits: int = 16,
    stages: int = 4,
    interpret=False,
) -> jax.Array:
    """One new token per sequence over a cache split by KV heads, heads in the model's order.

    Args:
      q: [B, Hq, D] in the model's head order, G = Hq / K query heads per KV head (G <= 64).
      k, v: [B, C, n, D] the retrieval heads' cache, the new token written; C a multiple of `block_k`.
      lengths: int32 [B]; the retrieval heads see keys j < lengths[b].
      ring_k, ring_v: [B, S, K - n, D] the streaming heads' ring (S a multiple of 64).
      ring_lengths: int32 [B]; the streaming heads see ring slots j < ring_lengths[b] and the new token.
      k_new, v_new: [B, K, D] the new token's keys and values on every KV head, the model's order (the streaming
        heads' rows are read).
      kv_order: the model's K KV heads in the caches' order (retrieval cache heads, then ring heads).
      scale: softmax scale, default 1 / sqrt(D).
      block_k, num_splits: the retrieval cache's key tile (64 or 128) and (at most) how many chunks it is split
        into; stages: key tiles in flight per item.
      interpret: Mosaic GPU's interpreter params (`InterpretGPUParams`), or False.

    Returns:
      [B, Hq, D] like q. 16-bit q and caches, D a multiple of 64.
    """
    batch, num_heads, head_dim = q.shape
    num_retrieval, size = k.shape[2], ring_k.shape[1]
    order = check_arguments(q, k, v, ring_k, ring_v, k_new, v_new, kv_order=kv_order, cache_slots=None)
    group = num_heads // len(order)
    reason = unsupported(q, k, v, ring_k, ring_v, kv_order=order, block_k=block_k, stages=stages)
    if reason is not None:
        raise ValueError(reason)
    tile = max(block_k, RING_BLOCK)
    scale = _common.default_scale(head_dim, scale)
    capacity = k.shape[1]
    blocks_per_split, num_splits = _common.split_blocks(capacity // block_k, num_splits)
    items = WorkItems(num_retrieval, num_splits, order)
    lengths = jnp.minimum(_common.per_batch(lengths, batch, capacity), capacity)
    ring_lengths = jnp.minimum(_common.per_batch(ring_lengths, batch, size), size)
    # q as [B, K, ROWS, D] in the model's head order, each KV head's G rows padded
    q_rows = jnp.pad(q.reshape(batch, len(order), group, head_dim), ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=swizzled),  # q
        plgpu.SMEM((stages, tile, head_dim), q.dtype, transforms=swizzled),  # key tiles
        plgpu.SMEM((stages, tile, head_dim), q.dtype, transforms=swizzled),  # value tiles
        plgpu.SMEM((2, head_dim), q.dtype),  # the new token's key and value
        plgpu.SMEM((ROWS, head_dim), jnp.float32),  # o
        plgpu.SMEM((2, ROWS), jnp.float32),  # m, l
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=2),
    ]
    kernel = functools.partial(
        _kernel,
        items=items,
        block_k=block_k,
        blocks_per_split=blocks_per_split,
        ring_block=RING_BLOCK,
        ring_blocks=size // RING_BLOCK,
        stages=stages,
        scale=scale,
    )
    o, m, l = plgpu.kernel(
        kernel,
        out_type=[
            jax.ShapeDtypeStruct((batch, items.size, 1, group, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, items.size, ROWS), jnp.float32),
            jax.ShapeDtypeStruct((batch, items.size, ROWS), jnp.float32),
        ],
        scratch_types=scratch,
        grid=(items.size, batch),
        grid_names=("item", "batch"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
        kernel_name="duo_decode_attention_mosaic",
    )(lengths, ring_lengths, q_rows, k, v, ring_k, ring_v, k_new, v_new)
    return _merge(o, m[..., :group], l[..., :group], items, group, q.dtype)

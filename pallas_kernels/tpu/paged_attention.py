"""Decode attention over a paged cache on TPU: JAX's maintained paged attention kernel, adapted to our call.

q [B, Hq, D], k_pages / v_pages [Hkv, N, P, D], lengths [B], block tables [B, M]: our pool goes in as it is.
Around the call q is scaled, "no page" entries are clipped into the pool, and sequences of length 0 give zeros.
The kernel rounds keys and values to bfloat16 and, compiled, needs head dims that are multiples of 128; the
dispatch hands it only such pools. Design: docs/kernels.md, "Paged decode (TPU)".
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.paged_attention import check_paged, pages_per_block
from pallas_kernels.tpu import _mosaic


def compute_block_pages(max_pages: int, page_size: int, block_k: int) -> int:
    """The largest divisor of `max_pages` with at most block_k // page_size pages (at least one)."""
    most = min(max_pages, pages_per_block(page_size, block_k))
    return max(d for d in range(1, most + 1) if max_pages % d == 0)


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    block_k: int = 512,
    interpret=None,
) -> jax.Array:
    """q [B, Hq, D] over pages [Hkv, N, P, D] through block_tables int32 [B, M]; sequence b sees its slots
    j < lengths[b] (clipped to M * P; 0 gives zeros). Same contract as the GPU kernel
    (`pallas_kernels.paged_decode_attention`), without `return_lse`."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    check_paged(q, k_pages, v_pages, block_tables)
    _common.check_block("block_k", block_k)
    batch, _, head_dim = q.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    max_pages = block_tables.shape[1]
    scale = _common.default_scale(head_dim, scale)
    lengths = jnp.minimum(_common.per_batch(lengths, batch, max_pages * page_size), max_pages * page_size)
    tables = jnp.minimum(block_tables.astype(jnp.int32), num_pages - 1)
    interpret = _mosaic.interpret_mode(interpret)
    if not interpret and head_dim % _mosaic.LANES:
        raise ValueError(
            f"JAX's TPU paged attention needs a head dim that is a multiple of {_mosaic.LANES} "
            f"on TPU, got {head_dim}; use the XLA path (duo_jax.attention.attend, impl='xla')."
        )
    mode = (
        contextlib.nullcontext()
        if not interpret
        else pltpu.force_tpu_interpret_mode(
            interpret if isinstance(interpret, pltpu.InterpretParams) else pltpu.InterpretParams()
        )
    )
    with mode:
        out = paged_attention(
            (q.astype(jnp.float32) * scale).astype(q.dtype),
            k_pages,
            v_pages,
            lengths,
            tables,
            pages_per_compute_block=compute_block_pages(max_pages, page_size, block_k),
        )
    return jnp.where((lengths > 0)[:, None, None], out, jnp.zeros_like(out))


__all__ = ["compute_block_pages", "paged_decode_attention"]

"""Keys or values held in pages, read in place: what `attend` takes for a paged cache.

`PagedKV(pages, block_tables)` stands for the contiguous cache [B, M * P, K, E] (slot = position) of B
sequences whose tokens live in a pool of pages shared by the batch:

  pages: [K, N, P, E]  N pages of P tokens, head-major (one head's page is P * E contiguous elements)
  block_tables: int32 [B, M]  slot s of sequence b is page block_tables[b, s // P], row s % P

Entries of a table past a sequence's length may name any page, or N ("no page", duo_jax.methods.paged):
reads clip them into the pool and the key lengths mask what they read. The attention paths never build the
[B, M * P, K, E] view: the Pallas / Mosaic decode kernels follow the tables themselves, and the blocked XLA
path (`duo_jax.attention.xla`) reads one key tile of slots at a time through `read`. `contiguous` builds the
whole view, for the dense reference only. Why head-major: docs/attention.md, "Paged caches".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
    """A pool of pages [K, N, P, E] and the block tables [B, M] through which B sequences read it."""

    pages: jax.Array
    block_tables: jax.Array

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The contiguous view's: [B, M * P, K, E]."""
        K, _, P, E = self.pages.shape
        B, M = self.block_tables.shape
        return (B, M * P, K, E)

    @property
    def ndim(self) -> int:
        return 4

    @property
    def dtype(self):
        return self.pages.dtype

    @property
    def page_size(self) -> int:
        return self.pages.shape[2]

    def clipped_tables(self) -> jax.Array:
        """The block tables with "no page" entries (>= N) clipped into the pool, so that every read is in
        bounds (what such an entry reads is masked by the key lengths)."""
        return jnp.minimum(self.block_tables, self.pages.shape[1] - 1).astype(jnp.int32)

    def read(self, first, size: int) -> jax.Array:
        """Slots [first, first + size) of every sequence, [B, size, K, E] (`first` may be traced; slots past
        M * P clip to the last page)."""
        slots = first + jnp.arange(size, dtype=jnp.int32)
        return self.at_positions(jnp.broadcast_to(slots, (self.block_tables.shape[0], size)))

    def at_positions(self, slots: jax.Array) -> jax.Array:
        """Slots int32 [B, T] of each sequence, [B, T, K, E]: a gather of T rows per sequence through its table
        (slots past M * P clip to the last page)."""
        P = self.page_size
        page = jnp.take_along_axis(self.clipped_tables(), slots // P, axis=1, mode="clip")  # [B, T]
        rows = self.pages[:, page, slots % P]  # [K, B, T, E]
        return jnp.moveaxis(rows, 0, 2)

    def contiguous(self) -> jax.Array:
        """The whole view [B, M * P, K, E] (a copy: for references and tests)."""
        return self.read(0, self.shape[1])


__all__ = ["PagedKV"]

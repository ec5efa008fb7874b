"""DuoAttention (and full attention) with a paged retrieval partition; the streaming heads keep their sink + ring.

Per layer l with n_l retrieval heads: pages_k[l], pages_v[l] [n_l, N, P, E] (a pool of N pages of P tokens per
head, shared by every sequence) and streaming_k[l], streaming_v[l] [B, S, K - n_l, E] (S: sink + recent, or the
layout's ring_slots); shared by all layers, block_tables int32 [B, M]: position p of sequence b lives in page
block_tables[b, p // P], row p % P, of every layer's pool (N: no page; writes through it are dropped).
`paged(method, page_size=, num_pages=)` turns a `DuoAttention` ("duo" or "full") into its paged form: `init_cache`
gives each sequence its own M pages in order, `empty_cache` a pool with no page handed out, for a scheduler that
owns the tables. Design: docs/serving.md, "The paged cache"; how the pages are read: docs/attention.md, "Paged caches".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.attention.pages import PagedKV
from duo_jax.cache import CacheLayout
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step, write_slots
from duo_jax.methods.duo import DuoAttention, DuoShared, retrieval_attention, split_heads
from duo_jax.model import apply_rotary
from duo_jax.sampling import check_number
from pallas_kernels.paged_attention import pool_slots

DEFAULT_PAGE_SIZE = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedLayerCache:
    """One layer's pool of retrieval pages and its per-sequence streaming slots."""

    pages_k: jax.Array  # [n_l, N, P, E]
    pages_v: jax.Array
    streaming_k: jax.Array  # [B, S, K - n_l, E]: S = sink + recent, or the layout's ring_slots
    streaming_v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCache:
    block_tables: jax.Array  # int32 [B, M]: page of each sequence's i-th P tokens; N: none
    layers: tuple[PagedLayerCache, ...]


@dataclasses.dataclass(frozen=True)
class PagedLayerView:
    """What one layer's `attend` gets: its arrays and the shared block tables (built inside the step)."""

    block_tables: jax.Array
    layer: PagedLayerCache


def write_pages(
    pool: jax.Array, block_tables: jax.Array, positions: jax.Array, valid: jax.Array, new: jax.Array
) -> jax.Array:
    """pool [n, N, P, E] with new [B, T, n, E] written at `positions` [B, T] through `block_tables` [B, M];
    invalid tokens, positions past M pages and unassigned table entries (N) are dropped."""
    n, N, P = pool.shape[:3]
    B, T = positions.shape
    slot = jnp.where(valid, pool_slots(block_tables, positions, N, P), N * P)
    flat = pool.reshape((n, N * P) + pool.shape[3:])  # each head's slots: one "sequence" of write_slots
    new = jnp.moveaxis(new.reshape((B * T, n) + new.shape[3:]), 1, 0)[:, :, None]  # [n, B * T, 1, E]
    slots = jnp.broadcast_to(slot.reshape(1, B * T), (n, B * T))
    written = write_slots(flat[:, :, None], slots, new)
    return written.reshape(pool.shape)


def gather_pages(pool: jax.Array, block_tables: jax.Array) -> jax.Array:
    """The sequences' pages as contiguous caches: pool [n, N, P, E], block_tables [B, M] -> [B, M * P, n, E]
    (slot = position; a copy, for tests and references: attention reads the pages in place)."""
    return PagedKV(pool, block_tables).contiguous()


@dataclasses.dataclass(frozen=True)
class PagedDuo(Method):
    """DuoAttention whose retrieval heads live in pages (`layout.capacity` = M * page_size tokens per sequence
    at most); `num_pages` per layer pool (None: batch * M, every sequence its own M pages)."""

    layout: CacheLayout
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None

    @property
    def name(self) -> str:
        """As `DuoAttention.name`, paged."""
        return "full_paged" if self.layout.every_head_retrieval else "duo_paged"

    def __post_init__(self):
        if self.page_size < 1 or self.layout.capacity % self.page_size:
            raise DuoJaxError(
                f"page_size must be positive and divide the capacity {self.layout.capacity}, got {self.page_size}"
            )
        if self.num_pages is not None and self.num_pages < 1:
            raise DuoJaxError(f"num_pages must be positive, got {self.num_pages}")

    @property
    def pages_per_sequence(self) -> int:
        return self.layout.capacity // self.page_size

    @property
    def max_tokens(self) -> int:
        return self.layout.capacity

    def pool_pages(self, batch: int) -> int:
        return self.pages_per_sequence * batch if self.num_pages is None else self.num_pages

    def _cache(self, batch: int, dtype, block_tables) -> PagedCache:
        layout, N, E = self.layout, self.pool_pages(batch), self.layout.head_dim
        S = layout.streaming_slots
        layers = tuple(
            PagedLayerCache(
                jnp.zeros((n, N, self.page_size, E), dtype),
                jnp.zeros((n, N, self.page_size, E), dtype),
                jnp.zeros((batch, S, layout.num_kv_heads - n, E), dtype),
                jnp.zeros((batch, S, layout.num_kv_heads - n, E), dtype),
            )
            for n in layout.num_retrieval
        )
        return PagedCache(jnp.asarray(block_tables, jnp.int32), layers)

    def init_cache(self, batch: int, dtype) -> PagedCache:
        """Every sequence its own M pages, in order (needs a pool of at least batch * M pages)."""
        M, N = self.pages_per_sequence, self.pool_pages(batch)
        if N < batch * M:
            raise DuoJaxError(
                f"a pool of {N} pages cannot give {batch} sequences {M} pages each; "
                "use empty_cache and hand out pages as sequences grow (duo_jax.serve)"
            )
        return self._cache(batch, dtype, np.arange(batch * M).reshape(batch, M))

    def empty_cache(self, batch: int, dtype) -> PagedCache:
        """A pool with no page handed out: every block-table entry is N (none)."""
        return self._cache(batch, dtype, np.full((batch, self.pages_per_sequence), self.pool_pages(batch)))

    def cache_spec(self, batch: int, dtype):
        return jax.eval_shape(lambda: self.empty_cache(batch, dtype))

    def layer_caches(self, cache: PagedCache) -> tuple[PagedLayerView, ...]:
        return tuple(PagedLayerView(cache.block_tables, layer) for layer in cache.layers)

    def with_layer_caches(self, cache: PagedCache, layers) -> PagedCache:
        return PagedCache(cache.block_tables, tuple(layers))

    def take_row(self, cache: PagedCache, b: jax.Array) -> PagedCache:
        """Sequence b's cache at batch 1 (b an int32 scalar, may be traced): its block-table row and streaming
        rows, and every layer's pools whole (they are shared: no copy)."""
        row = lambda x: jax.lax.dynamic_slice_in_dim(x, b, 1, axis=0)
        return PagedCache(
            row(cache.block_tables),
            tuple(
                PagedLayerCache(layer.pages_k, layer.pages_v, row(layer.streaming_k), row(layer.streaming_v))
                for layer in cache.layers
            ),
        )

    def put_row(self, cache: PagedCache, b: jax.Array, part: PagedCache) -> PagedCache:
        """`cache` with sequence b's streaming rows and the pools taken from `part` (a `take_row` after a step;
        steps never change the block tables)."""
        put = lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, b, axis=0)
        return PagedCache(
            cache.block_tables,
            tuple(
                PagedLayerCache(
                    new.pages_k,
                    new.pages_v,
                    put(old.streaming_k, new.streaming_k),
                    put(old.streaming_v, new.streaming_v),
                )
                for old, new in zip(cache.layers, part.layers)
            ),
        )

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        """2 * E * bytes * sum_l(n_l * N * P + batch * (K - n_l) * S) + the block tables."""
        layout, N = self.layout, self.pool_pages(batch)
        per_layer = sum(
            n * N * self.page_size + batch * (layout.num_kv_heads - n) * layout.streaming_slots
            for n in layout.num_retrieval
        )
        return 2 * layout.head_dim * bytes_per_elem * per_layer + 4 * batch * self.pages_per_sequence

    def stats(self) -> dict:
        return dict(DuoAttention(self.layout).stats(), page_size=self.page_size, num_pages=self.num_pages)

    def state(self):
        return self.layout.window_state()  # the streaming window, where it is data (`CacheLayout.ring_slots`)

    def begin_step(self, step: Step) -> DuoShared:
        return DuoAttention(self.layout).begin_step(step)

    def attend(self, layer, q, k, v, view: PagedLayerView, step: Step, shared: DuoShared):
        cache, tables = view.layer, view.block_tables
        q, k = apply_rotary(q, step.rope), apply_rotary(k, step.rope)
        duo = DuoAttention(self.layout)
        served = duo.decode_in_one_kernel(
            layer,
            q,
            k,
            v,
            PagedKV(cache.pages_k, tables),
            PagedKV(cache.pages_v, tables),
            cache.streaming_k,
            cache.streaming_v,
            step,
            shared,
        )
        if served is not None:  # one launch: both partitions, the new token written into its page and the ring
            out, sk, sv, pk, pv = served
            return out, PagedLayerCache(pk, pv, sk, sv)
        (kr, ks), (vr, vs) = (split_heads(self.layout, layer, x) for x in (k, v))
        n = self.layout.num_retrieval[layer]
        pk, pv = cache.pages_k, cache.pages_v
        if n:
            pk = write_pages(pk, tables, step.positions, step.valid, kr)
            pv = write_pages(pv, tables, step.positions, step.valid, vr)
        rk, rv = PagedKV(pk, tables), PagedKV(pv, tables)
        out, sk, sv = duo.attend_partitions(
            layer,
            q,
            ks,
            vs,
            lambda qr: retrieval_attention(qr, rk, rv, step) if n else qr,
            cache.streaming_k,
            cache.streaming_v,
            step,
            shared,
        )
        return out, PagedLayerCache(pk, pv, sk, sv)


def paged(method: Method, *, page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None) -> PagedDuo:
    """`method` ("full" or "duo", a `DuoAttention`) with its retrieval partition in pages of `page_size`
    tokens, `num_pages` per layer pool (None: every sequence its own pages). The capacity (tokens per sequence
    at most) is the method's, rounded up to whole pages."""
    if not isinstance(method, DuoAttention):
        raise DuoJaxError(f"only full attention and duo have a paged cache; {method.name!r} keeps its contiguous cache")
    page_size = check_number("page_size", page_size, integer=True, minimum=1, hint=" (tokens per page)")
    if num_pages is not None:
        num_pages = check_number("num_pages", num_pages, integer=True, minimum=1, hint=" (pages per layer pool)")
    if method.layout.kv_dtype is not None:
        raise DuoJaxError(
            f"a paged cache of {method.layout.kv_dtype} KV is not supported yet: build the method "
            "with kv_dtype=None to page it"
        )
    if method.streaming_chunk is not None:
        raise DuoJaxError(
            "a paged cache takes no streaming_chunk: its prefill chunks are the scheduler's own; build the method "
            "with streaming_chunk=None to page it"
        )
    capacity = -(-method.layout.capacity // page_size) * page_size
    return PagedDuo(dataclasses.replace(method.layout, capacity=capacity), page_size, num_pages)


__all__ = ["PagedCache", "PagedDuo", "PagedLayerCache", "gather_pages", "paged", "write_pages"]

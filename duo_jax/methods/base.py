"""The interface every KV-cache method implements (`Method`), and the per-step context the engine hands it (`Step`).

A method decides how its cache is laid out (`init_cache`) and what attention reads from it and keeps of it as
tokens arrive (`attend`, which returns the updated cache). The engine (`duo_jax.engine.extend`) owns everything
else: embeddings, projections, norms, MLPs, the LM head and the loop over layers. docs/adding-a-method.md walks
through one method end to end.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.attention import MaskSpec
from duo_jax.errors import DuoJaxError
from duo_jax.quant import QuantizedKV, as_stored, kv_rotation, rotate
from pallas_kernels._backend import on_gpu

if TYPE_CHECKING:
    from duo_jax.config import ModelConfig
    from duo_jax.model import LayerParams

LayerCache = Any  # a pytree of arrays, one per layer; its shape is the method's business


@dataclasses.dataclass(frozen=True)
class Step:
    """What every layer of one `extend` call shares. Built inside the jitted step."""

    positions: jax.Array  # int32 [B, T]: absolute positions of the new tokens (lengths[b] + t)
    valid: jax.Array  # bool [B, T]: real tokens; False marks padding (ragged batches, the last chunk)
    lengths: jax.Array  # int32 [B]: tokens cached before this call
    new_lengths: jax.Array  # int32 [B]: lengths + real new tokens
    inv_freq: np.ndarray  # RoPE inverse frequencies [E/2] (static)
    rope: Any  # `duo_jax.model.Rotary` at `positions`: the new tokens' RoPE table, built once for every layer
    impl: str  # attention implementation for the dispatch (`duo_jax.attention.IMPLS`)
    # The sliding window of the layer being attended (static; `ModelConfig.layer_window`): the engine hands
    # each layer's `attend` its own copy of the step with it set, `begin_step` gets the step without one.
    # Every method honours it: its attention goes through `prefix_spec`, `positions_spec` or `sees`.
    sliding_window: int | None = None
    state: Any = None  # the method's arrays (`Method.state()`), traced: read them here, never from the method
    mesh: Any = None  # the generation mesh (`duo_jax.sharding.make_generation_mesh`) the step runs on, or None

    @property
    def is_decode(self) -> bool:
        return self.positions.shape[1] == 1

    def prefix_spec(self) -> MaskSpec:
        """The new tokens over a contiguous cache (slot = position) that already holds them: causal, within
        the model's sliding window."""
        return MaskSpec(self.positions, self.new_lengths, window=self.sliding_window)

    def positions_spec(self, key_positions: jax.Array, own_keys_at: int | None = None) -> MaskSpec:
        """The new tokens over keys at explicit positions [B, S] (-1: empty), e.g. a ring of cached tokens
        followed by the chunk (`own_keys_at`: the ring's size; `MaskSpec.own_keys_at`): causal, within the
        sliding window."""
        num_keys = jnp.full(key_positions.shape[:1], key_positions.shape[1], jnp.int32)
        return MaskSpec(self.positions, num_keys, key_positions, window=self.sliding_window, own_keys_at=own_keys_at)

    def sees(self, key_positions: jax.Array, query_positions: jax.Array | None = None) -> jax.Array:
        """Which keys each new token sees, for the methods that score keys with a materialised mask
        (`duo_jax.attention.probs`): key_positions int32 [B, ..., S] (-1: empty; e.g. per KV head [B, K, S])
        -> bool [B, ..., T, S]: filled, causal, and within this layer's sliding window (`MaskSpec.visible`).
        query_positions [B, T'] asks it for those queries instead of the step's (a block of them)."""
        query_positions = self.positions if query_positions is None else query_positions
        B, T = query_positions.shape
        extra = (1,) * (key_positions.ndim - 2)
        keys = key_positions[..., None, :]
        return self.prefix_spec().visible(query_positions.reshape((B,) + extra + (T, 1)), keys, keys >= 0)

    def still_visible(self, key_positions: jax.Array) -> jax.Array:
        """Which cached tokens a later query can still see: `within_future_window` after this step."""
        return within_future_window(key_positions, self.new_lengths, self.sliding_window)


def within_future_window(key_positions: jax.Array, lengths: jax.Array, window: int | None) -> jax.Array:
    """bool, the shape of key_positions [B, ...] (-1: empty): whether the token can still be attended once
    `lengths` [B] tokens are cached. The next query sits at position lengths and later ones further on, so on
    a layer with a sliding `window` (query p sees keys p - window < j <= p) a token at j <= lengths - window is
    out of every future query's window: a method that evicts or selects tokens drops it first and never counts
    it as kept. Without a window every filled slot stays visible."""
    filled = key_positions >= 0
    if window is None:
        return filled
    return filled & (key_positions > lengths.reshape(lengths.shape + (1,) * (key_positions.ndim - 1)) - window)


def check_windows(method: Method, windows: tuple[int | None, ...] | None, layer: int, step: Step) -> None:
    """DuoJaxError unless the sliding window the engine gives layer `layer` is the one `method` was built for
    (`windows`, from `ModelConfig.layer_windows`; None: no window anywhere): SnapKV's compression after prefill,
    outside the layer loop, selects within the windows it keeps; H2O / TOVA size each layer's cache by it."""
    own = None if windows is None else windows[layer]
    if own != step.sliding_window:
        raise DuoJaxError(
            f"method {method.name!r} was built for sliding window {own} on layer {layer} but the "
            f"model has {step.sliding_window}: build it with this model's config (make_method)"
        )


class Method(abc.ABC):
    """Base class of KV-cache methods.

    A method is a frozen dataclass: hashable, so it is a static argument of the jitted step and its fields
    (windows, budgets, layouts) are compile-time constants; its arrays go in `state()`, an argument of the step.

    A method must write (abstract):
      init_cache            an empty cache: one pytree per layer
      attend                one layer's attention over the new tokens, and that layer's updated cache
      expected_cache_bytes  the cache's size by formula (tests check it against the arrays)
    and set the class attribute `name`. Everything else has a default:
      state                 the method's arrays (None)
      cache_spec            `init_cache`'s shapes, without allocating (`jax.eval_shape` of it)
      cache_partition       the cache's layout on a generation mesh (None: no mesh)
      layer_caches / with_layer_caches   per-layer views of the step's cache (the cache is the per-layer tuple)
      begin_step            values all layers of a step share (None)
      prepare               extra keyword arguments for one layer's `attend` ({})
      max_tokens            tokens per sequence the cache holds (the `capacity` field, else None: unbounded)
      room_after_prompt     tokens per sequence it holds after the prompt, where bounded apart (None)
      decode_method         the method decoding continues with, from the longest prefill (itself)
      after_prefill         that method and the cache it decodes over (unchanged)
      stats                 what `generate` reports of the method ({})
      take_row / put_row    one sequence's part of a batched cache, for the server's continuous batching
                            (raise `DuoJaxError`: only the paged methods implement them)
      absolute_positions    True: positions are absolute, so a sequence cannot outgrow the model's context
    """

    name = "method"
    absolute_positions = True  # positions are absolute: a sequence cannot outgrow the model's context

    def state(self) -> Any:
        """The method's arrays (e.g. InfiniGen's skew matrices): a pytree the engine passes into the compiled
        step as an argument (`Step.state`), so methods that differ only in these arrays share executables.
        The method object itself is the static spec (its hash and equality ignore the state). Default: None."""
        return None

    @abc.abstractmethod
    def init_cache(self, batch: int, dtype) -> tuple[LayerCache, ...]:
        """An empty cache: one pytree per layer."""

    def cache_spec(self, batch: int, dtype) -> tuple:
        """`init_cache`'s arrays as `jax.ShapeDtypeStruct`s, without allocating them: what a step is compiled
        for. A method that places arrays in another memory kind (host offload) adds their shardings."""
        return jax.eval_shape(lambda: self.init_cache(batch, dtype))

    def cache_partition(self) -> tuple | None:
        """How the cache is laid out on a generation mesh: its pytree with a `PartitionSpec` per array (axes
        `duo_jax.sharding.DATA` / `MODEL`), attended accordingly when `Step.mesh` is set. Default None: the
        method does not run on a mesh (the engine refuses it with an error)."""
        return None

    def layer_caches(self, cache) -> tuple:
        """What each layer's `attend` gets, indexed by layer, out of the step's cache. Default: the cache is that
        tuple. A cache with arrays all layers share (a paged cache's block tables) hands out per-layer views."""
        return cache

    def with_layer_caches(self, cache, layers: tuple) -> Any:
        """The step's cache with the layers' updated caches (what `attend` returned): `layer_caches`' inverse."""
        return layers

    def begin_step(self, step: Step) -> Any:
        """Values all layers of one step share (masks, write slots). Default: nothing."""
        return None

    def prepare(
        self,
        layer: int,
        q: jax.Array,
        previous_input: jax.Array | None,
        weights: LayerParams,
        config: ModelConfig,
        step: Step,
    ) -> dict:
        """The per-layer hook: extra keyword arguments for this layer's `attend`, computed by the engine just
        before it from what the layer loop has in hand: the layer's query q [B, T, H, E] (before RoPE), the
        previous layer's normed attention input [B, T, D] (None at layer 0), this layer's weights (project
        with `duo_jax.model.project_qkv`) and the model's config. Default: nothing (InfiniGen projects the
        previous layer's input with this layer's query weights, to speculate one layer ahead)."""
        return {}

    @abc.abstractmethod
    def attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, cache: LayerCache, step: Step, shared: Any
    ) -> tuple[jax.Array, LayerCache]:
        """Attention of the new tokens for one layer, and that layer's updated cache.

        q [B, T, H, E], k / v [B, T, K, E] before RoPE (a method rotates them where it needs to).
        Returns the attention output [B, T, H, E] (before the output projection) and the new layer cache.
        """

    @property
    def max_tokens(self) -> int | None:
        """Tokens per sequence the cache can hold (prompt + generated); None when unbounded (a ring)."""
        return getattr(self, "capacity", None)

    @property
    def room_after_prompt(self) -> int | None:
        """Tokens per sequence the cache holds after the prompt where that is bounded apart from `max_tokens` (SnapKV's
        `room`: its compressed cache's slots for the new tokens); None: no such bound."""
        return None

    def decode_method(self, longest: int, lengths: Sequence[int] = ()) -> Method:
        """The method decoding continues with after a prefill whose longest sequence holds `longest` tokens, and
        whose rows hold `lengths` (where a method's shape follows each row's: PyramidKV), (a method that compresses
        its cache after prefill, like SnapKV, returns its smaller form), known before the prefill runs, so that
        its steps can be compiled first. Default: this method."""
        return self

    def after_prefill(self, cache: tuple[LayerCache, ...], lengths: jax.Array) -> tuple[Method, tuple]:
        """Called once between prefill and decode: `decode_method` and the cache it decodes over. Default:
        unchanged."""
        return self, cache

    def stats(self) -> dict:
        """What `generate` reports of this method besides the common figures (e.g. DuoAttention's head split)."""
        return {}

    @abc.abstractmethod
    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        """The cache's size by formula (tests check it against the arrays)."""

    def take_row(self, cache, row: jax.Array):
        """Sequence `row`'s cache at batch 1 (row an int32 scalar, may be traced), which `extend` can step: how
        the server's scheduler prefills one sequence while the batch's other rows wait
        (`duo_jax.engine.extend_row`). Default: the method cannot run one row of a batched cache (DuoJaxError)."""
        raise _no_rows(self)

    def put_row(self, cache, row: jax.Array, part):
        """`cache` with sequence `row` replaced by `part` (a `take_row` after a step): `take_row`'s inverse.
        Default: DuoJaxError, as `take_row`."""
        raise _no_rows(self)


def _no_rows(method: Method) -> DuoJaxError:
    return DuoJaxError(
        f"{method.name!r} cannot run one row of a batched cache (no take_row / put_row; the "
        "paged methods can: duo_jax.methods.paged)"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class KVRotation:
    """How a quantized cache stores keys and values: through the orthonormal `duo_jax.quant.kv_rotation` R
    (k R, v R), which spreads outlier channels before quantizing. Attention is unchanged when the queries are
    rotated alike and the output rotated back: (q R)(k R)^T = q k^T, (p v R) R^T = p v. Without a quantized
    cache (`matrix` None) both directions are the identity. Build it with `kv_rotation_for`."""

    matrix: np.ndarray | None  # R [E, E]; None: no rotation

    def into(self, *xs: jax.Array) -> tuple[jax.Array, ...]:
        """Each x [..., E] in the stored basis: x R (the arrays unchanged without a rotation)."""
        return xs if self.matrix is None else tuple(rotate(x, self.matrix) for x in xs)

    def back(self, x: jax.Array) -> jax.Array:
        """x [..., E] back from the stored basis: x R^T (x unchanged without a rotation)."""
        return x if self.matrix is None else rotate(x, self.matrix.T)


def kv_rotation_for(kv_dtype: str | None, head_dim: int) -> KVRotation:
    """The rotation a cache of `kv_dtype` (None: the model's dtype, not rotated) stores keys and values through."""
    return KVRotation(None if kv_dtype is None else kv_rotation(head_dim))


def cache_nbytes(cache) -> int:
    """Bytes held by a cache: the sum of its arrays' sizes."""
    return int(sum(x.nbytes for x in jax.tree.leaves(cache)))


def concat_slots(cache, new: jax.Array):
    """Cache slots [B, S, N, E] followed by new keys or values [B, T, N, E] in the cache's form (quantized
    when it is): [B, S + T, N, E]."""
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), cache, as_stored(new, cache))


def write_slots(cache, slots: jax.Array, new: jax.Array):
    """cache [B, S, N, E] with new [B, T, N, E] written at slots [B, T]; out-of-range slots are dropped.
    A quantized cache (`duo_jax.quant.QuantizedKV`) quantizes `new` and writes its codes and scales.

    16-bit floats are scattered as their bits: XLA:CPU computes a bf16 scatter in f32, converting the whole
    cache there and back on every write (temporary memory grows with the capacity)."""
    if isinstance(cache, QuantizedKV):
        new = as_stored(new, cache)
        return jax.tree.map(lambda c, n: write_slots(c, slots, n), cache, new)
    new = new.astype(cache.dtype)
    # Per sequence, under vmap: the scatter's batch dimension is one XLA knows, so a batch split over devices
    # stays local (explicit batch indices made GSPMD gather the updates across the `data` axis).
    write = jax.vmap(lambda c, s, n: c.at[s].set(n, mode="drop"))
    if cache.dtype.itemsize != 2 or not jnp.issubdtype(cache.dtype, jnp.floating):
        return write(cache, slots, new)
    bits = jax.lax.bitcast_convert_type
    return bits(write(bits(cache, jnp.uint16), slots, bits(new, jnp.uint16)), cache.dtype)


def write_run(cache, start: jax.Array, new: jax.Array, n_valid: jax.Array):
    """cache [B, S, N, E] with new[b, :n_valid[b]] [B, T, N, E] written at slots start[b], start[b] + 1, ...:
    `write_slots` for slots that follow each other (a contiguous cache's positions), the other slots untouched
    and slots past S dropped alike.

    Each sequence reads the T-slot window it writes into, merges the new tokens in, and writes the window back
    with a `dynamic_update_slice`, which XLA updates in place whatever the dtype; XLA:CPU's bf16 scatter (even
    as uint16 bits) makes a cache-sized copy per layer (temporary memory grows with the capacity).
    For T > S it falls back to `write_slots`, and so does a batched decode step on a GPU: one scatter of a token
    per sequence, in place, where a window per sequence would be B launches of their own."""
    if isinstance(cache, QuantizedKV):
        new = as_stored(new, cache)
        return jax.tree.map(lambda c, n: write_run(c, start, n, n_valid), cache, new)
    B, T = new.shape[:2]
    S = cache.shape[1]
    if T == 1 and B > 1 and on_gpu():
        return write_slots(cache, jnp.where(n_valid > 0, start, S)[:, None], new)
    if T > S:
        slots = start[:, None] + jnp.arange(T, dtype=jnp.int32)
        return write_slots(cache, jnp.where(jnp.arange(T)[None, :] < n_valid[:, None], slots, S), new)
    new = new.astype(cache.dtype)
    half = cache.dtype.itemsize == 2 and jnp.issubdtype(cache.dtype, jnp.floating)
    bits = jax.lax.bitcast_convert_type
    first = jnp.clip(start, 0, S - T)  # the window [first, first + T) stays in bounds and holds slot start
    tail = (0,) * (cache.ndim - 2)
    for b in range(B):  # one in-place update per sequence (a vmapped one would be a scatter again)
        j = first[b] + jnp.arange(T, dtype=jnp.int32) - start[b]  # index into new of each window slot
        take = ((j >= 0) & (j < n_valid[b])).reshape((T,) + (1,) * (cache.ndim - 2))
        old = jax.lax.dynamic_slice(cache, (b, first[b]) + tail, (1, T) + cache.shape[2:])[0]
        fresh = jnp.take(new[b], jnp.clip(j, 0, T - 1), axis=0)
        if half:  # merged as bits: XLA:CPU would compute a 16-bit float select in f32 over the whole cache
            window = bits(jnp.where(take, bits(fresh, jnp.uint16), bits(old, jnp.uint16)), cache.dtype)
        else:
            window = jnp.where(take, fresh, old)
        cache = jax.lax.dynamic_update_slice(cache, window[None], (b, first[b]) + tail)
    return cache

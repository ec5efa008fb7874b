"""DuoAttention's split KV cache: a retrieval partition (every token) and a streaming partition (sinks + ring).

Per layer l with n_l retrieval heads out of K (`CacheLayout.kv_order[l]` lists them first, then the streaming
heads, each group in the model's order), `init_cache` builds

  retrieval_k[l], retrieval_v[l]: [B, C, n_l, E]            token at position p in slot p (C = capacity)
  streaming_k[l], streaming_v[l]: [B, S, K - n_l, E]                     S = sink + recent, or `ring_slots`
      slots [0, sink): the first `sink` tokens (attention sinks)
      slots [sink, sink + recent): a ring buffer, token at position p >= sink in slot sink + (p - sink) % recent
      (sink + recent <= C: `make_layout` narrows a wider window, which would hold every token anyway)
      slots [sink + recent, S): never written (a ring of `ring_slots`, the window then runtime data)

Keys are cached after RoPE at their absolute positions; C is a multiple of `CAPACITY_BLOCK`; how many tokens each
sequence holds lives outside the cache, in `lengths` [B]. With `kv_dtype` "int8" / "int4" each array is a
`duo_jax.quant.QuantizedKV` of the same logical shape. Design: docs/engine.md, "The DuoAttention cache".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.quant import check_kv_dtype, kv_bytes_per_vector, kv_zeros

CAPACITY_BLOCK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Window:
    """A streaming window as data (`WindowAsData`): its sinks and recent tokens, int32 scalars."""

    sink: jax.Array
    recent: jax.Array


class StaticSpec:
    """Mixin of a frozen dataclass (eq=False) that is a static argument of compiled steps while some of its fields
    may be runtime data, passed into the steps as arrays (the method's state, `Method.state`, or SnapKV's
    compression counts): equality and hash ignore the fields `_data_fields` names, so objects that differ only in
    them share compiled steps."""

    def _data_fields(self) -> tuple[str, ...]:
        """The fields that are runtime data (none by default)."""
        return ()

    def _key(self) -> tuple:
        skip = self._data_fields()
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip)

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))


def runtime_state(state, kind: type, owner: str, option: str, what: str):
    """`state` (a step's `Step.state`) where it is the `kind` of runtime data a method built with `option` reads,
    else a DuoJaxError saying how to pass it: the method's `what` is runtime data, not compiled in."""
    if not isinstance(state, kind):
        raise DuoJaxError(
            f"this {owner} has {option}: its {what} is runtime data, passed as the method's state; call extend / "
            "decode with state=method.state() (the engine and generate do)"
        )
    return state


def check_slots(name: str, slots, least: int, holds: str) -> int:
    """`slots` (the field sizing what runtime data fills) as an int >= `least`, the value of the fields `holds`
    names, else a DuoJaxError naming both: fewer slots would drop tokens silently."""
    if isinstance(slots, (bool, np.bool_)) or not isinstance(slots, (int, np.integer)) or slots < least:
        raise DuoJaxError(
            f"{name} must be an integer >= {holds} = {least} (the tokens it holds), got {slots!r}: raise {name} or "
            f"lower {holds}"
        )
    return int(slots)


class WindowAsData(StaticSpec):
    """Mixin of a frozen dataclass (eq=False) that holds a streaming window, sinks + a ring of recent tokens, in the
    two fields `_window_fields` names, and `ring_slots`. Without `ring_slots` the window is compiled into the steps
    and the ring holds sink + recent slots. With it the ring holds that many slots (>= sink + recent) and the window
    is runtime data: the method's state (`window_state`, passed as `Method.state`), read inside a step by
    `window_of`; equality and hash then ignore the window (`StaticSpec`), so objects that differ only in their
    windows share compiled steps."""

    _window_fields: tuple[str, str] = ("sink", "recent")

    def __post_init__(self):
        """`ring_slots` checked however the object was built (a builder, a constructor, `dataclasses.replace`): an
        integer >= sink + recent, or None. A smaller ring would drop tokens silently."""
        if self.ring_slots is not None:
            holds = " + ".join(self._window_fields)
            object.__setattr__(self, "ring_slots", check_slots("ring_slots", self.ring_slots, sum(self._window), holds))

    @property
    def _window(self) -> tuple:
        """(sink, recent) as the object holds them."""
        return tuple(getattr(self, name) for name in self._window_fields)

    def _data_fields(self) -> tuple[str, ...]:
        return self._window_fields if self.ring_slots is not None else ()

    @property
    def window_slots(self) -> int:
        """The ring's slots: sink + recent, or `ring_slots`."""
        return sum(self._window) if self.ring_slots is None else self.ring_slots

    def window_state(self) -> Window | None:
        """The window as the method's state where it is data (`ring_slots`), else None."""
        if self.ring_slots is None:
            return None
        return Window(*map(np.int32, self._window))

    def window_of(self, state) -> tuple:
        """(sink, recent) inside a step: the object's own, compiled in, or with `ring_slots` the step's state (traced
        scalars; `state` is `Step.state`, which the engine fills with `Method.state()`)."""
        if self.ring_slots is None:
            return self._window
        window = runtime_state(state, Window, type(self).__name__, "ring_slots", "window")
        return window.sink, window.recent


@dataclasses.dataclass(frozen=True, eq=False)
class CacheLayout(WindowAsData):
    """The static shape of a split cache (hashable: a jit static argument); its streaming window compiled in, or
    with `ring_slots` runtime data (`WindowAsData`)."""

    num_retrieval: tuple[int, ...]  # retrieval KV heads per layer (first in `kv_order`)
    num_kv_heads: int
    head_dim: int
    sink: int
    recent: int
    capacity: int  # retrieval slots per head
    # Per layer, the KV heads in cache order: the layer's retrieval heads, then its streaming heads (each in the
    # model's order). None: the model's order (every head retrieval, or a pattern that needs no reordering).
    kv_order: tuple[tuple[int, ...], ...] | None = None
    kv_dtype: str | None = None  # None: the model's dtype; "int8" / "int4": quantized (`duo_jax.quant`)
    ring_slots: int | None = None  # the streaming ring's slots when the window is data (>= sink + recent)

    @property
    def num_layers(self) -> int:
        return len(self.num_retrieval)

    @property
    def every_head_retrieval(self) -> bool:
        """Whether every layer keeps all its KV heads whole: full attention."""
        return all(n == self.num_kv_heads for n in self.num_retrieval)

    @property
    def streaming_slots(self) -> int:
        """The ring's slots per streaming head (S)."""
        return self.window_slots

    @property
    def retrieval_mask(self) -> np.ndarray:
        """bool [L, K]: which KV heads of each layer are retrieval heads."""
        mask = np.zeros((self.num_layers, self.num_kv_heads), bool)
        for l, n in enumerate(self.num_retrieval):
            mask[l, list(self.kv_order[l][:n]) if self.kv_order is not None else slice(0, n)] = True
        return mask


def round_capacity(tokens: int) -> int:
    """The retrieval capacity for a context of `tokens`: rounded up to a multiple of `CAPACITY_BLOCK`."""
    return -(-tokens // CAPACITY_BLOCK) * CAPACITY_BLOCK


def half_octave_bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x powers of two) >= n: a few sizes
    per octave, none more than half again n."""
    n = max(n, 1)
    power = 1 << (n - 1).bit_length()  # the next power of two >= n
    return 3 * power // 4 if power >= 4 and 3 * power // 4 >= n else power


def capacity_bucket(tokens: int, block: int = CAPACITY_BLOCK) -> int:
    """The default cache capacity for `tokens`: the smallest of block * {1, 2, 3, 4, 6, 8, 12, 16, 24, ...}
    (`half_octave_bucket`) that holds them, so varied requests share a few cache shapes while reserving at most
    half again their need counted in blocks (pass `context=` to reserve exactly what you ask for)."""
    return half_octave_bucket(-(-max(tokens, 1) // block)) * block


def capacity_bucket_range(tokens: int, block: int = CAPACITY_BLOCK) -> tuple[int, int]:
    """(lo, hi): the fewest and the most tokens whose `capacity_bucket` is that of `tokens` (hi is the bucket)."""
    hi = capacity_bucket(tokens, block)
    below = 0  # the bucket under hi, in blocks
    while half_octave_bucket(below + 1) * block < hi:
        below = half_octave_bucket(below + 1)
    return below * block + 1, hi


def make_layout(
    config: ModelConfig,
    retrieval_mask: np.ndarray | None,
    *,
    sink: int,
    recent: int,
    context: int,
    kv_dtype: str | None = None,
    ring_slots: int | None = None,
) -> CacheLayout:
    """Layout for a [layers, kv_heads] retrieval mask (None: every head is a retrieval head). `ring_slots`: the
    streaming ring's slots, at least sink + recent, the window then runtime data (`CacheLayout`); None: sink + recent.

    A window wider than the capacity (sink + recent > C) is narrowed to C slots: no position reaches sink + recent,
    so a streaming head sees every earlier token under either window, and a ring of C slots holds them all in
    position order. The streaming heads then never take more memory than the retrieval heads."""
    if sink < 0 or recent < 0:
        raise DuoJaxError(f"sink and recent must be >= 0, got sink={sink}, recent={recent}")
    capacity = round_capacity(context)
    if sink + recent > capacity:
        sink = min(sink, capacity - 1)
        recent = capacity - sink
    if retrieval_mask is None:
        num_retrieval, kv_order = (config.num_kv_heads,) * config.num_layers, None
    else:
        mask = np.asarray(retrieval_mask, bool)
        num_retrieval = tuple(int(n) for n in mask.sum(axis=1))
        order = np.stack([np.concatenate([np.flatnonzero(m), np.flatnonzero(~m)]) for m in mask])
        kv_order = None if (order == np.arange(mask.shape[1])).all() else tuple(map(tuple, order.tolist()))
        if recent < 1 and not mask.all():
            raise DuoJaxError(f"streaming heads need recent >= 1 (a ring of the newest tokens), got recent={recent}")
    return CacheLayout(
        num_retrieval,
        config.num_kv_heads,
        config.head_dim,
        sink,
        recent,
        capacity,
        kv_order,
        check_kv_dtype(kv_dtype),
        ring_slots,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DuoLayerCache:
    """One layer's K/V arrays of both partitions."""

    retrieval_k: jax.Array  # [B, C, n_l, E] (or a QuantizedKV of that shape)
    retrieval_v: jax.Array
    streaming_k: jax.Array  # [B, S, K - n_l, E]: S = sink + recent, or the layout's ring_slots
    streaming_v: jax.Array


def init_cache(layout: CacheLayout, batch: int, dtype) -> tuple[DuoLayerCache, ...]:
    """An empty cache (zeros) for `batch` sequences: one `DuoLayerCache` per layer (`dtype`: the model's)."""
    E = layout.head_dim

    def zeros(slots, heads):
        if layout.kv_dtype is not None:
            return kv_zeros((batch, slots, heads, E), layout.kv_dtype, dtype)
        return jnp.zeros((batch, slots, heads, E), dtype)

    return tuple(
        DuoLayerCache(
            zeros(layout.capacity, n),
            zeros(layout.capacity, n),
            zeros(layout.streaming_slots, layout.num_kv_heads - n),
            zeros(layout.streaming_slots, layout.num_kv_heads - n),
        )
        for n in layout.num_retrieval
    )


def expected_cache_bytes(layout: CacheLayout, batch: int, bytes_per_elem: int) -> int:
    """batch * 2 * v * sum_l(n_l * capacity + (K - n_l) * (sink + recent)), v the bytes of one head's key:
    E * bytes_per_elem (the model's dtype), E + 2 (int8 codes + bf16 scale) or E / 2 + 2 (int4)."""
    per_layer = sum(
        n * layout.capacity + (layout.num_kv_heads - n) * layout.streaming_slots for n in layout.num_retrieval
    )
    return batch * 2 * kv_bytes_per_vector(layout.head_dim, layout.kv_dtype, bytes_per_elem) * per_layer


def full_cache_bytes(config: ModelConfig, batch: int, context: int, bytes_per_elem: int) -> int:
    """What a full-attention cache of the same capacity would take in the model's dtype, unquantized: the reference
    a (possibly quantized) cache's bytes are compared with, so a ratio counts the quantization too."""
    return batch * round_capacity(context) * config.kv_bytes_per_token(bytes_per_elem)


# --- streaming slots ---------------------------------------------------------------------------------


def streaming_slot_positions(lengths: jax.Array, sink, recent, slots: int | None = None) -> jax.Array:
    """Absolute position held by each streaming slot after `lengths` [B] tokens; -1 where empty. -> [B, S]:
    S = `slots` (static; default sink + recent, which are then ints), sink and recent ints or traced scalars."""
    slots = sink + recent if slots is None else slots
    n = lengths[:, None]
    s = jnp.arange(slots)[None, :]
    j = s - sink  # the ring's slot j holds the newest position p < n with p >= sink and (p - sink) % recent == j
    newest = n - 1 - sink - j  # >= 0 iff ring slot j has been written
    ring_pos = sink + j + recent * jnp.floor_divide(jnp.maximum(newest, 0), jnp.maximum(recent, 1))
    ring_pos = jnp.where((newest >= 0) & (j < recent), ring_pos, -1)
    return jnp.where(s < sink, jnp.where(s < n, s, -1), ring_pos).astype(jnp.int32)


def ring_slot(positions: jax.Array, sink, recent) -> jax.Array:
    """The streaming slot of a token at each of `positions`: its own for a sink, else its place in the ring."""
    return jnp.where(positions < sink, positions, sink + (positions - sink) % jnp.maximum(recent, 1))


def streaming_write_slots(
    positions: jax.Array, valid: jax.Array, new_lengths: jax.Array, sink, recent, slots: int | None = None
) -> jax.Array:
    """Slot for each new token at `positions` [B, T] in the streaming partition of `slots` slots (default sink +
    recent), or `slots` (out of range: dropped on write) for padding and for tokens already pushed out of the ring
    by later ones in the chunk."""
    keep = valid & ((positions < sink) | (positions >= new_lengths[:, None] - recent))
    return jnp.where(keep, ring_slot(positions, sink, recent), sink + recent if slots is None else slots)

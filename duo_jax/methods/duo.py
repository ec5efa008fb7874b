"""DuoAttention: retrieval heads keep every token, streaming heads keep sinks + recent tokens.

The split cache is `duo_jax.cache`; each layer's heads are split into its retrieval and streaming groups on
the activations (`cache_order`, `split_heads`; the one-launch decode and prefill kernels route them themselves), so
the weights are used as loaded. For T new tokens per sequence:

  retrieval heads: keys written to the full cache, attention over every cached token up to the query;
  streaming heads: attention over the streaming cache (sinks + the last `recent` tokens before the chunk)
                   plus the chunk itself (causal), then the chunk is folded into the ring buffer.

So a query at position i in a chunk that starts at position c sees, on a streaming head, key j iff
j <= i and (j < sink or j >= c - recent). Decode is the chunk of one token (c = i): sinks, the last
`recent` tokens and itself. Prefill of a streaming head costs O(T * (sink + recent + chunk)), and its cache
never holds more than sink + recent tokens. Full attention is this method with every head a retrieval head.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from duo_jax import attention, sharding
from duo_jax.cache import (
    CacheLayout,
    DuoLayerCache,
    expected_cache_bytes,
    init_cache,
    make_layout,
    ring_slot,
    round_capacity,
    streaming_slot_positions,
    streaming_write_slots,
)
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step, concat_slots, kv_rotation_for, write_run, write_slots
from duo_jax.methods.registry import register
from duo_jax.model import apply_rotary
from duo_jax.pattern import DEFAULT_SPARSITY, Pattern, resolve_pattern
from duo_jax.quant import as_stored
from duo_jax.sampling import check_number


def cache_order(layout: CacheLayout, layer: int, x: jax.Array) -> jax.Array:
    """x [B, T, N, E] over heads (KV heads, or query heads in groups of N / K) -> the same heads in the caches'
    order: the layer's retrieval heads first, then its streaming heads, each in the model's order. The weights
    stay as loaded: heads are picked from the activations (a few KB per token), so every method shares one copy
    of the weights."""
    if _in_model_order(layout, layer):
        return x
    return jnp.take(x, _head_index(layout.kv_order[layer], x.shape[2] // layout.num_kv_heads), axis=2)


def model_order(layout: CacheLayout, layer: int, x: jax.Array) -> jax.Array:
    """`cache_order`'s inverse: outputs [B, T, N, E] back in the model's head order."""
    if _in_model_order(layout, layer):
        return x
    index = _head_index(layout.kv_order[layer], x.shape[2] // layout.num_kv_heads)
    return jnp.take(x, np.argsort(index), axis=2)


def partition(layout: CacheLayout, layer: int, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, N, E] over heads in the caches' order (`cache_order`) -> (the layer's retrieval heads, its
    streaming heads)."""
    n = layout.num_retrieval[layer] * (x.shape[2] // layout.num_kv_heads)
    return x[:, :, :n], x[:, :, n:]


def split_heads(layout: CacheLayout, layer: int, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, N, E] over heads -> (the layer's retrieval heads, its streaming heads), each in the model's order."""
    return partition(layout, layer, cache_order(layout, layer, x))


def merge_heads(layout: CacheLayout, layer: int, retrieval: jax.Array, streaming: jax.Array) -> jax.Array:
    """`split_heads`' inverse: the two groups' outputs [B, T, *, E] back in the model's head order."""
    return model_order(layout, layer, jnp.concatenate([retrieval, streaming], axis=2))


def _in_model_order(layout: CacheLayout, layer: int) -> bool:
    """Whether the layer's caches hold its heads in the model's order (one kind of head, or the retrieval heads
    the lowest-numbered): then no head is reordered."""
    return layout.kv_order is None or layout.kv_order[layer] == tuple(range(layout.num_kv_heads))


def _head_index(kv_order: tuple[int, ...], group: int) -> np.ndarray:
    """Head indices (static) of the KV heads in `kv_order`, each with its `group` query heads."""
    return (np.asarray(kv_order)[:, None] * group + np.arange(group)).reshape(-1)


def retrieval_attention(q, k, v, step: Step) -> jax.Array:
    """Query t (position lengths + t) sees every cached key up to its own position (within the model's
    sliding window). q [B, T, H_r, E], k / v the full cache [B, C, K_r, E] with this chunk already written."""
    return attention.attend(q, k, v, step.prefix_spec(), impl=step.impl)


def sharded_retrieval_attention(q, k, v, cache_k, cache_v, step: Step):
    """Retrieval heads on a generation mesh (`duo_jax.sharding`'s docstring says why this split): the cache
    [B, C, n, E] split along C over `model` (device i holds positions [i C / m, (i + 1) C / m)) and by batch over
    `data`. Each device writes the chunk's tokens k / v [B, T, n, E] that fall into its slots, attends the
    queries q [B, T, n G, E] to its keys, and the partials are merged across `model`. Returns (output, cache_k,
    cache_v) as `write_slots` + `retrieval_attention` would."""

    def local(q, k, v, cache_k, cache_v, positions, valid, new_lengths):
        size = cache_k.shape[1]
        offset = jax.lax.axis_index(sharding.MODEL) * size
        local_positions = positions - offset  # slot of each token in this device's slice
        slots = jnp.where(valid & (local_positions >= 0) & (local_positions < size), local_positions, size)
        cache_k, cache_v = write_slots(cache_k, slots, k), write_slots(cache_v, slots, v)
        spec = attention.MaskSpec(local_positions, jnp.clip(new_lengths - offset, 0, size), window=step.sliding_window)
        out, lse = attention.attend_partial(q, cache_k, cache_v, spec, impl=step.impl)
        return sharding.merge_partials(out, lse, sharding.MODEL), cache_k, cache_v

    batch, cache = P(sharding.DATA), P(sharding.DATA, sharding.MODEL)
    return jax.shard_map(
        local,
        mesh=step.mesh,
        in_specs=(batch, batch, batch, cache, cache, batch, batch, batch),
        out_specs=(batch, cache, cache),
        check_vma=False,
    )(q, k, v, cache_k, cache_v, step.positions, step.valid, step.new_lengths)


@dataclasses.dataclass(frozen=True)
class SubChunks:
    """A chunk of T = S x K new tokens seen by the streaming heads as S chunks of K (`DuoAttention.streaming_chunk`):
    for each, the keys it sees among the ring + chunk slots [B, R + T], the ones before it first (the sinks, then
    the `recent` tokens before it: at most R), then its own K."""

    slots: jax.Array  # int32 [B, S, R + K]: index of each key in the ring + chunk slots
    positions: jax.Array  # int32 [B, S, R + K]: its position; -1: none (the sub-chunk's keys before it are fewer)
    ring: int  # R: the slots before each sub-chunk's own keys

    @classmethod
    def build(cls, step: Step, sink, recent, size: int, slots: int) -> SubChunks:
        """Sub-chunk s starts at position a = lengths + s K; its query i sees j <= i with j < sink or j >= a - recent
        (the rule of a chunk that starts at a): the sinks [0, min(sink, a)), then [max(a - recent, sink), a), from
        the ring (of `slots` slots) where before the chunk (lengths), else from the chunk, then the sub-chunk's own
        keys. Of the R = `slots` keys before each sub-chunk, those past sink + recent are none (-1)."""
        B, T = step.positions.shape
        S, R = T // size, slots
        start = step.lengths[:, None] + size * jnp.arange(S, dtype=jnp.int32)  # [B, S]
        t = jnp.arange(R, dtype=jnp.int32)
        sinks = jnp.minimum(sink, start)[..., None]
        lo = jnp.maximum(start - recent, sink)[..., None]
        before = jnp.where(t < sinks, t, jnp.where(t - sinks < start[..., None] - lo, lo + t - sinks, -1))
        before = jnp.where(before < step.new_lengths[:, None, None], before, -1)  # past a short prompt: padding
        first = step.lengths[:, None, None]  # the chunk's first position; the ring holds those before it
        before_slots = jnp.where(before >= first, R + before - first, ring_slot(before, sink, recent))
        own_slots = R + jnp.arange(T, dtype=jnp.int32).reshape(S, size)
        own = jnp.where(step.valid, step.positions, -1).reshape(B, S, size)
        slots = jnp.concatenate([jnp.maximum(before_slots, 0), jnp.broadcast_to(own_slots, (B, S, size))], axis=2)
        return cls(slots, jnp.concatenate([before, own], axis=2), R)

    def attend(self, q, keys, values, step: Step) -> jax.Array:
        """q [B, T, H, E] over the ring + chunk keys / values [B, R + T, K, E] (or their codes), one sub-chunk per
        row of a batch of B x S."""
        B, T = q.shape[:2]
        S, W = self.slots.shape[1:]
        index = self.slots.reshape(B, S * W)[:, :, None, None]

        def gather(x):  # [B, R + T, ...] -> [B S, W, ...]: values, or codes and scales alike
            return jnp.take_along_axis(x, index, axis=1).reshape(B * S, W, *x.shape[2:])

        spec = attention.MaskSpec(
            step.positions.reshape(B * S, T // S),
            jnp.full((B * S,), W, jnp.int32),
            self.positions.reshape(B * S, W),
            window=step.sliding_window,
            own_keys_at=self.ring,
        )
        keys, values = jax.tree.map(gather, keys), jax.tree.map(gather, values)
        out = attention.attend(q.reshape(B * S, T // S, *q.shape[2:]), keys, values, spec, impl=step.impl)
        return out.reshape(q.shape)


@dataclasses.dataclass(frozen=True)
class StreamingWindow:
    """Per-step bookkeeping of a sink + ring-buffer cache, shared by every layer."""

    key_positions: jax.Array  # int32 [B, S + T]: absolute position of each cache slot, then each new token; -1: empty
    write_slots: jax.Array  # int32 [B, T]: ring slot of each new token (out of range: not kept)
    ring_lengths: jax.Array  # int32 [B]: the slots filled before the step (the ring fills its slots in order)
    sub_chunks: SubChunks | None = None  # a chunk longer than `DuoAttention.streaming_chunk`: its pieces

    @classmethod
    def build(cls, step: Step, sink, recent, chunk: int | None = None, slots: int | None = None) -> StreamingWindow:
        """The window of `sink` + `recent` tokens (ints, or traced scalars with the ring's `slots` given) over a ring
        of `slots` slots (default sink + recent)."""
        # Keys are [cache slots, chunk]. The cache holds only sinks and tokens within `recent` of the
        # chunk start, so "j <= i" over filled slots is exactly the Λ-with-chunk rule.
        slots = sink + recent if slots is None else slots
        key_positions = jnp.concatenate(
            [streaming_slot_positions(step.lengths, sink, recent, slots), jnp.where(step.valid, step.positions, -1)],
            axis=1,
        )
        write = streaming_write_slots(step.positions, step.valid, step.new_lengths, sink, recent, slots)
        filled = jnp.minimum(step.lengths, sink + recent)
        T = step.positions.shape[1]
        if chunk is None or T <= chunk:
            return cls(key_positions, write, filled)
        if T % chunk:
            raise DuoJaxError(
                f"a prefill chunk of {T} tokens is longer than duo's streaming_chunk ({chunk}) but not a multiple of "
                f"it: use a chunk_size that is a multiple of {chunk} (or at most {chunk})"
            )
        return cls(key_positions, write, filled, SubChunks.build(step, sink, recent, chunk, slots))

    def attend(self, q, keys, values, step: Step) -> jax.Array:
        """q [B, T, H, E] over the ring + chunk keys / values [B, S + T, K, E]."""
        if self.sub_chunks is not None:
            return self.sub_chunks.attend(q, keys, values, step)
        spec = step.positions_spec(self.key_positions, own_keys_at=self.key_positions.shape[1] - q.shape[1])
        return attention.attend(q, keys, values, spec, impl=step.impl)

    def attend_and_write(self, q, k, v, cache_k, cache_v, step: Step):
        """Streaming heads: q [B, T, H_s, E] over their ring cache_k / cache_v [B, S, K_s, E] and
        the chunk's k / v [B, T, K_s, E]; returns (output, the ring with the chunk folded in)."""
        out = q
        k, v = as_stored(k, cache_k), as_stored(v, cache_v)  # quantized once, when the cache is
        if step.mesh is not None:  # the ring whole on every `model` device (GSPMD had split a quantized write by heads)
            k, v, cache_k, cache_v = (sharding.whole_over_model(x, step.mesh) for x in (k, v, cache_k, cache_v))
        if q.shape[2]:
            out = self.attend(q, concat_slots(cache_k, k), concat_slots(cache_v, v), step)
        return (out, *self.write(k, v, cache_k, cache_v))

    def write(self, k, v, cache_k, cache_v):
        """The ring cache_k / cache_v with the chunk's k / v [B, T, K_s, E] folded in."""
        return write_slots(cache_k, self.write_slots, k), write_slots(cache_v, self.write_slots, v)


@dataclasses.dataclass(frozen=True)
class DuoShared:
    retrieval_slots: jax.Array  # int32 [B, T]: slot = position; padding goes out of range (dropped)
    window: StreamingWindow


@dataclasses.dataclass(frozen=True)
class DuoAttention(Method):
    """DuoAttention with a fixed retrieval / streaming split (`layout.num_retrieval` heads per layer)."""

    layout: CacheLayout  # its kv_order says which heads are retrieval heads
    # The most tokens a streaming head sees as one prefill chunk: a longer chunk (a multiple of it) is seen as
    # chunks of this size while the retrieval heads see it whole, so the output is that of a prefill in chunks of
    # this size. None: each chunk as it comes. A performance knob (a long chunk is one long attention call for the
    # retrieval heads) that leaves the output alone.
    streaming_chunk: int | None = None

    @property
    def name(self) -> str:
        """The method's name: full where every head is a retrieval head (`make_full`, or a pattern at sparsity 0),
        else duo."""
        return "full" if self.layout.every_head_retrieval else "duo"

    @property
    def max_tokens(self) -> int:
        return self.layout.capacity

    def init_cache(self, batch: int, dtype) -> tuple[DuoLayerCache, ...]:
        return init_cache(self.layout, batch, dtype)

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        return expected_cache_bytes(self.layout, batch, bytes_per_elem)

    def stats(self) -> dict:
        layout = self.layout
        return dict(
            retrieval_heads=sum(layout.num_retrieval),
            kv_heads=layout.num_layers * layout.num_kv_heads,
            capacity=layout.capacity,
            sink=layout.sink,
            recent=layout.recent,
        )

    def cache_partition(self) -> tuple[DuoLayerCache, ...]:
        """Batch over `data`; retrieval slots over `model`, streaming partition replicated over it."""
        retrieval, streaming = P(sharding.DATA, sharding.MODEL), P(sharding.DATA)
        return tuple(DuoLayerCache(retrieval, retrieval, streaming, streaming) for _ in self.layout.num_retrieval)

    def state(self):
        """The streaming window where it is runtime data (`CacheLayout.ring_slots`), else None."""
        return self.layout.window_state()

    def begin_step(self, step: Step) -> DuoShared:
        sink, recent = self.layout.window_of(step.state)
        return DuoShared(
            jnp.where(step.valid, step.positions, self.layout.capacity),
            StreamingWindow.build(step, sink, recent, self.streaming_chunk, self.layout.streaming_slots),
        )

    def attend_partitions(self, layer, q, ks, vs, retrieval, streaming_k, streaming_v, step: Step, shared: DuoShared):
        """Both partitions' attention where the one-launch kernel does not serve the step, the retrieval cache
        already holding the new tokens: q [B, T, H, E] in the model's head order, ks / vs the new tokens' keys and
        values on the streaming heads (the caches' order), `retrieval(qr)` the retrieval heads' output for their
        queries qr. Returns (output [B, T, H, E] in the model's head order, the ring with the new tokens folded
        in)."""
        qr, qs = split_heads(self.layout, layer, q)
        out_s, sk, sv = shared.window.attend_and_write(qs, ks, vs, streaming_k, streaming_v, step)
        return merge_heads(self.layout, layer, retrieval(qr), out_s), sk, sv

    def kv_order(self, layer: int) -> tuple[int, ...]:
        """The layer's KV heads in the caches' order (retrieval heads first)."""
        return self.layout.kv_order[layer] if self.layout.kv_order else tuple(range(self.layout.num_kv_heads))

    def prefill_in_one_kernel(self, layer, q, retrieval_k, retrieval_v, ks, vs, streaming_k, streaming_v, step, shared):
        """A chunk's attention over both partitions in `attention.duo_prefill`'s one launch: q [B, T, H, E] in the
        model's head order, the retrieval cache already holding the chunk, ks / vs the chunk's keys and values on
        the streaming heads (the caches' order), the ring as it was before the chunk. Returns the output in the
        model's head order, or None where the kernel does not serve the step."""
        if step.is_decode or step.mesh is not None or step.sliding_window is not None:
            return None
        if shared.window.sub_chunks is not None:  # the kernel sees the chunk whole on every head
            return None
        return attention.duo_prefill(
            q,
            retrieval_k,
            retrieval_v,
            concat_slots(streaming_k, ks),
            concat_slots(streaming_v, vs),
            shared.window.key_positions,
            kv_order=self.kv_order(layer),
            q_offset=step.lengths,
            kv_len=step.new_lengths,
            impl=step.impl,
        )

    def decode_in_one_kernel(
        self, layer, q, k, v, retrieval_k, retrieval_v, streaming_k, streaming_v, step, shared, *, written=False
    ):
        """A decode step's attention in `attention.duo_decode`'s one launch, the new token's q / k / v in the model's
        head order: with the caches as they were before it, the kernel writes both (output, ring k, ring v,
        retrieval k, retrieval v); `written`, the retrieval cache already holds the new token and the caller writes
        the ring (a kernel that writes no cache: impl="mosaic"). None where no kernel serves the step."""
        if not (step.is_decode and step.mesh is None and step.sliding_window is None):
            return None
        slots = (
            {}
            if written
            else dict(ring_slots=shared.window.write_slots[:, 0], cache_slots=shared.retrieval_slots[:, 0])
        )
        return attention.duo_decode(
            q,
            retrieval_k,
            retrieval_v,
            step.new_lengths if written else step.lengths,
            streaming_k,
            streaming_v,
            shared.window.ring_lengths,
            k,
            v,
            kv_order=self.kv_order(layer),
            impl=step.impl,
            **slots,
        )

    def attend(self, layer, q, k, v, cache: DuoLayerCache, step: Step, shared: DuoShared):
        n = self.layout.num_retrieval[layer]
        q, k = apply_rotary(q, step.rope), apply_rotary(k, step.rope)
        rotation = kv_rotation_for(self.layout.kv_dtype, self.layout.head_dim)
        q, k, v = rotation.into(q, k, v)  # a quantized cache holds k R and v R
        if step.mesh is not None:  # the heads' split is per layer: gather them first, then pick locally
            q, k, v = (sharding.whole_over_model(x, step.mesh) for x in (q, k, v))
        served = self.decode_in_one_kernel(
            layer, q, k, v, cache.retrieval_k, cache.retrieval_v, cache.streaming_k, cache.streaming_v, step, shared
        )
        if served is not None:
            out, sk, sv, rk, rv = served
            return rotation.back(out), DuoLayerCache(rk, rv, sk, sv)
        (kr, ks), (vr, vs) = (split_heads(self.layout, layer, x) for x in (k, v))
        if step.mesh is not None and n:
            qr = split_heads(self.layout, layer, q)[0]
            out_r, rk, rv = sharded_retrieval_attention(qr, kr, vr, cache.retrieval_k, cache.retrieval_v, step)
            retrieval = lambda qr: out_r  # noqa: E731
        else:
            if step.mesh is None:  # slot = position, and a step's positions follow each other: written in place
                n_valid = step.new_lengths - step.lengths
                rk = write_run(cache.retrieval_k, step.lengths, kr, n_valid)
                rv = write_run(cache.retrieval_v, step.lengths, vr, n_valid)
            else:
                rk = write_slots(cache.retrieval_k, shared.retrieval_slots, kr)
                rv = write_slots(cache.retrieval_v, shared.retrieval_slots, vr)
            retrieval = lambda qr: retrieval_attention(qr, rk, rv, step) if n else qr  # noqa: E731
            out = self.prefill_in_one_kernel(
                layer, q, rk, rv, ks, vs, cache.streaming_k, cache.streaming_v, step, shared
            )
            if out is None:
                served = self.decode_in_one_kernel(
                    layer, q, k, v, rk, rv, cache.streaming_k, cache.streaming_v, step, shared, written=True
                )
                out = None if served is None else served[0]
            if out is not None:
                sk, sv = cache.streaming_k, cache.streaming_v
                sk, sv = shared.window.write(as_stored(ks, sk), as_stored(vs, sv), sk, sv)
                return rotation.back(out), DuoLayerCache(rk, rv, sk, sv)
        out, sk, sv = self.attend_partitions(
            layer, q, ks, vs, retrieval, cache.streaming_k, cache.streaming_v, step, shared
        )
        return rotation.back(out), DuoLayerCache(rk, rv, sk, sv)


@register("full", summary="every head keeps every token")
def make_full(config: ModelConfig, *, context: int, kv_dtype: str | None = None) -> DuoAttention:
    return DuoAttention(make_layout(config, None, sink=0, recent=0, context=context, kv_dtype=kv_dtype))


def fit_window(budget: int, sink: int, recent: int) -> tuple[int, int]:
    """duo's (sink, recent) for a `budget` of tokens per head: unchanged when sink + recent <= budget / 2,
    else both scaled down to fill half the budget (recent >= 1), so that some heads can still be retrieval heads."""
    if sink + recent <= budget // 2:
        return sink, recent
    scale = (budget // 2) / (sink + recent)
    return int(sink * scale), max(1, int(recent * scale))


def duo_budget(
    config: ModelConfig,
    kv_budget: int,
    *,
    context: int,
    sink: int,
    recent: int,
    sparsity: float,
    pattern=None,
    fitted: bool = True,
    **inputs,
) -> dict:
    """duo at a budget: its window fitted to the budget (`fit_window`) and the sparsity that meets it
    (`duo_sparsity_for_budget`); where that leaves no retrieval head, every head streaming with the whole budget as
    its window (half of it would keep half the budget). Unfitted (the budget is duo's own), the given sparsity and
    window."""
    if fitted:
        window = sink, recent
        sink, recent = fit_window(kv_budget, *window)
        sparsity = duo_sparsity_for_budget(
            kv_budget,
            context=round_capacity(context),
            window=sink + recent,
            heads=config.num_layers * config.num_kv_heads,
        )
        if num_retrieval_heads(config, sparsity) == 0:
            sink, recent = fit_window(2 * kv_budget, *window)  # fills the budget, not half
            sparsity = 1.0
    return dict(pattern=pattern, sparsity=sparsity, sink=sink, recent=recent)


@register(
    "duo",
    budget=duo_budget,
    budget_fits_capacity=True,
    summary="DuoAttention: retrieval heads keep every token, streaming heads sink + recent",
)
def make_duo(
    config: ModelConfig,
    *,
    context: int,
    pattern=None,
    sparsity: float | None = None,
    sink: int = 64,
    recent: int = 256,
    kv_budget: int | None = None,
    kv_dtype: str | None = None,
    streaming_chunk: int | None = None,
    ring_slots: int | None = None,
) -> DuoAttention:
    """`pattern` (a `Pattern` validated against the model) binarised at `sparsity` (None: `DEFAULT_SPARSITY`); or,
    with `kv_budget` (average tokens per KV head at `context`), at the sparsity whose mix r * C + (1 - r) * (sink +
    recent) meets it (C: `context` rounded up to the capacity block). `streaming_chunk`:
    `DuoAttention.streaming_chunk`. `ring_slots`: the streaming heads' ring holds that many slots (>= sink + recent)
    and their window is runtime data, so duo methods that differ only in sink and recent share compiled steps
    (`CacheLayout`); None: a ring of sink + recent, the window compiled in."""
    if pattern is None:
        raise DuoJaxError("method 'duo' needs a head pattern (pattern=PATH, a Pattern, or 'default')")
    pattern = resolve_pattern(pattern, config)
    if kv_budget is not None and sparsity is not None:
        raise DuoJaxError(
            f"duo takes kv_budget or sparsity, not both: kv_budget={kv_budget} picks the sparsity that meets it"
        )
    if streaming_chunk is not None:
        streaming_chunk = check_number(
            "streaming_chunk", streaming_chunk, integer=True, minimum=1, hint=" (tokens a streaming head's chunk holds)"
        )
    if kv_budget is not None:
        capacity = round_capacity(context)
        least = min(sink + recent, capacity)
        if kv_budget < least:  # even all-streaming heads would keep more
            raise DuoJaxError(
                f"kv_budget={kv_budget} is below duo's streaming window, sink + recent = {sink} + {recent}: every "
                f"head keeps at least that (or the capacity, {capacity}); pass a smaller sink / recent, or a "
                f"kv_budget of at least {least}"
            )
        sparsity = duo_sparsity_for_budget(
            kv_budget, context=capacity, window=sink + recent, heads=config.num_layers * config.num_kv_heads
        )
    sparsity = DEFAULT_SPARSITY if sparsity is None else sparsity
    layout = make_layout(
        config,
        pattern.retrieval_mask(sparsity),
        sink=sink,
        recent=recent,
        context=context,
        kv_dtype=kv_dtype,
        ring_slots=ring_slots,
    )
    return DuoAttention(layout, streaming_chunk)


def num_retrieval_heads(config: ModelConfig, sparsity: float) -> int:
    """How many retrieval heads any pattern keeps at `sparsity` (independent of the gate values)."""
    return int(Pattern.full(config.num_layers, config.num_kv_heads).retrieval_mask(sparsity).sum())


def duo_sparsity_for_budget(kv_budget: float, *, context: int, window: int, heads: int) -> float:
    """The sparsity at which DuoAttention keeps `kv_budget` tokens per KV head on average at `context` tokens:
    retrieval fraction r with r * context + (1 - r) * window = kv_budget (clipped to [0, 1]), rounded to whole
    heads, R = floor(r * heads + 1/2) of the `heads`. Returned as the sparsity halfway between those at which
    `Pattern.retrieval_mask` (N - ceil(s * (N - 1)) heads) keeps R, so no float rounding can make it keep R +- 1."""
    if context <= window:
        return 1.0  # streaming heads already hold the whole context
    r = min(max((kv_budget - window) / (context - window), 0.0), 1.0)
    retrieval = math.floor(r * heads + 0.5)
    if heads == 1:
        return 0.0 if retrieval else 1.0
    return min(max((heads - retrieval - 0.5) / (heads - 1), 0.0), 1.0)

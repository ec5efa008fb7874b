"""SnapKV and PyramidKV: an exact prefill, then each KV head keeps the prompt tokens its observation window
votes for; decoding appends to that compressed cache.

`SnapKV` is the prefill method: a full cache plus a ring of the latest `window` queries. Its `after_prefill`
compresses (the window's pooled attention votes for each KV head's `budgets[l][h]` prefix tokens, the window
kept whole) and returns a `CompressedKV`, the decode method over exactly the kept tokens plus a ring of new
ones. `pyramid_budgets` gives PyramidKV's per-layer budgets; HeadKV (`duo_jax.methods.headkv`) gives per-head
ones. The selection step by step, the decode cache, sliding windows and quantized caches: docs/methods.md,
"SnapKV and PyramidKV".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.attention import MaskSpec, masked_softmax
from duo_jax.cache import CAPACITY_BLOCK, StaticSpec, capacity_bucket, capacity_bucket_range, round_capacity
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import (
    Method,
    Step,
    check_windows,
    concat_slots,
    kv_rotation_for,
    within_future_window,
    write_slots,
)
from duo_jax.methods.duo import retrieval_attention
from duo_jax.methods.registry import kv_budget_only, register
from duo_jax.model import apply_rotary
from duo_jax.quant import as_stored, check_kv_dtype, dequantize, kv_bytes_per_vector, kv_zeros
from duo_jax.sampling import check_number

POOLINGS = ("max", "avg")


# --- selection --------------------------------------------------------------------------------------


def window_positions(lengths: jax.Array, window: int) -> jax.Array:
    """Position of the query held by each ring slot after `lengths` [B] tokens: slot s holds the newest
    position p < lengths with p % window == s, one of the last `window` positions; negative where empty.
    -> int32 [B, window]."""
    s = jnp.arange(window)[None, :]
    return (s + window * jnp.floor_divide(lengths[:, None] - 1 - s, window)).astype(jnp.int32)


def window_votes(
    queries: jax.Array, keys: jax.Array, lengths: jax.Array, window: int, sliding_window: int | None = None
) -> jax.Array:
    """Step 2 of the selection: queries [B, w, H, E] (the window ring), keys [B, C, K, E] -> votes
    float32 [B, K, C], zero outside each prompt's prefix (j >= lengths - window). With the layer's
    `sliding_window` W, query p's softmax runs over the keys p - W < j <= p only."""
    B, w, H, E = queries.shape
    C, K = keys.shape[1], keys.shape[2]
    q = queries.reshape(B, w, K, H // K, E)
    scores = jnp.einsum("bwkge,bcke->bkgwc", q, keys, preferred_element_type=jnp.float32) / math.sqrt(E)
    query_positions = window_positions(lengths, w)
    # [B, w, C]: causal within the window (`MaskSpec.visible`); an empty ring slot (negative position) sees none
    visible = MaskSpec(query_positions, lengths, window=sliding_window).visible(
        query_positions[:, :, None], jnp.arange(C)[None, None, :], jnp.ones((1, 1, C), bool)
    )
    votes = jnp.sum(masked_softmax(scores, visible[:, None, None]), axis=(2, 3))
    prefix = jnp.arange(C)[None, :] < (lengths - window)[:, None]  # [B, C]
    return jnp.where(prefix[:, None, :], votes, 0.0)


def pool_votes(votes: jax.Array, kernel: int, pooling: str) -> jax.Array:
    """Step 3: pool votes [B, K, C] along C (odd kernel, stride 1, kernel // 2 padding each side)."""
    pad = ((0, 0), (0, 0), (kernel // 2, kernel // 2))
    if pooling == "max":  # votes are >= 0 and zero past the prefix, so the padding value does not matter
        return jax.lax.reduce_window(votes, -jnp.inf, jax.lax.max, (1, 1, kernel), (1, 1, 1), pad)
    return jax.lax.reduce_window(votes, 0.0, jax.lax.add, (1, 1, kernel), (1, 1, 1), pad) / kernel


def kept_positions(
    queries,
    keys,
    lengths,
    *,
    selected: tuple[int, ...],
    window: int,
    window_slots: int,
    kernel: int,
    pooling: str,
    sliding_window: int | None = None,
    counts: jax.Array | None = None,
) -> jax.Array:
    """The positions one layer keeps: for each KV head h, its `selected[h]` best-voted prefix tokens, then the
    last `window_slots` prompt tokens (the observation window, or fewer slots when every prompt is shorter).
    queries [B, window, H, E] (the ring), keys [B, C, K, E], lengths [B]
    -> int32 [B, sum_h (selected[h] + window_slots)], heads one after another, -1 where empty. With the
    layer's `sliding_window`, tokens out of every later query's window are neither selected nor kept (-1).
    `counts` int32 [B, K] (runtime data, each <= selected[h]): row b's head h keeps only its `counts[b, h]` best,
    the rest of its `selected[h]` slots empty."""
    last = lengths[:, None] - window_slots + jnp.arange(window_slots)[None, :]
    last = jnp.where(within_future_window(last, lengths, sliding_window), last, -1)  # [B, window_slots]
    top = max(selected)
    if top > 0:
        pooled = pool_votes(window_votes(queries, keys, lengths, window, sliding_window), kernel, pooling)
        slots = jnp.broadcast_to(jnp.arange(keys.shape[1])[None, :], (lengths.shape[0], keys.shape[1]))
        prefix = (slots < (lengths - window)[:, None]) & within_future_window(slots, lengths, sliding_window)
        best, order = jax.lax.top_k(jnp.where(prefix[:, None, :], pooled, -jnp.inf), top)  # [B, K, top]
        if counts is not None:  # the ranks past each head's runtime budget stay empty
            best = jnp.where(jnp.arange(top)[None, None, :] < counts[:, :, None], best, -jnp.inf)
        chosen = jnp.where(best > -jnp.inf, order, -1).astype(jnp.int32)
    parts = []
    for h, n in enumerate(selected):
        if n > 0:
            parts.append(chosen[:, h, :n])
        parts.append(last)
    return jnp.concatenate(parts, axis=1)


def check_selection(window: int, kernel: int, pooling: str) -> None:
    """DuoJaxError unless the observation window, pooling kernel and pooling kind are usable."""
    if window < 1:
        raise DuoJaxError(f"the observation window must hold at least 1 token, got {window}")
    if kernel < 1 or kernel % 2 == 0:
        raise DuoJaxError(f"the pooling kernel must be a positive odd number, got {kernel}")
    if pooling not in POOLINGS:
        raise DuoJaxError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")


# --- the decode method --------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CompressedLayerCache:
    k: jax.Array  # [B, N, E]: kept prompt tokens, KV head after KV head
    v: jax.Array  # [B, N, E]
    positions: jax.Array  # int32 [B, N], -1 where empty
    new_k: jax.Array  # [B, R, K, E]: tokens after the prompt, position p in slot p % R
    new_v: jax.Array  # [B, R, K, E]
    new_positions: jax.Array  # int32 [B, R], -1 where empty


@dataclasses.dataclass(frozen=True)
class CompressedShared:
    write_slots: jax.Array  # int32 [B, T]: ring slot of each new token (out of range: not kept)
    new_key_positions: jax.Array  # int32 [B, T]: position of each new token, -1 for padding

    @classmethod
    def build(cls, step: Step, room: int) -> CompressedShared:
        keep = step.valid & (step.positions >= step.new_lengths[:, None] - room)
        return cls(jnp.where(keep, step.positions % room, room), jnp.where(step.valid, step.positions, -1))


def kv_array(shape: tuple[int, ...], dtype, kv_dtype: str | None):
    """Zeros for keys or values of logical `shape` [..., E]: in `dtype`, or quantized (`duo_jax.quant`)."""
    return jnp.zeros(shape, dtype) if kv_dtype is None else kv_zeros(shape, kv_dtype, dtype)


def empty_compressed(
    batch: int, head_slots: tuple[int, ...], room: int, head_dim: int, dtype, kv_dtype: str | None = None
) -> CompressedLayerCache:
    """One layer's empty decode cache for len(head_slots) KV heads."""
    n, K, E = sum(head_slots), len(head_slots), head_dim
    return CompressedLayerCache(
        kv_array((batch, n, E), dtype, kv_dtype),
        kv_array((batch, n, E), dtype, kv_dtype),
        jnp.full((batch, n), -1, jnp.int32),
        kv_array((batch, room, K, E), dtype, kv_dtype),
        kv_array((batch, room, K, E), dtype, kv_dtype),
        jnp.full((batch, room), -1, jnp.int32),
    )


def compressed_nbytes(
    batch: int, head_slots: tuple[int, ...], room: int, head_dim: int, bytes_per_elem: int, kv_dtype: str | None = None
) -> int:
    """Size of one layer's decode cache: batch * [sum(head_slots) * (2 V + 4) + room * (2 K V + 4)], V the bytes
    of one key (`duo_jax.quant.kv_bytes_per_vector`: E bytes, or codes + scale when quantized)."""
    kv = 2 * kv_bytes_per_vector(head_dim, check_kv_dtype(kv_dtype), bytes_per_elem)
    return batch * (sum(head_slots) * (kv + 4) + room * (len(head_slots) * kv + 4))


def compressed_attention(
    q, k, v, cache: CompressedLayerCache, head_slots: tuple[int, ...], step: Step, shared: CompressedShared
):
    """New tokens over one layer's decode cache: q [B, T, H, E] and k [B, T, K, E] after RoPE, v [B, T, K, E].

    Each KV head sees its kept prompt tokens, the tokens generated so far and the chunk up to the query (within
    the layer's sliding window, `Step.sees`).
    Returns the output [B, T, H, E] and the cache with the chunk written into the ring. A quantized cache
    (`duo_jax.quant.QuantizedKV`) quantizes the chunk once and is read dequantized."""
    B, T, H, E = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, H // K, E)
    k, v = as_stored(k, cache.new_k), as_stored(v, cache.new_v)  # quantized once, when the cache is
    kept_k, kept_v = dequantize(cache.k), dequantize(cache.v)
    # The kept prompt tokens. Equal budgets: a [B, K, n, E] view; otherwise every query head scores every
    # slot and a mask keeps its own head's (K times the score FLOPs, on a cache that stays exact).
    uniform = len(set(head_slots)) == 1
    if uniform:
        n = head_slots[0]
        prompt_scores = jnp.einsum(
            "btkge,bkne->bkgtn", q, kept_k.reshape(B, K, n, E), preferred_element_type=jnp.float32
        )
        prompt_mask = step.sees(cache.positions.reshape(B, K, n))[:, :, None]  # [B, K, 1, T, n]
    else:
        prompt_scores = jnp.einsum("btkge,bne->bkgtn", q, kept_k, preferred_element_type=jnp.float32)
        owner = np.repeat(np.arange(K), head_slots)  # [N]: the KV head of each slot
        own = jnp.asarray(owner[None, :] == np.arange(K)[:, None])  # [K, N]
        prompt_mask = own[None, :, None, None, :] & step.sees(cache.positions)[:, None, None]  # [B, K, 1, T, N]
    # The generated tokens so far, then this chunk (causal).
    keys = dequantize(concat_slots(cache.new_k, k))  # [B, R + T, K, E]
    values = dequantize(concat_slots(cache.new_v, v))
    key_positions = jnp.concatenate([cache.new_positions, shared.new_key_positions], axis=1)  # [B, R + T]
    new_mask = step.sees(key_positions)  # [B, T, R + T]
    new_scores = jnp.einsum("btkge,bske->bkgts", q, keys, preferred_element_type=jnp.float32)

    n_prompt = prompt_scores.shape[-1]
    probs = masked_softmax(
        jnp.concatenate([prompt_scores, new_scores], axis=-1) / math.sqrt(E),
        jnp.concatenate(
            [
                jnp.broadcast_to(prompt_mask, prompt_scores.shape),
                jnp.broadcast_to(new_mask[:, None, None], new_scores.shape),
            ],
            -1,
        ),
    )
    prompt_probs, new_probs = probs[..., :n_prompt].astype(values.dtype), probs[..., n_prompt:].astype(values.dtype)
    f32 = dict(preferred_element_type=jnp.float32)  # the two parts summed in float32, rounded once
    if uniform:
        out = jnp.einsum("bkgtn,bkne->btkge", prompt_probs, kept_v.reshape(B, K, head_slots[0], E), **f32)
    else:
        out = jnp.einsum("bkgtn,bne->btkge", prompt_probs, kept_v, **f32)
    out = (out + jnp.einsum("bkgts,bske->btkge", new_probs, values, **f32)).astype(values.dtype)

    batch = jnp.arange(B)[:, None]
    new_positions = cache.new_positions.at[batch, shared.write_slots].set(shared.new_key_positions, mode="drop")
    return out.reshape(B, T, H, E), dataclasses.replace(
        cache,
        new_k=write_slots(cache.new_k, shared.write_slots, k),
        new_v=write_slots(cache.new_v, shared.write_slots, v),
        new_positions=new_positions,
    )


def compress_layer(
    queries,
    keys,
    values,
    lengths,
    empty: CompressedLayerCache,
    head_slots: tuple[int, ...],
    *,
    window: int,
    kernel: int,
    pooling: str,
    sliding_window: int | None = None,
    counts: jax.Array | None = None,
) -> CompressedLayerCache:
    """One layer's prefill cache (queries [B, window, H, E], keys / values [B, C, K, E]) -> its decode cache:
    the kept tokens gathered into `empty` (from `empty_compressed`), the ring left empty. `sliding_window`:
    the layer's; `counts`: the prefix tokens each head keeps where that is runtime data (`kept_positions`)."""
    # Every head ends with the same window slots: the whole window, or all of its slots when the prompts are
    # shorter than the window (then no head selects anything; see `SnapKV.decode_method`).
    window_slots = min(window, head_slots[0])
    positions = kept_positions(
        queries,
        dequantize(keys),
        lengths,
        selected=tuple(n - window_slots for n in head_slots),
        window=window,
        window_slots=window_slots,
        kernel=kernel,
        pooling=pooling,
        sliding_window=sliding_window,
        counts=counts,
    )
    owner = jnp.asarray(np.repeat(np.arange(len(head_slots)), head_slots))[None, :]  # [1, N]
    batch = jnp.arange(lengths.shape[0])[:, None]
    filled = (positions >= 0)[..., None]

    def take(x):  # codes and scales alike for a quantized cache
        return jax.tree.map(
            lambda a: jnp.where(filled, a[batch, jnp.maximum(positions, 0), owner], 0).astype(a.dtype), x
        )

    return dataclasses.replace(empty, k=take(keys), v=take(values), positions=positions)


def held_tokens(capacity: int, longest: int) -> int:
    """The prompt tokens a head can keep after prompts of at most `longest` tokens: their length rounded up to
    `CAPACITY_BLOCK`, at most the capacity."""
    return min(round_capacity(max(longest, 1)), capacity)


def decode_shape(
    budgets: tuple[tuple[int, ...], ...],
    window: int,
    capacity: int,
    longest: int,
    room: int | None = None,
    held: int | None = None,
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(head_slots [L][heads], room) of the decode cache after prompts of at most `longest` tokens: each head's
    budget + window, capped by `held` prompt tokens (default `held_tokens`); room for the tokens after the
    prompts: `room`, or the capacity minus the longest prompt rounded down to `CAPACITY_BLOCK`."""
    held = held_tokens(capacity, longest) if held is None else held
    slots = tuple(tuple(min(b, max(held - window, 0)) + min(window, held) for b in row) for row in budgets)
    return slots, capacity - longest // CAPACITY_BLOCK * CAPACITY_BLOCK if room is None else room


@dataclasses.dataclass(frozen=True)
class CompressedKV(Method):
    """Decoding over a compressed prompt cache, built by `SnapKV.after_prefill` (docs/methods.md, "SnapKV and
    PyramidKV")."""

    num_kv_heads: int
    head_dim: int
    head_slots: tuple[tuple[int, ...], ...]  # [L][K]: kept prompt slots per KV head
    room: int  # ring slots for the tokens after the prompt
    name: str = "snapkv"
    kv_dtype: str | None = None  # "int8" / "int4": quantized K and V (`duo_jax.quant`)

    def init_cache(self, batch: int, dtype) -> tuple[CompressedLayerCache, ...]:
        return tuple(
            empty_compressed(batch, slots, self.room, self.head_dim, dtype, self.kv_dtype) for slots in self.head_slots
        )

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        return sum(
            compressed_nbytes(batch, slots, self.room, self.head_dim, bytes_per_elem, self.kv_dtype)
            for slots in self.head_slots
        )

    def begin_step(self, step: Step) -> CompressedShared:
        return CompressedShared.build(step, self.room)

    def attend(self, layer, q, k, v, cache: CompressedLayerCache, step: Step, shared: CompressedShared):
        q, k = apply_rotary(q, step.rope), apply_rotary(k, step.rope)
        rotation = kv_rotation_for(self.kv_dtype, self.head_dim)
        q, k, v = rotation.into(q, k, v)  # a quantized cache holds k R and v R
        out, cache = compressed_attention(q, k, v, cache, self.head_slots[layer], step, shared)
        return rotation.back(out), cache


# --- the prefill method -------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillLayerCache:
    k: jax.Array  # [B, C, K, E]: token at position p in slot p, after RoPE
    v: jax.Array  # [B, C, K, E]
    queries: jax.Array  # [B, window, H, E]: the latest queries after RoPE, position p in slot p % window


@dataclasses.dataclass(frozen=True)
class PrefillShared:
    kv_slots: jax.Array  # int32 [B, T]: slot = position; padding goes out of range (dropped)
    query_slots: jax.Array  # int32 [B, T]: ring slot, out of range unless among the last `window` tokens


@dataclasses.dataclass(frozen=True, eq=False)
class SnapKV(StaticSpec, Method):
    """Exact prefill, then SnapKV selection with per-(layer, KV head) budgets (docs/methods.md, "SnapKV and PyramidKV").

    `budgets[l][h]`: prefix tokens KV head h of layer l keeps besides the window (uniform: SnapKV; per layer:
    PyramidKV; per head: HeadKV). Build one with `make_snapkv`, `make_pyramidkv` or `make_headkv`. With
    `slot_budgets` the decode cache is shaped for those budgets and `budgets` is runtime data (equality and hash
    ignore it), so that methods differing only in their budgets share compiled steps.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    capacity: int  # prefill slots per KV head: the context rounded up to CAPACITY_BLOCK
    budgets: tuple[tuple[int, ...], ...]  # [L][K]
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    name: str = "snapkv"
    pyramid_beta: float | None = None  # PyramidKV: re-spread the budgets over the layers for short prompts
    kv_dtype: str | None = None  # "int8" / "int4": quantized K and V (`duo_jax.quant`; the query ring is not)
    windows: tuple[int | None, ...] | None = None  # each layer's sliding window (`ModelConfig.layer_windows`)
    # [L][K] budgets the decode cache is shaped for, each >= the budget it holds (`budgets` then runtime data);
    # None: `budgets`.
    slot_budgets: tuple[tuple[int, ...], ...] | None = None
    room: int | None = None  # decode slots for the tokens after the prompt; None: what the capacity leaves

    def __post_init__(self):
        check_selection(self.window, self.kernel, self.pooling)
        if any(len(row) != self.num_kv_heads or min(row) < 0 for row in self.budgets):
            raise DuoJaxError(f"budgets must be [layers][{self.num_kv_heads}] non-negative token counts")
        if self.windows is not None and len(self.windows) != len(self.budgets):
            raise DuoJaxError(f"windows must give each of the {len(self.budgets)} layers its sliding window")
        if self.slot_budgets is not None and (
            np.shape(self.slot_budgets) != np.shape(self.budgets)
            or (np.asarray(self.slot_budgets) < np.asarray(self.budgets)).any()
        ):
            raise DuoJaxError(
                "slot_budgets must give every head of every layer at least its budget (the tokens its slots hold): "
                "raise budget_slots or lower kv_budget"
            )
        if self.room is not None:
            object.__setattr__(self, "room", check_number("room", self.room, integer=True, minimum=1))

    def _data_fields(self) -> tuple[str, ...]:
        return ("budgets",) if self.slot_budgets is not None else ()

    @property
    def room_after_prompt(self) -> int | None:
        return self.room

    @property
    def num_layers(self) -> int:
        return len(self.budgets)

    def init_cache(self, batch: int, dtype) -> tuple[PrefillLayerCache, ...]:
        kv = (batch, self.capacity, self.num_kv_heads, self.head_dim)
        ring = (batch, self.window, self.num_heads, self.head_dim)
        return tuple(
            PrefillLayerCache(
                kv_array(kv, dtype, self.kv_dtype), kv_array(kv, dtype, self.kv_dtype), jnp.zeros(ring, dtype)
            )
            for _ in range(self.num_layers)
        )

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        """batch * L * (2 C K V + window H E bytes), V the bytes of one key (`duo_jax.quant.kv_bytes_per_vector`)."""
        vector = kv_bytes_per_vector(self.head_dim, check_kv_dtype(self.kv_dtype), bytes_per_elem)
        ring = self.window * self.num_heads * self.head_dim * bytes_per_elem
        per_layer = 2 * self.capacity * self.num_kv_heads * vector + ring
        return batch * self.num_layers * per_layer

    def begin_step(self, step: Step) -> PrefillShared:
        in_window = step.valid & (step.positions >= step.new_lengths[:, None] - self.window)
        return PrefillShared(
            jnp.where(step.valid, step.positions, self.capacity),
            jnp.where(in_window, step.positions % self.window, self.window),
        )

    def attend(self, layer, q, k, v, cache: PrefillLayerCache, step: Step, shared: PrefillShared):
        check_windows(self, self.windows, layer, step)
        q, k = apply_rotary(q, step.rope), apply_rotary(k, step.rope)
        rotation = kv_rotation_for(self.kv_dtype, self.head_dim)
        q, k, v = rotation.into(q, k, v)  # a quantized cache holds k R and v R; the ring holds q R (votes: q R (k R)^T)
        keys = write_slots(cache.k, shared.kv_slots, k)
        values = write_slots(cache.v, shared.kv_slots, v)
        out = retrieval_attention(q, keys, values, step)
        out = rotation.back(out)
        return out, PrefillLayerCache(keys, values, write_slots(cache.queries, shared.query_slots, q))

    def prompt_budgets(self, longest: int) -> tuple[tuple[int, ...], ...]:
        """The budgets [L][K] after prompts of at most `longest` tokens: `budgets`, or for PyramidKV the
        pyramid re-spread so that no layer's budget exceeds the longest prompt's prefix (`pyramid_budgets`)."""
        if self.pyramid_beta is None:
            return self.budgets
        return self._pyramid(_average(self.budgets), longest)

    def _pyramid(self, average: int, longest: int | None) -> tuple[tuple[int, ...], ...]:
        """PyramidKV's budgets at `average` after a prompt of `longest` tokens (None: long enough for any)."""
        prefix = None if longest is None else max(longest - self.window, 0)
        spread = pyramid_budgets(self.num_layers, average, self.pyramid_beta, prefix=prefix)
        return tuple((b,) * self.num_kv_heads for b in spread)

    def shape_budgets(self, longest: int, lengths: Sequence[int] = ()) -> tuple[tuple[int, ...], ...]:
        """The budgets [L][K] the decode cache is shaped for after prompts of at most `longest` tokens, of `lengths`
        each: `prompt_budgets`, for PyramidKV the most any row's own pyramid gives a layer (a shorter prompt
        re-spreads more to the upper layers), and with `slot_budgets` those, raised where a short prompt's
        re-spread gives a layer more."""
        budgets = self.prompt_budgets(longest)
        if self.pyramid_beta is not None:
            for n in set(lengths) - {longest}:
                budgets = tuple(tuple(map(max, a, b)) for a, b in zip(budgets, self.prompt_budgets(n)))
        if self.slot_budgets is None:
            return budgets
        return tuple(tuple(map(max, slots, row)) for slots, row in zip(self.slot_budgets, budgets))

    def decode_method(self, longest: int, lengths: Sequence[int] = ()) -> CompressedKV:
        """The decode method after a prefill whose longest prompt has `longest` tokens (its rows `lengths`). With
        `slot_budgets` its shape follows the buckets of the prompts' lengths (`capacity_bucket`), not the lengths,
        so that prompts in the same buckets share executables: each head capped by the longest prompt's bucket,
        and PyramidKV's layers given what a prompt anywhere in each row's bucket could re-spread to them."""
        budgets, held = self.shape_budgets(longest, lengths), None
        if self.slot_budgets is not None:
            held = min(capacity_bucket(longest), self.capacity)
            if self.pyramid_beta is not None:
                # A layer's re-spread budget is linear in the prefix below the bottom layer's budget and constant
                # above, and grows with the average, so the ends of each bucket at the slots' average bound it (one
                # more for the integer rounding). The rows' own budgets stay in (shape_budgets): a bound that fell
                # short would cost a compile, not a token.
                average = _average(self.slot_budgets)
                unspread = self._pyramid(average, None)
                for n in sorted(set(lengths) | {longest}):
                    for end in capacity_bucket_range(n):
                        spread = self._pyramid(average, end)
                        if spread != unspread:
                            budgets = tuple(
                                tuple(max(a, b + 1) for a, b in zip(row, ends)) for row, ends in zip(budgets, spread)
                            )
        slots, room = decode_shape(budgets, self.window, self.capacity, longest, self.room, held)
        return CompressedKV(self.num_kv_heads, self.head_dim, slots, room, self.name, self.kv_dtype)

    def after_prefill(self, cache, lengths):
        rows = [int(n) for n in np.asarray(lengths)]
        longest = max(rows)
        decode = self.decode_method(longest, rows)
        counts = None
        # Each head's prefix tokens as runtime data in the slots shaped above: under `slot_budgets`, and for
        # PyramidKV's rows of other lengths, each of which keeps its own pyramid (what it keeps alone).
        if self.slot_budgets is not None or (self.pyramid_beta is not None and len(set(rows)) > 1):
            prefix = max(held_tokens(self.capacity, longest) - self.window, 0)  # as decode_shape's cap
            kept = [[[min(b, prefix) for b in row] for row in self.prompt_budgets(n)] for n in rows]
            counts = jnp.asarray(kept, jnp.int32)  # [B, L, K]
        return decode, _compress(self, decode, cache, lengths, counts)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _compress(
    method: SnapKV,
    decode: CompressedKV,
    cache: tuple[PrefillLayerCache, ...],
    lengths: jax.Array,
    counts: jax.Array | None = None,
):
    """The prefill cache -> the decode cache, layer by layer; `counts` int32 [B, L, K]: the prefix tokens each
    row's head keeps where the budgets are runtime data (`SnapKV.slot_budgets`, PyramidKV's rows)."""
    empty = decode.init_cache(lengths.shape[0], cache[0].queries.dtype)  # the model's dtype
    windows = method.windows or (None,) * method.num_layers
    return tuple(
        compress_layer(
            layer.queries,
            layer.k,
            layer.v,
            lengths,
            new,
            slots,
            window=method.window,
            kernel=method.kernel,
            pooling=method.pooling,
            sliding_window=sliding_window,
            counts=None if counts is None else counts[:, l],
        )
        for l, (layer, new, slots, sliding_window) in enumerate(zip(cache, empty, decode.head_slots, windows))
    )


# --- budgets ------------------------------------------------------------------------------------------


def _average(budgets: tuple[tuple[int, ...], ...]) -> int:
    """The average of per-layer budgets (a pyramid's, equal over a layer's heads)."""
    return sum(row[0] for row in budgets) // len(budgets)


def base_budget(kv_budget, window: int) -> int:
    """Tokens kept per head besides the observation window: `kv_budget` (window included) - `window`."""
    if kv_budget is None:
        raise DuoJaxError("this method needs kv_budget (average tokens kept per KV head, window included)")
    if not window <= kv_budget:
        raise DuoJaxError(f"kv_budget ({kv_budget}) must be at least the observation window ({window} tokens)")
    return int(kv_budget) - window


def slot_budgets(kv_budget: int, budget_slots, window: int, rule) -> tuple[tuple[int, ...], ...] | None:
    """The [L][K] budgets a decode cache is shaped for under `budget_slots` (a kv_budget >= `kv_budget`, window
    included): `rule(base budget)` at it, or None without `budget_slots`. `rule` must not decrease as its budget
    grows, so that every budget up to `budget_slots` fits the slots."""
    if budget_slots is None:
        return None
    budget_slots = check_number("budget_slots", budget_slots, integer=True, minimum=1)
    if budget_slots < kv_budget:
        raise DuoJaxError(
            f"budget_slots ({budget_slots}) must be at least kv_budget ({kv_budget}): it is the kv_budget the cache is "
            "shaped for"
        )
    return rule(base_budget(budget_slots, window))


@register(
    "snapkv",
    budget=kv_budget_only,
    summary="SnapKV: exact prefill, then per KV head the kv_budget tokens the last window queries vote for",
)
def make_snapkv(
    config: ModelConfig,
    *,
    context: int,
    kv_budget: int | None = None,
    window: int = 32,
    kernel: int = 5,
    pooling: str = "avg",
    kv_dtype: str | None = None,
    budget_slots: int | None = None,
    room: int | None = None,
) -> SnapKV:
    """SnapKV: every KV head keeps `kv_budget` prompt tokens, the last `window` included (the original's
    max_capacity_prompt). Defaults are the SnapKV release's: window 32, average pooling over 5 tokens.
    `budget_slots`: the kv_budget (>= kv_budget) the decode cache is shaped for, the budget runtime data, so that
    SnapKV at budgets up to it shares compiled steps; `room`: decode slots for the tokens after the prompt (None:
    what the capacity leaves), so that prompts of any length share them."""
    budget = base_budget(kv_budget, window)

    def uniform(b):
        return ((b,) * config.num_kv_heads,) * config.num_layers

    return SnapKV(
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        round_capacity(context),
        uniform(budget),
        window,
        kernel,
        pooling,
        kv_dtype=kv_dtype,
        windows=config.layer_windows(),
        slot_budgets=slot_budgets(kv_budget, budget_slots, window, uniform),
        room=room,
    )


def pyramid_budgets(num_layers: int, average: int, beta: float = 20.0, prefix: int | None = None) -> list[int]:
    """PyramidKV's per-layer budgets (tokens besides the window), bottom layer first: the top layer keeps
    average / beta, the bottom 2 * average - average / beta, the layers between follow the arithmetic
    sequence, and the integer budgets are rounded by largest remainders so they sum to num_layers * average.

    When the bottom budget exceeds `prefix` (the prompt's tokens before the window), the bottom keeps
    `prefix` and the surplus moves up the pyramid: the top keeps 2 * average - prefix (the original's
    `PyramidKVCluster.update_kv`: max_num capped at q_len - window_size, min_num = 2 * base - max_num)."""
    if beta < 1:
        raise DuoJaxError(f"PyramidKV's beta must be >= 1 (the top layer keeps average / beta), got {beta}")
    if num_layers == 1:
        return [average]
    top = average / beta
    bottom = 2 * average - top
    if prefix is not None and bottom >= prefix:
        bottom, top = prefix, 2 * average - prefix
    exact = bottom - (bottom - top) * np.arange(num_layers) / (num_layers - 1)
    budgets = np.floor(exact).astype(int)
    short = num_layers * average - int(budgets.sum())
    budgets[np.argsort(-(exact - budgets), kind="stable")[:short]] += 1
    return budgets.tolist()


@register(
    "pyramidkv",
    budget=kv_budget_only,
    summary="PyramidKV: SnapKV with per-layer budgets shrinking bottom to top (beta 20), kv_budget on average",
)
def make_pyramidkv(
    config: ModelConfig,
    *,
    context: int,
    kv_budget: int | None = None,
    beta: float = 20.0,
    window: int = 32,
    kernel: int = 5,
    pooling: str = "avg",
    kv_dtype: str | None = None,
    budget_slots: int | None = None,
    room: int | None = None,
) -> SnapKV:
    """PyramidKV: SnapKV selection, `kv_budget` tokens per KV head on average (window included), spread over
    the layers by `pyramid_budgets` (beta 20 as the paper); after a prompt whose prefix is shorter than the
    bottom layer's budget, the surplus moves to the upper layers (`SnapKV.prompt_budgets`; in a batch, each row's
    own prefix). `budget_slots`, `room`: as SnapKV's (the slots of each layer are the
    pyramid's at budget_slots plus one, which bounds its rounding)."""

    def pyramid(b, extra=0):
        return tuple((n + extra,) * config.num_kv_heads for n in pyramid_budgets(config.num_layers, b, beta))

    return SnapKV(
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        round_capacity(context),
        pyramid(base_budget(kv_budget, window)),
        window,
        kernel,
        pooling,
        name="pyramidkv",
        pyramid_beta=float(beta),
        kv_dtype=kv_dtype,
        windows=config.layer_windows(),
        slot_budgets=slot_budgets(kv_budget, budget_slots, window, lambda b: pyramid(b, extra=1)),
        room=room,
    )

"""Causal attention through cuDNN's fused attention (JAX's cuDNN binding) on a GPU: a prefill chunk or a decode step
over a contiguous or paged cache, the streaming heads' ring followed by the chunk, a sliding window, a chunk over
int8 / int4 codes, a shard of the keys with its log-sum-exp (`attention_with_lse`, the generation mesh's partials),
or Λ over every key slot (gate training's streaming heads, a whole sequence or a shard's queries at an offset),
forward and backward.

This is the path that needs no Pallas Triton backend (deprecated in JAX 0.11). It uses the library where it serves:
cuDNN's flash attention on Hopper is faster than this project's Triton flash kernel (BENCHMARKS.md, "Attention
kernels vs cuDNN").

Why several calls: JAX's binding aligns cuDNN's causal mask top-left (query i sees keys j <= i). That is the
engine's rule only for queries that start at position 0. A chunk at offset c sees the c cached keys whole and its own
T keys causally, so it runs as two calls (`calls`):
- the chunk over the prefix: a padding mask, keys j < c, the cache read in place;
- the chunk over itself: causal with T = S, its T keys gathered from the cache.
Λ (sink + recent) is cuDNN's sliding window of `recent` keys plus a causal call of the queries from position
`recent` over the `sink` first keys: the sinks further back than the window (at an offset, four calls, some over
gathered queries: `_lambda_calls`). The calls' results are merged by their log-sum-exps (flash attention's
rescaling). The log-sum-exp comes from the binding's `return_residual`, which only
its internal module exposes (`jax._src.cudnn.fused_attention_stablehlo`), so `unavailable()` probes it once per
process against the XLA path, and the dispatch keeps the Pallas kernels (or XLA) where it fails.

The gradient (`merged`): the binding's own backward takes the call's output and log-sum-exp and drops the
log-sum-exp's cotangent, which a merge needs. Each call's backward given the merged output and log-sum-exp instead
is the merged softmax's gradient restricted to that call's keys (ring attention's backward), so the calls'
gradients sum to the right one. That binds the binding's backward primitive with those statistics, an internal
API, so `gradient_unavailable()` probes it (and `lambda_unavailable()` Λ's calls), and the dispatch recomputes
the gradient on the kernels it stands beside where it fails.

A prefill chunk over a quantized cache (int8 / int4 codes, which cuDNN does not read) dequantizes its keys first:
at a chunk's arithmetic intensity the extra pass over the cache costs little beside the attention (decode steps,
bound by reading the cache, are not served: the dequantized copy would be read again). The prefix is dequantized
`PREFIX_SEGMENT` slots at a time, one call each.

A sliding window (Mistral, Qwen's windowed layers) is cuDNN's own over a whole sequence; a chunk at an offset adds
the window's keys before it (`_band_calls`, which Λ at an offset shares), and a decode step reads the window's slots
(`_window_calls`). A shard of the keys (`attention_with_lse`) is the filled slots before the chunk and the chunk's
own slots in the shard (`_shard_calls`). `window_unavailable()` and `partial_unavailable()` probe those calls.

A paged cache (`PagedKV`) reads its prefix through the binding's paged attention (`paged_prefix`): each KV head is
a sequence of its own, so the head-major pool [K, N, P, E] is cuDNN's block container as it is, never copied.
JAX's own tests do not check that call's values, so `paged_unavailable()` probes it on its own, per page size, head
dim and group.
Design: docs/attention.md, "cuDNN for dense prefill chunks".
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.attention import xla
from duo_jax.attention.masks import MaskSpec, prefix_spec
from duo_jax.attention.pages import PagedKV
from duo_jax.quant import QuantizedKV, dequantize

DTYPES = (jnp.bfloat16, jnp.float16)  # cuDNN's flash attention: 16-bit inputs
MAX_HEAD_DIM = 128
# A prefill chunk over a quantized cache dequantizes its prefix this many slots at a time (one cuDNN call each): the
# dequantized copy, 2 x 2 bytes x K x E per slot (64 MiB of one layer's 8 KV heads at head dim 128), is this size.
PREFIX_SEGMENT = 32768

# (q [B, T, H, E], k, v [B, S, K, E], kv_seqlen [B] or None (all S keys), causal, window=None) -> (out [B, T, H, E],
# natural log-sum-exp float32 [B, T, H]): row i sees key j iff j < kv_seqlen, j <= i if causal (top-left), i - j <
# window with a window. Scale is bound.
Attend = Callable[..., tuple[jax.Array, jax.Array]]
# (q, k, v, kv_seqlen, causal, window, out [B, T, H, E], lse float32 [B, T, H], d_out [B, T, H, E]) -> (d_q, d_k,
# d_v): the backward of one `Attend` call, given the statistics of the softmax it is part of. Scale is bound.
AttendBackward = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
# cuDNN's paged attention in its BNTH layout: (q [S, G, T, E], blocks_k / blocks_v [num_blocks, 1, P, E], q_seqlen
# [S], kv_seqlen [S], page_table int32 [S, 1, W, 1]) -> (out [S, G, T, E], log-sum-exp float32 [S, G, T]): sequence s
# reads block page_table[s, 0, w, 0] as its slots [w * P, (w + 1) * P), keys j < kv_seqlen[s] seen by every query;
# the binding checks that num_blocks = S * W. Scale is bound.
AttendPaged = Callable[..., tuple[jax.Array, jax.Array]]


def takes(q: jax.Array, k, v) -> bool:
    """16-bit values (no codes, no pages) of a head dim cuDNN's flash attention takes."""
    return not any(isinstance(x, (QuantizedKV, PagedKV)) for x in (k, v)) and _fits(q, k, v)


def takes_codes(q: jax.Array, k, v) -> bool:
    """Quantized keys and values (`QuantizedKV`, one kind) dequantizing to the query's 16-bit dtype, of a head dim
    cuDNN's flash attention takes: a prefill chunk dequantizes them (`calls`), as cuDNN reads no int8 / int4."""
    return isinstance(k, QuantizedKV) and isinstance(v, QuantizedKV) and k.kind == v.kind and _fits(q, k, v)


def takes_pages(q: jax.Array, k, v) -> bool:
    """Pages (`PagedKV`, both k and v) of the query's 16-bit dtype and a head dim cuDNN's flash attention takes."""
    return isinstance(k, PagedKV) and isinstance(v, PagedKV) and _fits(q, k, v)


def _fits(q: jax.Array, k, v) -> bool:
    """q, k and v (or their pages) in one 16-bit dtype, of a head dim cuDNN's flash attention takes."""
    return (
        q.dtype in DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= MAX_HEAD_DIM
    )


def serves(q: jax.Array, k, v, spec: MaskSpec) -> bool:
    """Causal queries (a chunk, or one per sequence: decode) over a contiguous cache cuDNN `takes` or pages it
    `takes_pages`, or over a ring followed by the queries' own keys (`MaskSpec.own_keys_at`: the streaming heads);
    a chunk over quantized codes it `takes_codes`; Λ over every key slot (gate training's streaming heads: a whole
    sequence, or a shard's queries at a traced offset over the whole sequence's keys); a sliding window over a
    contiguous cache (values, or codes), but not Λ within one."""
    if not spec.causal:
        return False
    if spec.window is not None:  # a contiguous cache: values, or codes dequantized in the window's calls
        return spec.k_positions is None and not spec.is_lambda and (takes(q, k, v) or takes_codes(q, k, v))
    if takes_pages(q, k, v):
        return spec.k_positions is None and not spec.is_lambda
    if takes_codes(q, k, v):  # a prefill chunk over a quantized cache
        return q.shape[1] > 1 and spec.k_positions is None and not spec.is_lambda
    if not takes(q, k, v):
        return False
    if spec.is_lambda:
        return spec.k_positions is None and spec.every_key
    return spec.k_positions is None or spec.own_keys_at is not None


def whole_sequence(q: jax.Array, k, spec: MaskSpec) -> bool:
    """Queries from position 0 (a Python int), as many as the keys: Λ's two calls over slices (`calls`)."""
    return spec.static_prefix == (0, k.shape[1]) and q.shape[1] == k.shape[1]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: MaskSpec,
    *,
    scale: float | None = None,
    attend: Attend | None = None,
    attend_backward: AttendBackward | None = None,
    attend_paged: AttendPaged | None = None,
) -> jax.Array:
    """`serves`' cases through cuDNN: q [B, T, H, E] at positions q_offset + t (`spec.q_positions`, consecutive).
    Over a contiguous cache k / v [B, C, K, E] holding them at their positions (slots j < kv_len seen): a decode
    step (T = 1) is one call with a padding mask; a chunk sees the prefix [0, q_offset) whole and itself causally,
    two calls merged (one where the chunk starts a sequence whose offset is a Python int: gate training). Over a
    ring of R slots followed by the queries' own keys (`spec.own_keys_at` = R; the ring's filled slots first, every
    one before every query): the ring's filled slots whole and the own keys causally, two calls merged (a decode
    step: one call, its own key moved up after the filled slots). Λ over a whole sequence: the recent window
    (cuDNN's sliding window) and the sinks before it, two calls merged; at an offset, four (`calls`). Λ sees every
    key slot, as the Λ kernel does. Over codes (`QuantizedKV`), a chunk as over a contiguous cache, its own keys
    dequantized and its prefix dequantized a segment at a time, one call each. Over pages (`PagedKV`), as over a
    contiguous cache, with the prefix read through the tables (`paged_prefix`) and a chunk's own keys gathered
    (forward only).

    Differentiable, except over pages: each call's gradient is cuDNN's backward given the merged output and
    log-sum-exp (`merged`). `attend` runs one call, `attend_backward` one call's backward and `attend_paged` one
    paged call (cuDNN by default; the tests pass the XLA path, `xla_part`, `xla_part_backward` and
    `xla_paged_part`)."""
    B, T, H, E = q.shape
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    attend = functools.partial(attend or _cudnn, scale=scale)
    if isinstance(k, PagedKV):
        paged = functools.partial(
            paged_prefix, q, k, v, attend=functools.partial(attend_paged or _cudnn_paged, scale=scale)
        )
        if T == 1:
            return paged(spec.decode_lengths())[0]
        q_offset = spec.q_positions[:, 0]
        positions = q_offset[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        own = attend(q, k.at_positions(positions), v.at_positions(positions), None, True)
        prefix = paged(q_offset)
        return _merge(q, (own, prefix), (Call(), Call(causal=False)), (None, q_offset), (None, None))[0].astype(q.dtype)
    return merged(
        q,
        calls(q, k, v, spec),
        attend=attend,
        attend_backward=functools.partial(attend_backward or _cudnn_backward, scale=scale),
    )


def serves_partial(q: jax.Array, k, v, spec: MaskSpec) -> bool:
    """`attention_with_lse`'s cases: causal queries (consecutive positions, anywhere relative to the shard) over one
    shard of a contiguous cache cuDNN `takes` (slot = position within the shard), no window, no Λ."""
    return spec.causal and spec.window is None and not spec.is_lambda and spec.k_positions is None and takes(q, k, v)


def attention_with_lse(
    q: jax.Array, k, v, spec: MaskSpec, *, scale: float | None = None, attend: Attend | None = None
) -> tuple[jax.Array, jax.Array]:
    """Attention over one shard of the keys (the retrieval cache split over a generation mesh's `model` axis,
    `duo_jax.attention.attend_partial`): q [B, T, H, E] at shard-local positions o + t (o [B] may be negative or
    past the shard: the chunk starts before or after it), keys j < kv_len seen causally -> (out [B, T, H, E],
    log-sum-exp float32 [B, T, H], xla's finite "no key" value where a query sees none), for merging across shards.
    Two calls (`_shard_calls`). Forward only."""
    E = q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    out, lse = _forward(q, _shard_calls(q, k, v, spec), functools.partial(attend or _cudnn, scale=scale))
    return out, jnp.where(lse > -jnp.inf, lse, xla.NO_KEY_LSE)


def _shard_calls(q, k, v, spec: MaskSpec) -> list[Part]:
    """Queries at local positions o + t over a shard's slots, keys j < kv_len filled: the filled slots before o, seen
    whole (a padding mask), and the queries' own slots from start = clip(o, 0, S), causal: row r is query
    r + start - o (a query before the shard sees none of it), key r slot start + r, key lengths the filled own
    slots (a sequence's first keys). A decode step: its filled slots up to its position, one call."""
    B, T = q.shape[:2]
    S = k.shape[1]
    o = spec.q_positions[:, 0]
    filled = jnp.clip(spec.kv_len, 0, S)
    if T == 1:
        return [Part(Call(causal=False), k, v, jnp.clip(jnp.minimum(filled, o + 1), 0, S))]
    n = min(T, S)
    start = jnp.clip(o, 0, S)
    r = jnp.arange(n, dtype=jnp.int32)[None, :]
    own = Part(
        Call(),
        *_gather(k, v, jnp.minimum(start[:, None] + r, S - 1)),
        jnp.clip(filled - start, 0, n),
        r + (start - o)[:, None],
    )
    return [own, Part(Call(causal=False), k, v, jnp.clip(jnp.minimum(o, filled), 0, S))]


@dataclasses.dataclass(frozen=True)
class Call:
    """One cuDNN call of a decomposition: query rows [rows, T) over the call's keys, row i (of the call) seeing key
    j iff j < kv_len (a padding mask, when the call has key lengths), j <= i with `causal` (cuDNN's top-left
    alignment) and i - j < window with a `window` (cuDNN's sliding window)."""

    rows: int = 0
    causal: bool = True
    window: int | None = None


class Part(NamedTuple):
    """A call as `calls` lists it: its keys [B, S_i, K, E] and values, key lengths int32 [B] (None: all S_i keys),
    and its query rows: None, q[:, call.rows:]; else int32 [B, T_i], the query each of its rows is (gathered; a
    row outside [0, T) is none: its result is not read and gets no gradient)."""

    call: Call
    k: jax.Array
    v: jax.Array
    lengths: jax.Array | None = None
    rows: jax.Array | None = None


def calls(q: jax.Array, k: jax.Array, v: jax.Array, spec: MaskSpec) -> list[Part]:
    """`serves`' contiguous cases as cuDNN calls over disjoint keys, whose softmaxes merge into the spec's."""
    T = q.shape[1]
    if spec.is_lambda:
        return _lambda_calls(q, k, v, spec)
    if spec.window is not None:
        return _window_calls(q, k, v, spec)
    if spec.k_positions is not None:  # a ring, then the queries' own keys
        ring = spec.own_keys_at
        filled = jnp.sum(spec.k_positions[:, :ring] >= 0, axis=1)
        if T == 1 and ring:  # a decode step: one call over the filled slots and the own key moved up after them
            return [Part(Call(causal=False), *_own_key_after(k, v, filled, ring), filled + 1)]
        own = Part(Call(), k[:, ring : ring + T], v[:, ring : ring + T])
        return [own, Part(Call(causal=False), k[:, :ring], v[:, :ring], filled)] if ring else [own]
    if T == 1:
        return [Part(Call(causal=False), k, v, spec.decode_lengths())]
    c, n = spec.static_prefix or (None, None)
    codes = isinstance(k, QuantizedKV)
    if c is not None and c + T <= min(n, k.shape[1]) and not codes:  # own keys and prefix are slices: none gathered
        own = Part(Call(), k[:, c : c + T], v[:, c : c + T])
        return [own, Part(Call(causal=False), k[:, :c], v[:, :c])] if c else [own]
    q_offset = spec.q_positions[:, 0]
    own = Part(Call(), *_own_keys(k, v, q_offset, T))
    if not codes:
        return [own, Part(Call(causal=False), k, v, q_offset)]
    # codes: the prefix dequantized PREFIX_SEGMENT slots at a time, one call each (a segment past a sequence's
    # prefix has no keys and weighs 0), so the dequantized copy held at once is a segment, not the cache
    C, segment = k.shape[1], PREFIX_SEGMENT
    return [own] + [
        Part(Call(causal=False), *_read(k, v, lambda x, a=a: x[:, a : a + segment]), jnp.clip(q_offset - a, 0, segment))
        for a in range(0, C, segment)
    ]


def _own_key_after(k, v, filled, ring: int):
    """A decode step's keys and values over a ring of `ring` slots, its `filled` [B] slots first, then its own key
    (slot `ring`): the first ring + 1 slots with the own key also at slot `filled` (an empty slot, or its own where
    the ring is full), so that slots j < filled + 1 are the keys the step sees. One call with a padding mask
    instead of a call over the own key and a merge."""
    at = (jnp.arange(ring + 1, dtype=jnp.int32)[None, :] == filled[:, None])[:, :, None, None]
    return tuple(jnp.where(at, x[:, ring : ring + 1], x[:, : ring + 1]) for x in (k, v))


def _read(k, v, select):
    """`select` applied to the keys and the values (to codes and scales alike), codes dequantized after it."""
    return tuple(dequantize(jax.tree.map(select, x)) for x in (k, v))


def _gather(k, v, slots):
    """Keys and values at slots int32 [B, n] (in range), codes dequantized after the gather."""
    return _read(k, v, lambda x: jnp.take_along_axis(x, slots[:, :, None, None], axis=1))


def _own_keys(k, v, q_offset, T):
    """The chunk's own keys and values: slots q_offset + t, gathered (clipped: a row past the cache is a padding
    token no real row sees); codes gathered, then dequantized."""
    return _gather(k, v, jnp.minimum(q_offset[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :], k.shape[1] - 1))


def _band_calls(q, k, v, spec: MaskSpec, width: int) -> list[Part]:
    """Query p sees the keys j in (p - width, p]: Λ's recent window, or a sliding window. Over a whole sequence, one
    call: cuDNN's sliding window over all the keys. For queries at an offset o [B] (a chunk over a cache, a shard's
    queries), cuDNN's masks being aligned top-left and taking key lengths, never a first key, two calls:
    - the window over the queries' own keys, slots o + t: the sliding window as above;
    - the window's keys before o: query i sees o - 1 - r iff r < width - 1 - i. With the keys in that order (their
      lengths min(o, width - 1): a sequence's first keys) and query i as row width - 2 - i, that is causal."""
    B, T = q.shape[:2]
    if whole_sequence(q, k, spec):
        return [Part(Call(window=width), k, v)]
    o = spec.q_positions[:, 0]
    parts = [Part(Call(window=width), *_own_keys(k, v, o, T))]
    if width > 1:
        r = jnp.arange(width - 1, dtype=jnp.int32)
        slots = jnp.maximum(o[:, None] - 1 - r[None, :], 0)  # [B, width - 1]: past the lengths where o < width - 1
        rows = jnp.broadcast_to(width - 2 - r, (B, width - 1))
        parts.append(Part(Call(), *_gather(k, v, slots), jnp.clip(o, 0, width - 1), rows))
    return parts


def _window_calls(q, k, v, spec: MaskSpec) -> list[Part]:
    """A sliding window (Mistral, Qwen): a chunk as `_band_calls`; a decode step over the `window` slots ending at
    its position (gathered; the slots past its keys, or before slot 0, masked by the lengths), one call."""
    if q.shape[1] > 1:
        return _band_calls(q, k, v, spec, spec.window)
    n = min(spec.window, k.shape[1])
    start = jnp.clip(spec.q_positions[:, 0] - spec.window + 1, 0, k.shape[1] - n)
    slots = start[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    return [Part(Call(causal=False), *_gather(k, v, slots), jnp.clip(spec.decode_lengths() - start, 0, n))]


def _lambda_calls(q, k, v, spec: MaskSpec) -> list[Part]:
    """Λ over every key slot: query p sees the window j in (p - recent, p] (`_band_calls`) and the sinks j < sink
    further back, j <= p - recent. Over a whole sequence the sinks are the queries from position `recent` over the
    sinks, causal (row i of that call sits at position recent + i). At an offset o [B] (traced: a shard's, gate
    training's all-gather sequence parallelism), query i sees the sinks j <= i + o - recent: the queries with
    0 <= i + o - recent < sink gathered, one row per sink (row t is query t - o + recent), causal; and the queries
    past them over every sink, no mask."""
    T = q.shape[1]
    sink, recent = spec.sink, spec.recent
    parts = _band_calls(q, k, v, spec, recent)
    if not sink:
        return parts
    sinks = (k[:, :sink], v[:, :sink])
    if whole_sequence(q, k, spec):
        return parts + [Part(Call(rows=recent), *sinks)] if recent < T else parts
    shift = (spec.q_positions[:, 0] - recent)[:, None]  # query i sees the sinks j <= i + shift
    partial = jnp.arange(sink, dtype=jnp.int32)[None, :] - shift
    queries = jnp.arange(T, dtype=jnp.int32)[None, :]
    whole = jnp.where(queries + shift >= sink, queries, T)
    return parts + [Part(Call(), *sinks, None, partial), Part(Call(causal=False), *sinks, None, whole)]


def merged(q: jax.Array, parts: list[Part], *, attend, attend_backward) -> jax.Array:
    """The calls' softmaxes as one (q's dtype [B, T, H, E]), merged by their log-sum-exps. Its gradient runs each
    call's backward with the merged output and log-sum-exp in place of the call's own (as ring attention does):
    the softmax over all the keys restricted to that call's keys, so the calls' gradients sum to the merged one.
    (The binding's own backward would use the call's statistics and drop the log-sum-exp's cotangent.)"""
    kinds = tuple(part.call for part in parts)

    def forward(q, keys, values, lengths, rows):
        return _forward(q, [Part(*fields) for fields in zip(kinds, keys, values, lengths, rows, strict=True)], attend)

    @jax.custom_vjp
    def run(q, keys, values, lengths, rows):
        return forward(q, keys, values, lengths, rows)[0]

    def run_forward(q, keys, values, lengths, rows):
        out, lse = forward(q, keys, values, lengths, rows)
        return out, (q, keys, values, lengths, rows, out, lse)

    def run_backward(residuals, d_out):
        q, keys, values, lengths, rows, out, lse = residuals
        T = q.shape[1]
        d_q, d_keys, d_values = jnp.zeros(q.shape, jnp.float32), [], []
        for call, k, v, n, at in zip(kinds, keys, values, lengths, rows, strict=True):
            q_i, out_i, lse_i, d_out_i = (_rows_of(x, call, at) for x in (q, out, lse, d_out))
            lse_i = jnp.where(lse_i > -jnp.inf, lse_i, jnp.inf)  # a query that sees no key: no probability
            if at is not None:  # rows that are no query: no probability (lse +inf), no cotangent
                real = ((at >= 0) & (at < T))[:, :, None]
                lse_i = jnp.where(real, lse_i, jnp.inf)
                out_i, d_out_i = (jnp.where(real[..., None], x, 0) for x in (out_i, d_out_i))
            grads = attend_backward(q_i, k, v, n, call.causal, call.window, out_i, lse_i, d_out_i)
            if n is not None:  # keys past the lengths, or a sequence with none: no gradient (cuDNN's is undefined)
                seen = jnp.arange(k.shape[1])[None, :] < n[:, None]
                grads = [
                    jnp.where((n > 0)[:, None, None, None], grads[0], 0),
                    *(jnp.where(seen[:, :, None, None], g, 0) for g in grads[1:]),
                ]
            d_q = d_q + _place(grads[0].astype(jnp.float32), call, at, T, 0.0)
            d_keys.append(grads[1])
            d_values.append(grads[2])
        cotangents = jax.tree.map(zero_cotangent, (lengths, rows))
        return d_q.astype(q.dtype), tuple(d_keys), tuple(d_values), *cotangents

    run.defvjp(run_forward, run_backward)
    keys, values, lengths, rows = (tuple(part[i] for part in parts) for i in (1, 2, 3, 4))
    return run(q, keys, values, lengths, rows)


def _forward(q, parts: list[Part], attend) -> tuple[jax.Array, jax.Array]:
    """The calls run and merged: (out in q's dtype [B, T, H, E], log-sum-exp float32 [B, T, H])."""
    results = [attend(_rows_of(q, part.call, part.rows), part.k, part.v, part.lengths, part.call.causal,
                      part.call.window) for part in parts]  # fmt: skip
    kinds, lengths, rows = (tuple(getattr(part, name) for part in parts) for name in ("call", "lengths", "rows"))
    out, lse = _merge(q, results, kinds, lengths, rows)
    return out.astype(q.dtype), lse


def _rows_of(x, call: Call, rows):
    """A call's rows of a per-query array x [B, T, ...]: x[:, call.rows:], or gathered at `rows` [B, T_i]
    (clipped: a row that is no query gets a real query's, which the caller does not use)."""
    if rows is None:
        return x[:, call.rows :]
    at = jnp.clip(rows, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, at.reshape(at.shape + (1,) * (x.ndim - 2)), axis=1)


def _place(x, call: Call, rows, T: int, fill):
    """`_rows_of`'s inverse: a call's per-row results x [B, T_i, ...] at their queries' rows of [B, T, ...], `fill`
    at the queries the call does not serve."""
    if rows is None:
        return jnp.pad(x, ((0, 0), (call.rows, 0)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
    at = jnp.where((rows >= 0) & (rows < T), rows, T)  # past the end: dropped
    placed = jnp.full((x.shape[0], T, *x.shape[2:]), fill, x.dtype)
    return placed.at[jnp.arange(x.shape[0])[:, None], at].set(x, mode="drop")


def _merge(q, results, kinds, lengths, rows) -> tuple[jax.Array, jax.Array]:
    """Softmaxes over disjoint keys as one: results [(out [B, T_i, H, E], lse [B, T_i, H])] over each call's rows
    -> (out float32 [B, T, H, E], lse float32 [B, T, H]). A call with key lengths weighs 0 for a sequence with
    none (cuDNN's rows over no key are not defined); queries a call does not serve weigh 0."""
    if len(results) == 1 and kinds[0].rows == 0 and lengths[0] is None and rows[0] is None:
        out, lse = results[0]
        return out.astype(jnp.float32), lse
    T = q.shape[1]
    outs, lses = [], []
    for (out, lse), call, n, at in zip(results, kinds, lengths, rows, strict=True):
        valid = _place(jnp.ones(lse.shape[:2], bool), call, at, T, False)
        if n is not None:
            valid = valid & (n > 0)[:, None]
        valid = valid[..., None]
        lses.append(jnp.where(valid, _place(lse, call, at, T, -jnp.inf), -jnp.inf))
        outs.append(jnp.where(valid[..., None], _place(out.astype(jnp.float32), call, at, T, 0.0), 0.0))
    top = functools.reduce(jnp.maximum, lses)
    seen = top > -jnp.inf  # a query with no key in any call: output 0, log-sum-exp -inf
    top = jnp.where(seen, top, 0.0)
    weights = [jnp.exp(lse - top) for lse in lses]
    total = sum(w[..., None] * out for w, out in zip(weights, outs, strict=True))
    norm = sum(weights)
    return total / jnp.where(seen, norm, 1.0)[..., None], top + jnp.log(norm)


def zero_cotangent(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def paged_prefix(q: jax.Array, k: PagedKV, v: PagedKV, kv_len: jax.Array, *, attend: AttendPaged):
    """q [B, T, H, E] over slots j < kv_len [B] of the pages, every slot seen by every query (a chunk's prefix, or a
    decode step's cache): (out [B, T, H, E], log-sum-exp float32 [B, T, H]) through `attend`, cuDNN's paged call.

    The binding wants K and V as [num_blocks, heads, P, E] blocks; the pool is head-major [K, N, P, E]. So each KV
    head is a sequence of its own: the pool reshaped to K * N blocks of one head (no copy), query rows (b, h) with
    their head's G query heads, and table entries h * N + page. The binding checks num_blocks = rows x table width,
    so a call of b sequences has tables N / b wide (`sequences_per_call`): padded past M with page 0 (masked by
    the key lengths), or, one sequence per call from a pool of fewer than M pages, cut to N (a sequence holds at
    most N pages)."""
    B, T, H, E = q.shape
    K, N, P, _ = k.pages.shape
    G = H // K
    tables = k.clipped_tables()
    M = tables.shape[1]
    per_call = sequences_per_call(B, N, M)
    width = N // per_call
    if width < M:
        tables, kv_len = tables[:, :width], jnp.minimum(kv_len, width * P)
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    tables = tables[:, None, :] + (N * jnp.arange(K, dtype=jnp.int32))[None, :, None]  # [B, K, width]
    blocks_k, blocks_v = (x.pages.reshape(K * N, 1, P, E) for x in (k, v))
    rows = jnp.transpose(q.reshape(B, T, K, G, E), (0, 2, 3, 1, 4))  # [B, K, G, T, E]
    outs, lses = [], []
    for first in range(0, B, per_call):
        b = slice(first, first + per_call)
        out, lse = attend(
            rows[b].reshape(per_call * K, G, T, E),
            blocks_k,
            blocks_v,
            jnp.full((per_call * K,), T, jnp.int32),
            jnp.repeat(kv_len[b].astype(jnp.int32), K),
            tables[b].reshape(per_call * K, 1, width, 1),
        )
        outs.append(out.reshape(per_call, K, G, T, E))
        lses.append(lse.reshape(per_call, K, G, T))
    out = jnp.transpose(jnp.concatenate(outs), (0, 3, 1, 2, 4)).reshape(B, T, H, E)
    return out, jnp.transpose(jnp.concatenate(lses), (0, 3, 1, 2)).reshape(B, T, H)


def sequences_per_call(batch: int, num_pages: int, table_width: int) -> int:
    """How many sequences one paged cuDNN call serves: the most b dividing the batch and the pool's N pages with
    tables N / b wide enough for M entries, else 1 (then one call per sequence)."""
    fits = [b for b in range(1, batch + 1) if batch % b == 0 and num_pages % b == 0 and num_pages // b >= table_width]
    return max(fits, default=1)


def _cudnn(q, k, v, kv_len, causal: bool, window: int | None = None, *, scale: float):
    """One cuDNN call (`Attend`), with its log-sum-exp."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    out, lse = cudnn.dot_product_attention(
        q,
        k,
        v,
        **_mask(cudnn, q, kv_len, causal),
        scale=scale,
        qkv_layout="BTNH",
        sliding_window_length=window,
        return_residual=True,
    )
    return out, jnp.swapaxes(lse, 1, 2)  # [B, H, T] -> [B, T, H]


def _cudnn_backward(q, k, v, kv_len, causal: bool, window, out, lse, d_out, *, scale: float):
    """cuDNN's backward of one call (`AttendBackward`) with the given output and log-sum-exp as its residuals. The
    binding's public function keeps its own residuals, so this binds its backward primitive, as its VJP does."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    mask = _mask(cudnn, q, kv_len, causal)
    unused = jnp.zeros(0, q.dtype)
    seqlens = [mask.get(name, unused) for name in ("q_seqlen", "kv_seqlen")]
    params = dict(
        scale=scale,
        seed=0,
        dropout_rate=0.0,
        variadic_args=(False, False),  # no bias, no bias gradient
        mask_type=mask["mask_type"],
        layout=cudnn.AttentionLayout.BTNH.value,
        sliding_window_length=window,
    )
    if "score_mod" in inspect.signature(cudnn._dot_product_attention_bwd_impl).parameters:
        params["score_mod"] = None  # JAX >= 0.12's score modifiers (none; no operands for them either)
    grads = cudnn._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, *seqlens, unused, unused, unused, unused,  # bias, offsets, page tables: none
        jnp.swapaxes(lse, 1, 2).astype(jnp.float32), out.astype(q.dtype), d_out.astype(q.dtype), **params,
    )  # fmt: skip
    return tuple(grads[:3])


def _mask(cudnn, q, kv_len, causal: bool) -> dict:
    """The binding's mask arguments: a padding mask (and sequence lengths) where the call has key lengths."""
    if kv_len is None:
        return dict(mask_type=cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK)
    B, T = q.shape[:2]
    return dict(
        mask_type=cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING,
        q_seqlen=jnp.full((B,), T, jnp.int32),
        kv_seqlen=kv_len.astype(jnp.int32),
    )


def _cudnn_paged(q, blocks_k, blocks_v, q_len, kv_len, tables, *, scale: float):
    """One paged cuDNN call (`AttendPaged`), with its log-sum-exp."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    return cudnn.paged_attention(
        q,
        blocks_k,
        blocks_v,
        q_len,
        kv_len,
        tables,
        tables,
        scale=scale,
        mask_type=cudnn.MaskType.PADDING,
        qkv_layout="BNTH",
        return_residual=True,
    )


def xla_part(q, k, v, kv_len, causal: bool, window: int | None = None, *, scale: float):
    """`_cudnn`'s contract on the XLA path: the tests' stand-in for cuDNN (`attention(attend=xla_part)`)."""
    B, T = q.shape[:2]
    spec = prefix_spec(B, T, kv_len=kv_len, num_keys=k.shape[1], causal=causal, window=window)
    return xla.attention_with_lse(q, k, v, spec, scale=scale)


def xla_part_backward(q, k, v, kv_len, causal: bool, window, out, lse, d_out, *, scale: float):
    """`_cudnn_backward`'s contract, written out densely (flash attention's backward from the given statistics): the
    tests' stand-in for cuDNN's backward (`attention(attend_backward=xla_part_backward)`)."""
    B, T, H, E = q.shape
    K = k.shape[2]
    f32 = lambda x: x.astype(jnp.float32).reshape(*x.shape[:2], K, -1, x.shape[-1])  # noqa: E731 - [B, T, K, G, E]
    q_, out_, d_out_ = f32(q), f32(out), f32(d_out)
    k_, v_ = (x.astype(jnp.float32) for x in (k, v))
    mask = prefix_spec(B, T, kv_len=kv_len, num_keys=k.shape[1], causal=causal, window=window).dense(k.shape[1])
    s = jnp.einsum("btkge,bske->bkgts", q_, k_) * scale
    p = jnp.where(mask[:, None, None], jnp.exp(s - jnp.transpose(lse.reshape(B, T, K, -1), (0, 2, 3, 1))[..., None]), 0)
    d_v = jnp.einsum("bkgts,btkge->bske", p, d_out_)
    d_p = jnp.einsum("btkge,bske->bkgts", d_out_, v_)
    d_s = p * (d_p - jnp.transpose(jnp.sum(d_out_ * out_, -1), (0, 2, 3, 1))[..., None])
    d_q = jnp.einsum("bkgts,bske->btkge", d_s, k_).reshape(B, T, H, E) * scale
    d_k = jnp.einsum("bkgts,btkge->bske", d_s, q_) * scale
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype)


def xla_paged_part(q, blocks_k, blocks_v, q_len, kv_len, tables, *, scale: float):
    """`_cudnn_paged`'s contract on the XLA path, from the binding's documentation: each sequence's blocks gathered
    through its table (the tests' stand-in for cuDNN's paged call)."""
    S, G, T, E = q.shape
    W, P = tables.shape[2], blocks_k.shape[2]
    keys = [x[tables[:, 0, :, 0]].reshape(S, W * P, 1, E) for x in (blocks_k, blocks_v)]  # [S, W, 1, P, E] -> slots
    out, lse = xla_part(jnp.swapaxes(q, 1, 2), *keys, kv_len, False, scale=scale)
    return jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2)


@functools.cache
def unavailable() -> str | None:
    """None when cuDNN attention with its log-sum-exp runs on the default device and `attention` through it
    matches the XLA path; otherwise why not. Probed once per process."""
    if jax.default_backend() not in ("gpu", "cuda"):
        return f"cuDNN attention needs an NVIDIA GPU (the default backend is {jax.default_backend()})"

    def check():
        B, T, C, H, K, E = 2, 128, 256, 4, 2, 64
        q, k, v = _probe_inputs(np.random.default_rng(0), B, T, C, H, K, E)
        spec = prefix_spec(B, T, q_offset=jnp.asarray([0, 100]), kv_len=jnp.asarray([T, 100 + T]), num_keys=C)
        err = _off_by(q, k, v, spec, k.astype(jnp.float32), v.astype(jnp.float32))
        if not err < 3e-2:
            return f"cuDNN attention through the log-sum-exp merge is off by {err:.2e} against the XLA path"
        return None

    return _probe(check)


@functools.cache
def paged_unavailable(page_size: int = 64, head_dim: int = 64, group: int = 2, dtype=jnp.bfloat16) -> str | None:
    """None when cuDNN's paged attention runs on the default device and `attention` over pages through it matches the
    XLA path for a chunk and a decode step (tables out of order, a "no page" entry, ragged lengths), with pages of
    `page_size` tokens, `head_dim` and `group` query heads per KV head in `dtype`; otherwise why not. Probed once per
    process and shape, apart from `unavailable`: the binding's paged call is the newer one."""

    def check():
        rng = np.random.default_rng(0)
        B, K, N, P, E = 2, 2, 8, page_size, head_dim
        tables = jnp.asarray([[5, 2, 7], [0, 6, N]], jnp.int32)  # 3 pages; the second sequence holds 2
        pages = [jnp.asarray(rng.standard_normal((K, N, P, E)), jnp.float32) for _ in range(2)]
        k, v = (PagedKV(x.astype(dtype), tables) for x in pages)
        for T, offsets in ((P, [P + P // 2, 0]), (1, [2 * P + P // 3, P + 1])):
            q = jnp.asarray(rng.standard_normal((B, T, K * group, E)), dtype)
            spec = prefix_spec(B, T, q_offset=jnp.asarray(offsets), kv_len=jnp.asarray(offsets) + T, num_keys=3 * P)
            err = _off_by(q, k, v, spec, *(PagedKV(x.pages.astype(jnp.float32), tables) for x in (k, v)))
            if not err < 3e-2:
                return f"cuDNN paged attention (T={T}) is off by {err:.2e} against the XLA path"
        return None

    return unavailable() or _probe(check)


@functools.cache
def gradient_unavailable() -> str | None:
    """None when `attention`'s gradient through cuDNN's backward (`merged`) matches the XLA path's for a chunk at an
    offset (two calls, a padding mask, a sequence with no prefix) and a whole sequence (one causal call); otherwise
    why not. Probed once per process: the backward binds the binding's internal primitive, whose operands JAX may
    change."""

    def check():
        rng = np.random.default_rng(1)
        B, T, H, K, E = 2, 128, 4, 2, 64
        q, k, v = _probe_inputs(rng, B, T, 2 * T, H, K, E)
        chunk = prefix_spec(B, T, q_offset=jnp.asarray([0, 100]), kv_len=jnp.asarray([T, 100 + T]), num_keys=2 * T)
        whole = prefix_spec(B, 2 * T, num_keys=2 * T)
        for name, queries, spec in (("a chunk", q, chunk), ("a whole sequence", jnp.concatenate([q, q], 1), whole)):
            err = _grad_off_by(queries, k, v, spec)
            if not err < 3e-2:
                return f"cuDNN attention's gradient ({name}) is off by {err:.2e} against the XLA path's"
        return None

    return unavailable() or _probe(check)


@functools.cache
def lambda_unavailable(at_offset: bool = False) -> str | None:
    """None when Λ through cuDNN matches the XLA path, forward and gradient, over a whole sequence (a sliding window,
    and the sinks before it: more queries than keys), or with `at_offset` for queries at offsets (`_lambda_calls`'
    four calls: gathered rows, keys in reverse order with lengths, no mask); otherwise why not. Probed once per
    process and case, apart from `gradient_unavailable`, so that Λ failing here does not take cuDNN's gradient from
    full attention."""

    def check():
        rng = np.random.default_rng(2)
        B, T, S, H, K, E = 3, 128 if at_offset else 256, 256, 4, 2, 64
        q, k, v = _probe_inputs(rng, B, T, S, H, K, E)
        # offsets: none before the queries; fewer than the window (a sink call's first rows); past the sinks
        offset = jnp.asarray([0, 40, 120]) if at_offset else 0
        spec = prefix_spec(B, T, q_offset=offset, num_keys=S, sink=16, recent=64)
        where = "at offsets" if at_offset else "over a whole sequence"
        return _first_off(
            f"Λ through cuDNN {where}",
            forward=lambda: _off_by(q, k, v, spec, k.astype(jnp.float32), v.astype(jnp.float32)),
            gradient=lambda: _grad_off_by(q, k, v, spec),
        )

    return gradient_unavailable() or _probe(check)


@functools.cache
def partial_unavailable() -> str | None:
    """None when `attention_with_lse` over a shard of the keys through cuDNN matches the XLA path's, output and
    log-sum-exp, for chunks that start before, inside and after the shard (gathered queries, a causal call with key
    lengths) and a decode step; otherwise why not. Probed once per process."""

    def check():
        B, T, S, H, K, E = 3, 128, 256, 4, 2, 64
        q, k, v = _probe_inputs(np.random.default_rng(4), B, T, S, H, K, E)
        offsets = jnp.asarray([-40, 100, 300])
        chunk = MaskSpec(offsets[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :], jnp.clip(offsets + T, 0, S))
        decode = MaskSpec(jnp.asarray([[-1], [150], [255]]), jnp.asarray([0, 151, 256]))
        err = 0.0
        for queries, spec in ((q, chunk), (q[:, :1], decode)):
            out, lse = jax.jit(attention_with_lse)(queries, k, v, spec)
            want, want_lse = jax.jit(xla.attention_with_lse)(*(x.astype(jnp.float32) for x in (queries, k, v)), spec)
            seen = want_lse > -1e30
            if not bool(jnp.all(seen == (lse > -1e30))):
                return "cuDNN attention over a shard of the keys sees other keys than the XLA path"
            err = max(err, float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want))))
            err = max(err, float(jnp.max(jnp.where(seen, jnp.abs(lse - want_lse), 0.0))))
        if not err < 3e-2:
            return f"cuDNN attention over a shard of the keys is off by {err:.2e} against the XLA path"
        return None

    return unavailable() or _probe(check)


@functools.cache
def window_unavailable() -> str | None:
    """None when a sliding window through cuDNN matches the XLA path: a chunk at offsets (none before it, fewer than
    the window, more), forward and gradient, and a decode step (positions near and past the window); otherwise why
    not. Probed once per process, apart from `gradient_unavailable`."""

    def check():
        rng = np.random.default_rng(3)
        B, T, S, H, K, E = 3, 128, 256, 4, 2, 64
        q, k, v = _probe_inputs(rng, B, T, S, H, K, E)
        offsets = jnp.asarray([0, 40, 120])
        chunk = prefix_spec(B, T, q_offset=offsets, kv_len=offsets + T, num_keys=S, window=64)
        decode = prefix_spec(B, 1, q_offset=jnp.asarray([3, 63, 200]), kv_len=jnp.asarray([4, 64, 201]), num_keys=S,
                             window=64)  # fmt: skip
        k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
        return _first_off(
            "a sliding window through cuDNN",
            forward=lambda: max(_off_by(q, k, v, chunk, k32, v32), _off_by(q[:, :1], k, v, decode, k32, v32)),
            gradient=lambda: _grad_off_by(q, k, v, chunk),
        )

    return gradient_unavailable() or _probe(check)


def _first_off(what: str, **checks: Callable[[], float]) -> str | None:
    """The checks' relative errors in order (forward, then gradient), stopping at the first one off: its reason, or
    None when every one is within 3e-2."""
    for name, off_by in checks.items():
        err = off_by()
        if not err < 3e-2:
            return f"{what} is off by {err:.2e} against the XLA path ({name})"
    return None


def _probe_inputs(rng, B, T, S, H, K, E):
    """bf16 q [B, T, H, E], k and v [B, S, K, E] of standard normals."""
    q = jnp.asarray(rng.standard_normal((B, T, H, E)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, E)), jnp.bfloat16) for _ in range(2))
    return q, k, v


def _probe(check: Callable[[], str | None]) -> str | None:
    """A probe's `check` run on concrete arrays, inside a trace too: its reason, or the reason of any exception it
    raises (a failure means: do not use the call here, and say why). `eval_context` leaves any trace for eager
    evaluation in which a `jax.jit` compiles (`ensure_compile_time_eval` would run it op by op: BENCHMARKS.md, "Test
    suite time")."""
    try:
        with jax.core.eval_context():
            return check()
    except Exception as e:  # noqa: BLE001 - any failure is a reason
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _grad_off_by(q, k, v, spec: MaskSpec) -> float:
    """The gradients of <`attention`, a random cotangent> through cuDNN against the XLA path's at the same (16-bit)
    inputs in float32: the largest max |error| / max of the three."""
    d_out = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, spec).astype(jnp.float32) * d_out)  # noqa: E731
    got = jax.jit(jax.grad(loss(attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(xla.attention), argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))
    return max(
        float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got, want, strict=True)
    )


def _off_by(q, k, v, spec: MaskSpec, k32, v32) -> float:
    """`attention` through cuDNN against the XLA path in float32 (k32 / v32: k / v in float32): max |error| / max."""
    got = jax.jit(attention)(q, k, v, spec).astype(jnp.float32)
    want = jax.jit(xla.attention)(q.astype(jnp.float32), k32, v32, spec)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))

"""Causal attention through cuDNN's fused attention (JAX's cuDNN binding) on a GPU: a prefill chunk or a decode step
over a contiguous or paged cache, or the streaming heads' ring followed by the chunk.

This is the path that needs no Pallas Triton backend (deprecated in JAX 0.11). It uses the library where it serves:
cuDNN's flash attention on Hopper is faster than this project's Triton flash kernel (BENCHMARKS.md, "Attention
kernels vs cuDNN").

Why two calls: JAX's binding aligns cuDNN's causal mask top-left (query i sees keys j <= i). That is the engine's
rule only for queries that start at position 0. A chunk at offset c sees the c cached keys whole and its own T keys
causally, so it runs as two calls:
- the chunk over the prefix: a padding mask, keys j < c, the cache read in place;
- the chunk over itself: causal with T = S, its T keys gathered from the cache.
The two are merged by their log-sum-exps (flash attention's rescaling). The log-sum-exp comes from the binding's
`return_residual`, which only its internal module exposes (`jax._src.cudnn.fused_attention_stablehlo`), so
`unavailable()` probes it once per process against the XLA path, and the dispatch keeps the Pallas kernels (or XLA)
where it fails. The binding's backward drops the log-sum-exp's cotangent, so a gradient through the merge would be
wrong: the dispatch (`duo_jax.attention.dispatch`) gives this path the gradient of the kernels it stands beside.

A paged cache (`PagedKV`) reads its prefix through the binding's paged attention (`paged_prefix`): each KV head is
a sequence of its own, so the head-major pool [K, N, P, E] is cuDNN's block container as it is, never copied.
JAX's own tests do not check that call's values, so `paged_unavailable()` probes it on its own, per page size, head
dim and group.
Design: docs/attention.md, "cuDNN for dense prefill chunks".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.attention import xla
from duo_jax.attention.masks import MaskSpec, prefix_spec
from duo_jax.attention.pages import PagedKV
from duo_jax.quant import QuantizedKV

DTYPES = (jnp.bfloat16, jnp.float16)  # cuDNN's flash attention: 16-bit inputs
MAX_HEAD_DIM = 128

# (q, k, v, kv_seqlen [B], causal) -> (out [B, T, H, E], natural log-sum-exp float32 [B, T, H]); scale is bound
Attend = Callable[..., tuple[jax.Array, jax.Array]]
# cuDNN's paged attention in its BNTH layout: (q [S, G, T, E], blocks_k / blocks_v [num_blocks, 1, P, E], q_seqlen
# [S], kv_seqlen [S], page_table int32 [S, 1, W, 1]) -> (out [S, G, T, E], log-sum-exp float32 [S, G, T]): sequence s
# reads block page_table[s, 0, w, 0] as its slots [w * P, (w + 1) * P), keys j < kv_seqlen[s] seen by every query;
# the binding checks that num_blocks = S * W. Scale is bound.
AttendPaged = Callable[..., tuple[jax.Array, jax.Array]]


def takes(q: jax.Array, k, v) -> bool:
    """16-bit values (no codes, no pages) of a head dim cuDNN's flash attention takes."""
    return not any(isinstance(x, (QuantizedKV, PagedKV)) for x in (k, v)) and _fits(q, k, v)


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
    `takes_pages`, or over a ring followed by the queries' own keys (`MaskSpec.own_keys_at`: the streaming heads),
    without Λ or a sliding window."""
    if takes_pages(q, k, v):
        return spec.causal and spec.k_positions is None and spec.window is None and not spec.is_lambda
    return (
        takes(q, k, v)
        and spec.causal
        and (spec.k_positions is None or spec.own_keys_at is not None)
        and spec.window is None
        and not spec.is_lambda
    )


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: MaskSpec,
    *,
    scale: float | None = None,
    attend: Attend | None = None,
    attend_paged: AttendPaged | None = None,
) -> jax.Array:
    """`serves`' cases through cuDNN: q [B, T, H, E] at positions q_offset + t (`spec.q_positions`, consecutive).
    Over a contiguous cache k / v [B, C, K, E] holding them at their positions (slots j < kv_len seen): a decode
    step (T = 1) is one call with a padding mask; a chunk sees the prefix [0, q_offset) whole and itself causally,
    two calls merged. Over a ring of R slots followed by the queries' own keys (`spec.own_keys_at` = R; the ring's
    filled slots first, every one before every query): the ring's filled slots whole and the own keys causally,
    two calls merged. Over pages (`PagedKV`), as over a contiguous cache, with the prefix read through the tables
    (`paged_prefix`) and a chunk's own keys gathered. `attend` runs one call and `attend_paged` one paged call
    (cuDNN by default; the tests pass the XLA path, `xla_part` and `xla_paged_part`)."""
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
        own_k, own_v = k.at_positions(positions), v.at_positions(positions)
        out, lse = attend(q, own_k, own_v, jnp.full((B,), T, jnp.int32), True)
        out_prefix, lse_prefix = paged(q_offset)
        return _merge(out, lse, out_prefix, lse_prefix, has_prefix=q_offset > 0).astype(q.dtype)
    if spec.k_positions is not None:  # a ring, then the queries' own keys
        ring = spec.own_keys_at
        prefix_k, prefix_v, prefix_len = k[:, :ring], v[:, :ring], jnp.sum(spec.k_positions[:, :ring] >= 0, axis=1)
        own_k, own_v = k[:, ring : ring + T], v[:, ring : ring + T]
    elif T == 1:
        return attend(q, k, v, spec.decode_lengths(), False)[0]
    else:
        q_offset = spec.q_positions[:, 0]
        prefix_k, prefix_v, prefix_len = k, v, q_offset
        # the chunk's own keys: rows q_offset + t (clipped: a row past the cache is a padding token no real row sees)
        rows = jnp.minimum(q_offset[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :], k.shape[1] - 1)
        own_k, own_v = (jnp.take_along_axis(x, rows[:, :, None, None], axis=1) for x in (k, v))
    out, lse = attend(q, own_k, own_v, jnp.full((B,), T, jnp.int32), True)
    if not prefix_k.shape[1]:
        return out
    out_prefix, lse_prefix = attend(q, prefix_k, prefix_v, prefix_len, False)
    return _merge(out, lse, out_prefix, lse_prefix, has_prefix=prefix_len > 0).astype(q.dtype)


def _merge(out_own, lse_own, out_prefix, lse_prefix, *, has_prefix: jax.Array) -> jax.Array:
    """Two softmaxes over disjoint keys as one, weighted by their log-sum-exps (float32 [B, T, H, E]). A sequence
    with no prefix key (has_prefix [B] False) weighs 0 there: cuDNN's rows over no key are not defined."""
    has_prefix = has_prefix[:, None, None]
    lse_prefix = jnp.where(has_prefix, lse_prefix, -jnp.inf)
    top = jnp.maximum(lse_prefix, lse_own)
    w_prefix, w_own = jnp.exp(lse_prefix - top), jnp.exp(lse_own - top)
    out_prefix = jnp.where(has_prefix[..., None], out_prefix.astype(jnp.float32), 0.0)
    total = out_prefix * w_prefix[..., None] + out_own.astype(jnp.float32) * w_own[..., None]
    return total / (w_prefix + w_own)[..., None]


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


def _cudnn(q, k, v, kv_len, causal: bool, *, scale: float):
    """One cuDNN call: keys j < kv_len [B] (and j <= i with `causal`, top-left), with its log-sum-exp."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    B, T = q.shape[:2]
    out, lse = cudnn.dot_product_attention(
        q,
        k,
        v,
        q_seqlen=jnp.full((B,), T, jnp.int32),
        kv_seqlen=kv_len.astype(jnp.int32),
        scale=scale,
        mask_type=cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING,
        qkv_layout="BTNH",
        return_residual=True,
    )
    return out, jnp.transpose(lse, (0, 2, 1))  # [B, H, T] -> [B, T, H]


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


def xla_part(q, k, v, kv_len, causal: bool, *, scale: float):
    """`_cudnn`'s contract on the XLA path: the tests' stand-in for cuDNN (`attention(attend=xla_part)`)."""
    B, T = q.shape[:2]
    spec = prefix_spec(B, T, kv_len=kv_len, num_keys=k.shape[1], causal=causal)
    return xla.attention_with_lse(q, k, v, spec, scale=scale)


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
    try:
        with jax.ensure_compile_time_eval():
            rng = np.random.default_rng(0)
            B, T, C, H, K, E = 2, 128, 256, 4, 2, 64
            q = jnp.asarray(rng.standard_normal((B, T, H, E)), jnp.bfloat16)
            k, v = (jnp.asarray(rng.standard_normal((B, C, K, E)), jnp.bfloat16) for _ in range(2))
            spec = prefix_spec(B, T, q_offset=jnp.asarray([0, 100]), kv_len=jnp.asarray([T, 100 + T]), num_keys=C)
            err = _off_by(q, k, v, spec, k.astype(jnp.float32), v.astype(jnp.float32))
            if not err < 3e-2:
                return f"cuDNN attention through the log-sum-exp merge is off by {err:.2e} against the XLA path"
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it here, and say why
        return _failure(e)
    return None


@functools.cache
def paged_unavailable(page_size: int = 64, head_dim: int = 64, group: int = 2, dtype=jnp.bfloat16) -> str | None:
    """None when cuDNN's paged attention runs on the default device and `attention` over pages through it matches the
    XLA path for a chunk and a decode step (tables out of order, a "no page" entry, ragged lengths), with pages of
    `page_size` tokens, `head_dim` and `group` query heads per KV head in `dtype`; otherwise why not. Probed once per
    process and shape, apart from `unavailable`: the binding's paged call is the newer one."""
    reason = unavailable()
    if reason is not None:
        return reason
    try:
        with jax.ensure_compile_time_eval():
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
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it here, and say why
        return _failure(e)
    return None


def _off_by(q, k, v, spec: MaskSpec, k32, v32) -> float:
    """`attention` through cuDNN against the XLA path in float32 (k32 / v32: k / v in float32): max |error| / max."""
    got = jax.jit(attention)(q, k, v, spec).astype(jnp.float32)
    want = xla.attention(q.astype(jnp.float32), k32, v32, spec)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _failure(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"

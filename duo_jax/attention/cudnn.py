"""Causal attention through cuDNN's fused attention (JAX's cuDNN binding) on a GPU: a prefill chunk or a decode step
over a contiguous cache, or the streaming heads' ring followed by the chunk.

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


def takes(q: jax.Array, k, v) -> bool:
    """16-bit values (no codes, no pages) of a head dim cuDNN's flash attention takes."""
    return (
        not any(isinstance(x, (QuantizedKV, PagedKV)) for x in (k, v))
        and q.dtype in DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= MAX_HEAD_DIM
    )


def serves(q: jax.Array, k, v, spec: MaskSpec) -> bool:
    """Causal queries (a chunk, or one per sequence: decode) over a contiguous cache cuDNN `takes`, or over a ring
    followed by the queries' own keys (`MaskSpec.own_keys_at`: the streaming heads), without Λ or a sliding
    window."""
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
) -> jax.Array:
    """`serves`' cases through cuDNN: q [B, T, H, E] at positions q_offset + t (`spec.q_positions`, consecutive).
    Over a contiguous cache k / v [B, C, K, E] holding them at their positions (slots j < kv_len seen): a decode
    step (T = 1) is one call with a padding mask; a chunk sees the prefix [0, q_offset) whole and itself causally,
    two calls merged. Over a ring of R slots followed by the queries' own keys (`spec.own_keys_at` = R; the ring's
    filled slots first, every one before every query): the ring's filled slots whole and the own keys causally,
    two calls merged. `attend` runs one call (cuDNN by default; the tests pass the XLA path, `xla_part`)."""
    B, T, H, E = q.shape
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    attend = functools.partial(attend or _cudnn, scale=scale)
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


def xla_part(q, k, v, kv_len, causal: bool, *, scale: float):
    """`_cudnn`'s contract on the XLA path: the tests' stand-in for cuDNN (`attention(attend=xla_part)`)."""
    B, T = q.shape[:2]
    spec = prefix_spec(B, T, kv_len=kv_len, num_keys=k.shape[1], causal=causal)
    return xla.attention_with_lse(q, k, v, spec, scale=scale)


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
            got = jax.jit(attention)(q, k, v, spec).astype(jnp.float32)
            want = xla.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), spec)
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            if not err < 3e-2:
                return f"cuDNN attention through the log-sum-exp merge is off by {err:.2e} against the XLA path"
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it here, and say why
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None

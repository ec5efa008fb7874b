"""The one place that picks an attention implementation.

`attend(q, k, v, spec, impl=...)` is every attention call of the model, the methods and gate training: q [B, T, H,
E], k / v [B, S, K, E] (arrays, `duo_jax.quant.QuantizedKV` codes or `duo_jax.attention.pages.PagedKV` pages),
`spec` a `duo_jax.attention.masks.MaskSpec`. `impl` is one of `IMPLS`: a kernel serves the specs it implements and
everything else takes the XLA path (`duo_jax.attention.xla`), so every impl gives the same result up to rounding.
"auto" resolves per backend (`resolve_impl`); where the kernel of that backend cannot run it falls back (to "xla",
or on a GPU without Triton to "cudnn") with one warning, and asking for that impl by name raises `BackendError`.
Callers pass consecutive query positions (q_positions[:, t] = q_positions[:, 0] + t). `attend_partial` (one shard
of the keys), `attend_received` (with each key's received attention, for H2O), `duo_decode` and `duo_prefill` (both
DuoAttention partitions in one launch) are the variants;
`flash_attention`, `lambda_attention` and `decode_attention` are the kernels' signatures over the same dispatch.
Which impl serves which spec, cache and device: docs/attention.md.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import jax
import jax.numpy as jnp

import pallas_kernels
import pallas_kernels.cpu
import pallas_kernels.tpu
from duo_jax.attention import cudnn, xla
from duo_jax.attention.masks import MaskSpec, prefix_spec
from duo_jax.attention.pages import PagedKV
from duo_jax.errors import BackendError
from duo_jax.quant import QuantizedKV, dequantize
from pallas_kernels import _backend, reference
from pallas_kernels._backend import backend as pallas_backend

Impl = Literal["auto", "pallas", "cudnn", "mosaic", "cpu", "xla", "reference"]
IMPLS = ("auto", "pallas", "cudnn", "mosaic", "cpu", "xla", "reference")
DECODE_BLOCK = 128  # split-K decode's key block (the cache capacity is a multiple of it)
MIN_SPLITS = 16  # split-K decode's chunks of the cache (the last may be ragged: any capacity gets ~16) ...
DECODE_PROGRAMS = 128  # ... or more, for a grid (batch x KV heads x splits) of about one program per SM
# "auto" on a GPU runs a prefill chunk over a cache of at least this many keys through cuDNN, and a mixed DuoAttention
# layer's chunk from CUDNN_MIN_KEYS_MIXED keys, its retrieval heads through cuDNN and its streaming heads through the
# flash kernel: each the faster path where both were measured (docs/attention.md, "cuDNN for dense prefill chunks")
CUDNN_MIN_KEYS = 16384
CUDNN_MIN_KEYS_MIXED = 32768
# ... and causal attention over a whole sequence (queries from position 0, as many as the keys: gate training, a
# forward over whole sequences) of at least this many tokens, forward and backward (docs/attention.md, "auto takes
# cuDNN for long chunks where Triton works")
CUDNN_MIN_SEQUENCE = 8192
# On a GPU each trip of the XLA path's loop over key tiles reads its predicate back to the host and launches a few
# kernels, so a decode step there (a quantized cache without Triton) scores tiles of up to this many slots: one
# tile, no loop, up to it (docs/attention.md, "The XLA path").
XLA_GPU_DECODE_TILE = 32768


def decode_splits(batch: int, num_kv_heads: int) -> int:
    """Split-K decode's number of key chunks: at least MIN_SPLITS, more when batch x KV heads is small, so that the
    grid has about DECODE_PROGRAMS programs and layers with few retrieval heads still fill the GPU."""
    return max(MIN_SPLITS, -(-DECODE_PROGRAMS // (batch * num_kv_heads)))


def resolve_impl(impl: str) -> str:
    """Maps "auto" to "pallas" on GPU (or, where Triton does not work, "cudnn" where cuDNN attention does, else
    "xla"), "mosaic" on TPU, "cpu" on CPU (or "xla" where the C++ kernel cannot be built) and "xla" elsewhere.
    "cudnn": dense prefill chunks through cuDNN (`duo_jax.attention.cudnn`), everything else as "pallas" where
    Triton works, else decode steps, paged caches and Λ through cuDNN too and the rest on the XLA path. "mosaic" on
    a GPU is "cudnn" apart from DuoAttention's decode step, which `duo_decode` serves in a Mosaic GPU kernel."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}.")
    backend = pallas_backend()  # the device's, or the platform being lowered for (`lowering_for`)
    on_gpu = backend == "gpu"
    resolved = (
        impl
        if impl != "auto"
        else ("pallas" if on_gpu else "mosaic" if backend == "tpu" else "cpu" if backend == "cpu" else "xla")
    )
    if resolved == "mosaic" and on_gpu:
        if not _backend.exporting() and (reason := _not_hopper()) is not None:
            raise BackendError(
                f"impl='mosaic' on a GPU runs a Pallas Mosaic GPU kernel for Hopper: {reason}. Use impl='auto'."
            )
        resolved = "cudnn"
    if resolved == "cudnn" and not _backend.exporting():
        reason = None if on_gpu else f"it runs on an NVIDIA GPU, not on {backend}"
        reason = reason or cudnn.unavailable()
        if reason is not None:
            raise BackendError(f"impl='cudnn' cannot run here: {reason}. Use impl='auto'.")
    if resolved == "pallas" and on_gpu and not _backend.exporting():
        reason = _backend.triton_unavailable()
        if reason is not None:
            return _triton_fallback(reason, forced=impl == "pallas")
    if resolved == "cpu":
        if backend != "cpu":
            raise BackendError(f"impl='cpu' runs the C++ kernel of XLA:CPU, not on {backend}: use impl='auto'.")
        if not pallas_kernels.cpu.available():
            return _cpu_fallback(pallas_kernels.cpu.unavailable(), forced=impl == "cpu")
    return resolved


def _not_hopper() -> str | None:
    """Why the GPU cannot run the Mosaic GPU kernel (its `wgmma` is Hopper's, compute capability 9.x), or None."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        if capability is not None and 9.0 <= float(capability) < 10.0:
            return None
    except ValueError:
        pass
    return f"this {jax.devices()[0].device_kind} has compute capability {capability}, not Hopper's 9.x"


@functools.cache
def _cpu_fallback(reason: str, *, forced: bool) -> str:
    """What "cpu" becomes where the C++ kernel cannot be built or loaded (warned once per reason)."""
    if forced:
        raise BackendError(
            f"impl='cpu' needs the C++ attention kernel, which cannot run here: {reason}. Install a "
            f"C++ compiler (g++), or use impl='auto' / impl='xla' (the XLA path)."
        )
    warnings.warn(
        f"the C++ CPU attention kernel cannot run here ({reason}): attention runs on the XLA path "
        f"(impl='xla'), which is slower on CPU. Install a C++ compiler (g++) to enable the kernel.",
        RuntimeWarning,
        stacklevel=3,
    )
    return "xla"


@functools.cache
def _triton_fallback(reason: str, *, forced: bool) -> str:
    """What "pallas" on a GPU without a working Triton backend becomes (warned once per reason): "cudnn" where
    cuDNN attention works (prefill chunks and decode steps there, the rest on the XLA path), else "xla"."""
    if forced:
        raise BackendError(
            f"impl='pallas' needs Pallas's Triton backend, which does not work with this JAX "
            f"({jax.__version__}) on this GPU: {reason}. Use impl='auto' (falls back to cuDNN or the "
            f"XLA path), impl='cudnn' or impl='xla'."
        )
    fallback = "xla" if cudnn.unavailable() else "cudnn"
    warnings.warn(
        f"Pallas's Triton backend does not work with this JAX ({jax.__version__}) on this GPU "
        f"({reason}): attention runs "
        + (
            "on the XLA path (impl='xla')"
            if fallback == "xla"
            else "through cuDNN for prefill chunks, decode steps, paged caches and gate training, and on the XLA "
            "path otherwise (impl='cudnn')"
        )
        + " instead of the Pallas kernels.",
        RuntimeWarning,
        stacklevel=3,
    )
    return fallback


def _without_cudnn(impl: str) -> str:
    """A resolved impl for what cuDNN does not serve: "cudnn" becomes "pallas" where Triton works, else "xla"."""
    if impl != "cudnn":
        return impl
    return "pallas" if _backend.exporting() or _backend.triton_unavailable() is None else "xla"


def _cudnn_for_a_long_cache(impl: str, q: jax.Array, k, v, *, min_keys: int | None = None) -> bool:
    """Whether "auto", resolved to the Triton kernels, takes cuDNN instead: a prefill chunk over a cache of at least
    `min_keys` (CUDNN_MIN_KEYS) keys (longer than the chunk: a whole sequence is `_cudnn_for_a_sequence`'s), values
    cuDNN takes, and cuDNN's probe passed."""
    return (
        impl == "pallas"
        and 1 < q.shape[1] < k.shape[1]
        and k.shape[1] >= (CUDNN_MIN_KEYS if min_keys is None else min_keys)
        and not _backend.exporting()
        and cudnn.takes(q, k, v)
        and cudnn.unavailable() is None
    )


def _cudnn_for_a_sequence(impl: str, q: jax.Array, k, v, spec: MaskSpec) -> bool:
    """Whether "auto", resolved to the Triton kernels, takes cuDNN instead for causal attention over a whole
    sequence of at least CUDNN_MIN_SEQUENCE tokens (one cuDNN call), values cuDNN takes, and cuDNN's probe passed.
    Its gradient is cuDNN's backward, or, where that probe fails, the Triton kernels' (`cudnn_attention`: a forward
    alone never probes it). (Λ keeps the Triton kernel.)"""
    return (
        impl == "pallas"
        and q.shape[1] == k.shape[1] >= CUDNN_MIN_SEQUENCE
        and spec.static_prefix == (0, k.shape[1])
        and spec.causal
        and spec.k_positions is None
        and spec.window is None
        and not spec.is_lambda
        and not _backend.exporting()
        and cudnn.takes(q, k, v)
        and cudnn.unavailable() is None
    )


def _cudnn_for_a_window(impl: str, q: jax.Array, k, v, spec: MaskSpec) -> bool:
    """Whether "auto", resolved to the Triton kernels, takes cuDNN instead for a sliding window (Mistral, Qwen),
    which those kernels do not serve: cuDNN where it serves the call and its window probe passed, not the XLA
    path."""
    return (
        impl == "pallas"
        and spec.window is not None
        and not _backend.exporting()
        and cudnn.serves(q, k, v, spec)
        and cudnn.unavailable() is None
    )


def _cudnn_serves(q: jax.Array, k, v, spec: MaskSpec, *, alone: bool) -> bool:
    """Whether "cudnn" runs this call through cuDNN: a dense prefill chunk, and a sliding window where its probe
    passed, always; a decode step, a ring, pages, codes and Λ only `alone`, where Triton does not work (where it
    does, its kernels serve them), pages and Λ where their probes passed."""
    if not cudnn.serves(q, k, v, spec):
        return False
    if spec.window is not None:  # no kernel serves a sliding window: cuDNN, Triton or not
        return cudnn.window_unavailable() is None
    if isinstance(k, QuantizedKV):
        return alone
    if spec.is_lambda:
        return alone and cudnn.lambda_unavailable(at_offset=not cudnn.whole_sequence(q, k, spec)) is None
    if isinstance(k, PagedKV):
        return alone and cudnn.paged_unavailable(k.page_size, q.shape[-1], q.shape[2] // k.shape[2], q.dtype) is None
    return alone or (q.shape[1] > 1 and spec.k_positions is None)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, spec: MaskSpec, *, impl: Impl = "auto", scale: float | None = None
) -> jax.Array:
    """q [B, T, H, E], k / v [B, S, K, E] (H a multiple of K) -> [B, T, H, E] under `spec`."""
    pallas_kernels.check_qkv(q, k, v)
    requested, impl = impl, resolve_impl(impl)
    if requested == "auto" and spec.k_positions is None and _cudnn_for_a_long_cache(impl, q, k, v):
        impl = "cudnn"
    if requested == "auto" and _cudnn_for_a_sequence(impl, q, k, v, spec):
        impl = "cudnn"
    if requested == "auto" and _cudnn_for_a_window(impl, q, k, v, spec):
        impl = "cudnn"
    if impl == "cudnn":
        rest = _without_cudnn(impl)
        if _cudnn_serves(q, k, v, spec, alone=rest == "xla"):
            return cudnn_attention(q, k, v, spec, scale=scale, backward_impl=rest)
        impl = rest
    if impl in ("pallas", "mosaic") and _kernels_serve(spec, k, v, impl):
        return _kernels(q, k, v, spec, scale, impl)
    if impl == "cpu" and _cpu_kernel_serves(q, k, v, spec):
        return _cpu_attention(q, k, v, spec, scale)
    if impl == "reference":
        return reference.attention_reference(q, _values(k), _values(v), spec.dense(k.shape[1]), scale=scale)
    return xla.attention(q, k, v, spec, scale=scale, **_xla_tiles(q, k, spec))


def _xla_tiles(q: jax.Array, k, spec: MaskSpec) -> dict:
    """The XLA path's key tiles: its defaults, but XLA_GPU_DECODE_TILE slots for a decode step on a GPU (without
    a sliding window, whose few tiles near the query the default tiles keep small)."""
    if _backend.on_gpu() and q.shape[1] == 1 and spec.window is None:
        return dict(block_k=min(k.shape[1], XLA_GPU_DECODE_TILE))
    return {}


def attend_received(
    q: jax.Array, k: jax.Array, v: jax.Array, spec: MaskSpec, weights: jax.Array, *, impl: Impl = "auto"
) -> tuple[jax.Array, jax.Array] | None:
    """`attend` over keys at positions (`spec.k_positions`), and the attention each key receives: weights float32
    [B, T] -> (out [B, T, H, E], received float32 [B, K, S]: the probabilities weighted by their query's weight,
    summed over the queries and each KV head's query heads), from a kernel that never materialises them; None
    where none serves the call (the C++ CPU kernel alone computes it), for `duo_jax.attention.attention_received`.
    Not differentiable (H2O's scores are for inference)."""
    pallas_kernels.check_qkv(q, k, v)
    if resolve_impl(impl) == "cpu" and spec.k_positions is not None and _cpu_kernel_serves(q, k, v, spec):
        return pallas_kernels.cpu.flash_attention_received(
            q, k, v, spec.q_positions[:, 0], spec.kv_len, spec.k_positions, weights
        )
    return None


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    spec: MaskSpec,
    *,
    scale: float | None,
    backward_impl: str,
    attend_part: cudnn.Attend | None = None,
) -> jax.Array:
    """`cudnn.attention`, differentiable. Where a gradient is taken, it is cuDNN's backward if its probe passed
    (`cudnn.gradient_unavailable`, run only then: a forward alone never probes it), else `attend`'s under
    `backward_impl` ("pallas" or "xla"), recomputed from q, k and v. `attend_part` stands in for the cuDNN call
    (tests)."""

    def run(q, k, v, spec):
        return cudnn.attention(q, k, v, spec, scale=scale, attend=attend_part)

    if _backend.exporting():
        return run(q, k, v, spec)

    @jax.custom_vjp
    def forward(q, k, v, spec):
        return run(q, k, v, spec)

    def forward_with_residuals(q, k, v, spec):
        if cudnn.gradient_unavailable() is None:  # cuDNN's backward, from this forward's residuals
            out, vjp = jax.vjp(lambda q, k, v: run(q, k, v, spec), q, k, v)
            return out, (vjp, None, spec)
        return run(q, k, v, spec), (None, (q, k, v), spec)

    def backward(residuals, d_out):
        vjp, inputs, spec = residuals
        if vjp is None:  # recomputed on the kernels cuDNN stands beside
            _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, spec, impl=backward_impl, scale=scale), *inputs)
        return (*vjp(d_out), jax.tree.map(cudnn.zero_cotangent, spec))

    forward.defvjp(forward_with_residuals, backward)
    return forward(q, k, v, spec)


def _values(x) -> jax.Array:
    """A contiguous cache of values: pages gathered, codes dequantized (for the dense reference)."""
    return x.contiguous() if isinstance(x, PagedKV) else dequantize(x)


def attend_partial(
    q: jax.Array, k: jax.Array, v: jax.Array, spec: MaskSpec, *, impl: Impl = "auto", scale: float | None = None
) -> tuple[jax.Array, jax.Array]:
    """`attend` over one shard of the keys: (out [B, T, H, E], log-sum-exp float32 [B, T, H]), to be merged
    with the other shards' (`duo_jax.sharding.merge_partials`). A decode step (one query per sequence) over a
    contiguous cache runs the Pallas split-K kernel where `impl` resolves to "pallas", or to "cudnn" where Triton
    works (it returns its log-sum-exp); under "auto" or "cudnn" a causal chunk over 16-bit values (and a decode
    step without Triton) goes through cuDNN (`cudnn.attention_with_lse`); everything else takes the blocked XLA
    path (the flash, Λ and TPU kernels do not return theirs yet)."""
    pallas_kernels.check_qkv(q, k, v)
    resolved = resolve_impl(impl)
    contiguous = not isinstance(k, (QuantizedKV, PagedKV)) and not isinstance(v, (QuantizedKV, PagedKV))
    if (
        _without_cudnn(resolved) == "pallas"
        and contiguous
        and q.shape[1] == 1
        and spec.causal
        and spec.k_positions is None
        and spec.window is None
        and not spec.is_lambda
    ):
        lengths = jnp.clip(spec.decode_lengths(), 0, k.shape[1])
        out, lse = pallas_kernels.decode_attention(
            q[:, 0],
            k,
            v,
            lengths,
            scale=scale,
            block_k=DECODE_BLOCK,
            num_splits=decode_splits(k.shape[0], k.shape[2]),
            return_lse=True,
        )
        return out[:, None], lse[:, None]
    if (
        impl in ("auto", "cudnn")
        and resolved in ("pallas", "cudnn")
        and not _backend.exporting()
        and cudnn.serves_partial(q, k, v, spec)
        and cudnn.partial_unavailable() is None
    ):
        return cudnn.attention_with_lse(q, k, v, spec, scale=scale)
    return xla.attention_with_lse(q, k, v, spec, scale=scale)


def duo_decode(
    q: jax.Array,
    k,
    v,
    lengths: jax.Array,
    ring_k,
    ring_v,
    ring_lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    *,
    kv_order: tuple[int, ...],
    ring_slots: jax.Array | None = None,
    cache_slots: jax.Array | None = None,
    impl: Impl = "auto",
    scale: float | None = None,
) -> tuple[jax.Array, ...] | None:
    """DuoAttention's decode step over both partitions in one kernel, where one serves it, which also writes the new
    token into both caches: q [B, 1, H, E] and the new token's k_new / v_new [B, 1, K, E] in the model's head order;
    the retrieval cache k / v [B, C, n, E] (or `PagedKV` pools read and written through their tables), keys j <
    lengths [B] seen there plus the new token, which the kernel writes at cache_slots [B] (C or more, or no page
    there: not kept); the ring ring_k / ring_v [B, S, K - n, E], slots j < ring_lengths [B] seen plus the new token,
    which the kernel writes at ring_slots [B] after reading the ring (S or more: not kept); `kv_order`, the model's
    KV heads in the caches' order (the layer's `CacheLayout.kv_order`): the kernel routes each head to its cache, so
    nothing is gathered around it. The caches are updated in place (outputs aliased to them). Without the slots the
    kernel writes neither cache: the retrieval cache then already holds the new token (keys j < lengths), and the
    caller writes the ring. Returns (output [B, 1, H, E] in the model's head order, ring k, ring v, cache k, cache
    v) (pools when paged), or None where no kernel serves it: the caller then writes the caches and attends each
    partition with `attend`. The kernels: Triton's ("pallas", or "cudnn" where Triton works; bf16 / fp32 values,
    both partitions non-empty, a ring tiled by a power-of-two block, pages of a power-of-two size), or with
    impl="mosaic" on a GPU and no slots, Pallas Mosaic GPU's (`_mosaic_gpu_decode`). The new token counts on every
    row, so a padding row's output (never read) differs from `attend`'s."""
    if impl == "mosaic":
        if ring_slots is not None or cache_slots is not None:
            return None  # the Mosaic GPU kernel writes no cache
        out = _mosaic_gpu_decode(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new, kv_order=kv_order)
        return None if out is None else (out, ring_k, ring_v, k, v)
    paged = isinstance(k, PagedKV) and isinstance(v, PagedKV)
    if paged and k.page_size & (k.page_size - 1) == 0:
        retrieval = dict(k=k.pages, v=v.pages, block_tables=k.block_tables)
    elif not any(isinstance(x, (QuantizedKV, PagedKV)) for x in (k, v)) and k.shape[1] % DECODE_BLOCK == 0:
        retrieval = dict(k=k, v=v)
    else:
        return None
    if (
        q.shape[1] != 1
        or not k.shape[2]
        or not ring_k.shape[2]
        or isinstance(ring_k, (QuantizedKV, PagedKV))
        or pallas_kernels._common.exact_block(ring_k.shape[1]) is None
        or _without_cudnn(resolve_impl(impl)) != "pallas"
    ):
        return None
    out = pallas_kernels.duo_decode_attention(
        q[:, 0],
        lengths=lengths,
        ring_k=ring_k,
        ring_v=ring_v,
        ring_lengths=ring_lengths,
        k_new=k_new[:, 0],
        v_new=v_new[:, 0],
        kv_order=tuple(kv_order),
        ring_slots=ring_slots,
        cache_slots=cache_slots,
        scale=scale,
        block_k=DECODE_BLOCK,
        num_splits=decode_splits(q.shape[0], k.shape[2]),
        **retrieval,
    )
    if ring_slots is None and cache_slots is None:
        return out[:, None], ring_k, ring_v, k, v
    return (out[0][:, None], *out[1:])


def _mosaic_gpu_decode(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new, *, kv_order):
    """`duo_decode` without slots in the Pallas Mosaic GPU kernel (`pallas_kernels.mosaic_gpu`): the output [B, 1, H,
    E], or None where it does not serve the step (not a GPU, one kind of head, quantized or paged caches, or what
    the kernel's `unsupported` names: values other than bf16 / fp16, a head dim whose tiles do not fit shared memory
    (above 128), more than 64 query heads per KV head, a ring or a cache not a multiple of 64 slots)."""
    if (
        not _backend.on_gpu()
        or q.shape[1] != 1
        or any(isinstance(x, (QuantizedKV, PagedKV)) for x in (k, v, ring_k, ring_v))
        or not k.shape[2]
        or not ring_k.shape[2]
        or pallas_kernels.mosaic_gpu.unsupported(q, k, v, ring_k, ring_v, kv_order=kv_order) is not None
    ):
        return None
    out = pallas_kernels.mosaic_gpu.duo_decode_attention(
        q[:, 0],
        k,
        v,
        lengths,
        ring_k,
        ring_v,
        ring_lengths,
        k_new[:, 0].astype(q.dtype),
        v_new[:, 0].astype(q.dtype),
        kv_order=tuple(kv_order),
        num_splits=decode_splits(q.shape[0], k.shape[2]),
    )
    return out[:, None]


def duo_prefill(
    q: jax.Array,
    k,
    v,
    window_k,
    window_v,
    window_positions: jax.Array,
    *,
    kv_order: tuple[int, ...],
    q_offset: jax.Array,
    kv_len: jax.Array,
    impl: Impl = "auto",
    scale: float | None = None,
) -> jax.Array | None:
    """DuoAttention's prefill chunk over both partitions in one kernel, where one serves it: q [B, T, H, E] in the
    model's head order, query t at position q_offset [B] + t; the retrieval cache k / v [B, C, n, E] holding the
    chunk, keys j < kv_len [B] seen causally; the streaming heads' window_k / window_v [B, R + T, K - n, E] (their
    ring, every slot before the chunk, then the chunk's keys) at window_positions [B, R + T] (-1: empty); `kv_order`
    as `duo_decode`'s. Returns the output [B, T, H, E] in the model's head order, or None where no kernel serves it
    ("pallas" only, values (no codes, no pages), both partitions non-empty; under "auto" not over a retrieval cache
    of CUDNN_MIN_KEYS_MIXED keys or more, where its heads go through cuDNN): the caller then attends each partition
    with `attend`."""
    resolved = resolve_impl(impl)
    if (
        q.shape[1] == 1
        or any(isinstance(x, (QuantizedKV, PagedKV)) for x in (k, v, window_k, window_v))
        or not k.shape[2]
        or not window_k.shape[2]
        or resolved != "pallas"
        or (impl == "auto" and _cudnn_for_a_long_cache(resolved, q, k, v, min_keys=CUDNN_MIN_KEYS_MIXED))
    ):
        return None
    return pallas_kernels.duo_prefill_attention(
        q,
        k,
        v,
        window_k,
        window_v,
        window_positions,
        kv_order=tuple(kv_order),
        q_offset=q_offset,
        kv_len=kv_len,
        scale=scale,
    )


def _kernels_serve(spec: MaskSpec, k, v, impl: str) -> bool:
    if spec.window is not None:
        return False
    if isinstance(k, PagedKV) or isinstance(v, PagedKV):  # the paged kernels (docs/attention.md)
        if not (
            isinstance(k, PagedKV)
            and isinstance(v, PagedKV)
            and spec.causal
            and spec.k_positions is None
            and not spec.is_lambda
        ):
            return False
        if impl == "pallas":  # Triton's power-of-two tensor shapes: a key block is [pages, P, E]
            return k.page_size & (k.page_size - 1) == 0
        return (
            spec.q_positions.shape[1] == 1 and k.dtype == jnp.bfloat16 and k.shape[-1] % pallas_kernels.tpu.LANES == 0
        )
    quantized = isinstance(k, QuantizedKV) or isinstance(v, QuantizedKV)
    if quantized and not (isinstance(k, QuantizedKV) and isinstance(v, QuantizedKV) and k.kind == v.kind):
        return False  # the kernels take one kind of codes for both
    if spec.k_positions is not None:  # the flash kernels' k_positions operand (causal, no Λ)
        return spec.causal and not spec.is_lambda
    decode = spec.q_positions.shape[1] == 1 and k.shape[1] % DECODE_BLOCK == 0
    if spec.is_lambda:  # (gate training: values, never a cache) the Λ kernels see every key slot
        return spec.causal and not quantized and spec.every_key
    return spec.causal and (spec.q_positions.shape[1] > 1 or decode)


def _cpu_kernel_serves(q, k, v, spec: MaskSpec) -> bool:
    """Float32 values (no codes, no pages) under a causal mask with offsets, key lengths and key positions."""
    values = not isinstance(k, (QuantizedKV, PagedKV)) and not isinstance(v, (QuantizedKV, PagedKV))
    return (
        values
        and spec.causal
        and spec.window is None
        and not spec.is_lambda
        and all(x.dtype == jnp.float32 for x in (q, k, v))
        and q.shape[-1] % 8 == 0
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cpu_attention(q, k, v, spec: MaskSpec, scale):
    """The C++ kernel forward; its gradient is the XLA path's (recomputed from q, k and v: training on CPU is
    for tests and demonstrations, the kernel for inference)."""
    return pallas_kernels.cpu.flash_attention(
        q, k, v, spec.q_positions[:, 0], spec.kv_len, k_positions=spec.k_positions, scale=scale
    )


def _cpu_attention_fwd(q, k, v, spec, scale):
    return _cpu_attention(q, k, v, spec, scale), (q, k, v, spec)


def _cpu_attention_bwd(scale, residuals, d_out):
    q, k, v, spec = residuals
    _, vjp = jax.vjp(lambda q, k, v: xla.attention(q, k, v, spec, scale=scale), q, k, v)
    return (*vjp(d_out), None)


_cpu_attention.defvjp(_cpu_attention_fwd, _cpu_attention_bwd)


def _kernels(q, k, v, spec: MaskSpec, scale, impl: str):
    if impl == "pallas":
        kernels, options = pallas_kernels, {}
    else:  # off TPU, the generic interpreter: TPU interpret mode cannot run under jax.checkpoint (gate training)
        kernels, options = pallas_kernels.tpu, {"interpret": None if pallas_backend() == "tpu" else True}
    # Python ints where the caller gave them (TPU: splash attention's static mask), else int32 [B]
    q_offset, kv_len = spec.static_prefix or (spec.q_positions[:, 0], spec.kv_len)
    if isinstance(k, QuantizedKV):  # codes and scales, dequantized tile by tile in the kernel (never Λ)
        k, v, options = k.codes, v.codes, dict(options, k_scale=k.scale, v_scale=v.scale, kv_quant=k.kind)
    if spec.k_positions is not None:  # a decode step is a chunk of one; the GPU kernel takes q's offset
        queries = (
            dict(q_positions=spec.q_positions)
            if impl == "mosaic"
            else dict(q_offset=spec.q_positions[:, 0], key_offset=spec.own_keys_at)
        )
        return kernels.flash_attention(
            q, k, v, causal=True, kv_len=kv_len, scale=scale, k_positions=spec.k_positions, **queries, **options
        )
    if isinstance(k, PagedKV):  # pages read through the block tables (`_kernels_serve`)
        if q.shape[1] > 1:  # "pallas" only: a prefill chunk over pages
            return pallas_kernels.paged_flash_attention(
                q, k.pages, v.pages, k.block_tables, q_offset=spec.q_positions[:, 0], kv_len=spec.kv_len, scale=scale
            )
        lengths = spec.decode_lengths()
        if impl == "pallas":
            options = dict(num_splits=decode_splits(q.shape[0], k.pages.shape[0]))
        return kernels.paged_decode_attention(
            q[:, 0], k.pages, v.pages, k.block_tables, lengths, scale=scale, **options
        )[:, None]
    if spec.is_lambda:  # the Λ kernel sees every key slot (gate training: no cache)
        return kernels.lambda_attention(
            q, k, v, sink=spec.sink, recent=spec.recent, q_offset=q_offset, scale=scale, **options
        )
    if q.shape[1] == 1:  # split-K over the cache, skipping blocks past each sequence's length
        lengths = spec.decode_lengths()
        splits = decode_splits(q.shape[0], k.shape[2]) if impl == "pallas" else MIN_SPLITS  # TPU: sequential
        return kernels.decode_attention(
            q[:, 0], k, v, lengths, scale=scale, block_k=DECODE_BLOCK, num_splits=splits, **options
        )[:, None]
    return kernels.flash_attention(q, k, v, causal=True, q_offset=q_offset, kv_len=kv_len, scale=scale, **options)


# --- the kernels' signatures over the dispatch ---------------------------------------------------------


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    q_offset=0,
    kv_len=None,
    window: int | None = None,
    scale: float | None = None,
    impl: Impl = "auto",
) -> jax.Array:
    """Dense (causal) attention. q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D].

    Query i sits at position q_offset + i (int, int32 scalar or [B]); keys j >= kv_len (None = S, int, int32
    scalar or [B]) are masked, and with a sliding `window` keys j <= position - window too (the XLA path).
    """
    spec = prefix_spec(
        q.shape[0], q.shape[1], q_offset=q_offset, kv_len=kv_len, num_keys=k.shape[1], causal=causal, window=window
    )
    return attend(q, k, v, spec, impl=impl, scale=scale)


def lambda_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    sink: int,
    recent: int,
    q_offset=0,
    window: int | None = None,
    scale: float | None = None,
    impl: Impl = "auto",
) -> jax.Array:
    """Streaming heads' attention: position p sees key j iff j <= p and (j < sink or p - j < recent), and
    p - j < window with a sliding `window` (the model's; then the XLA path)."""
    pallas_kernels.check_window(sink, recent)
    spec = prefix_spec(
        q.shape[0], q.shape[1], q_offset=q_offset, num_keys=k.shape[1], window=window, sink=sink, recent=recent
    )
    return attend(q, k, v, spec, impl=impl, scale=scale)


def decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, scale: float | None = None, impl: Impl = "auto"
) -> jax.Array:
    """One query per sequence over a cache: q [B, Hq, D], k/v [B, S, Hkv, D]; sequence b sees keys j < lengths[b]."""
    pallas_kernels.check_qkv(q, k, v, q_ndim=3)
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32).reshape(-1), (q.shape[0],))
    spec = prefix_spec(q.shape[0], 1, q_offset=lengths - 1, kv_len=lengths, num_keys=k.shape[1])
    return attend(q[:, None], k, v, spec, impl=impl, scale=scale)[:, 0]

"""Absmax quantization: int8 / int4 KV-cache blocks and int8 weights, with the scales kept beside the codes.

`quantize_kv` stores each token's key (or value) of each head as codes `round(x / scale)` in [-qmax, qmax] with
one bf16 scale `max|x| / qmax` rounded up (qmax 127 for int8, 7 for int4; int4 packed two per byte, element j low
and j + E/2 high), so |x - dequantize(quantize(x))| <= scale / 2. A `QuantizedKV` stands in for the cache array it
replaces (`.shape` and `.dtype` are the dequantized array's); attention reads it one tile at a time. Methods store
keys and values through `kv_rotation`. `QuantizedWeight` is int8 per output channel; `einsum` is the model's one
matmul over either. Design: docs/quantization.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.errors import DuoJaxError
from pallas_kernels._common import dequantize_tile, unpack_int4_halves

KV_DTYPES = ("int8", "int4")
QMAX = {"int8": 127, "int4": 7}
KV_SCALE_DTYPE = jnp.bfloat16


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


def check_kv_dtype(kv_dtype: str | None) -> str | None:
    """None (the model's dtype), "int8" or "int4"; anything else raises."""
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise DuoJaxError(f"kv_dtype must be None (the model's dtype), 'int8' or 'int4', got {kv_dtype!r}")
    return kv_dtype


def absmax_scale(x: jax.Array, axes, qmax: int, dtype) -> jax.Array:
    """max|x| / qmax over `axes` (kept as size 1), in `dtype`, rounded up so that |x| / scale <= qmax."""
    exact = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True) / qmax
    scale = exact.astype(dtype)
    return jnp.where(scale.astype(jnp.float32) < exact, jnp.nextafter(scale, jnp.asarray(jnp.inf, dtype)), scale)


def _codes(x: jax.Array, scale: jax.Array, qmax: int) -> jax.Array:
    scale = scale.astype(jnp.float32)
    q = jnp.round(x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0))
    return jnp.clip(q, -qmax, qmax).astype(jnp.int8)


def pack_int4(codes: jax.Array) -> jax.Array:
    """int8 codes in [-8, 7], [..., E] -> [..., E/2]: element j in the low nibble, j + E/2 in the high one."""
    low, high = jnp.split(codes, 2, axis=-1)
    return (low & 0x0F) | (high << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """The inverse of `pack_int4`: the nibble halves as the kernels read them (`unpack_int4_halves`, arithmetic
    shifts restore the signs), concatenated."""
    return jnp.concatenate(unpack_int4_halves(packed), axis=-1).astype(jnp.int8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedKV:
    """Quantized keys or values standing in for a [..., E] array of `dtype`."""

    codes: jax.Array  # int8 [..., E] ("int8") or [..., E/2] ("int4", two per byte)
    scale: jax.Array  # bfloat16 [..., 1]: one per token and head
    kind: str = _static()
    dtype: str = _static()  # what it dequantizes to (the model's dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        last = self.codes.shape[-1] * (2 if self.kind == "int4" else 1)
        return self.codes.shape[:-1] + (last,)

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    def dequantize(self) -> jax.Array:
        """codes * scale in float32, rounded once to `dtype`: the kernels' `dequantize_tile` over any shape."""
        return jnp.concatenate(dequantize_tile(self.codes, self.scale, self.kind, self.dtype), axis=-1)


def quantize_kv(x: jax.Array, kind: str, dtype=None) -> QuantizedKV:
    """x [..., E] -> absmax codes along E, one scale per [...] (dequantizing to `dtype`, default x's)."""
    if check_kv_dtype(kind) is None:
        raise DuoJaxError(f"quantize_kv quantizes to 'int8' or 'int4', got kind={kind!r}")
    qmax = QMAX[kind]
    x = jnp.asarray(x)
    for what, kind_of in (("x", x.dtype), ("dtype", jnp.dtype(dtype or x.dtype))):
        if not jnp.issubdtype(kind_of, jnp.floating):  # integers were truncated to codes of their own values
            raise DuoJaxError(f"quantize_kv takes floating keys / values and dtype; {what} is {kind_of}")
    if kind == "int4" and x.shape[-1] % 2:
        raise DuoJaxError(
            f"int4 packs two codes per byte along the head dimension, which must be even; got {x.shape[-1]}"
        )
    scale = absmax_scale(x, -1, qmax, KV_SCALE_DTYPE)
    codes = _codes(x, scale, qmax)
    return QuantizedKV(pack_int4(codes) if kind == "int4" else codes, scale, kind, jnp.dtype(dtype or x.dtype).name)


def kv_rotation(head_dim: int) -> np.ndarray:
    """The orthonormal [E, E] matrix R that quantized caches store keys and values through (k R, v R).

    Per-token absmax wastes int4's 15 levels when a few channels carry outliers; the rotation spreads them over
    the head dimension (BENCHMARKS.md, "Quantized KV cache: the quality cost"). Attention is unchanged in exact
    arithmetic: the query is rotated the same way, (q R)(k R)^T = q k^T, and the output rotated back,
    (p v R) R^T = p v, so the cache is read tile by tile as before (QuaRot's incoherence processing). A
    Sylvester Hadamard matrix / sqrt(E) when E is a power of two (every supported model's head dimension), else
    a fixed random orthogonal one."""
    if head_dim & (head_dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < head_dim:
            h = np.block([[h, h], [h, -h]])
        return (h / np.sqrt(head_dim)).astype(np.float32)
    q, r = np.linalg.qr(np.random.default_rng(0).normal(size=(head_dim, head_dim)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def rotate(x: jax.Array, rotation: np.ndarray) -> jax.Array:
    """x [..., E] @ rotation, in x's dtype (fp32 accumulation)."""
    return jnp.einsum("...e,ef->...f", x, rotation, preferred_element_type=jnp.float32).astype(x.dtype)


def kv_zeros(shape: tuple[int, ...], kind: str, dtype) -> QuantizedKV:
    """An empty quantized cache array of logical `shape` [..., E]."""
    last = shape[-1] // 2 if kind == "int4" else shape[-1]
    return QuantizedKV(
        jnp.zeros(shape[:-1] + (last,), jnp.int8),
        jnp.zeros(shape[:-1] + (1,), KV_SCALE_DTYPE),
        kind,
        jnp.dtype(dtype).name,
    )


def kv_bytes_per_vector(head_dim: int, kv_dtype: str | None, bytes_per_elem: int) -> int:
    """Bytes of one cached key (or value) of one head: E elements, or codes + their scale when quantized."""
    if check_kv_dtype(kv_dtype) is None:
        return head_dim * bytes_per_elem
    codes = head_dim // 2 if kv_dtype == "int4" else head_dim
    return codes + jnp.dtype(KV_SCALE_DTYPE).itemsize


def as_stored(x: jax.Array, like) -> jax.Array | QuantizedKV:
    """New keys or values x in the form of the cache array `like` (quantized on write when it is; x already in
    that form is returned as it is)."""
    if isinstance(x, QuantizedKV):
        return x
    if isinstance(like, QuantizedKV):
        return quantize_kv(x, like.kind, like.dtype)
    return x.astype(like.dtype)


def dequantize(x) -> jax.Array:
    """An array as it is, a `QuantizedKV` / `QuantizedWeight` as the values it stands for."""
    return x.dequantize() if isinstance(x, (QuantizedKV, QuantizedWeight)) else x


# --- int8 weights ------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedWeight:
    """An int8 weight with one scale per output channel (size 1 on the contracted axes)."""

    codes: jax.Array  # int8, the weight's shape
    scale: jax.Array  # the model's dtype, the weight's rank

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def dtype(self):
        return self.scale.dtype

    def dequantize(self) -> jax.Array:
        return (self.codes.astype(jnp.float32) * self.scale.astype(jnp.float32)).astype(self.scale.dtype)


def quantize_weight(w: jax.Array, contract_axes: tuple[int, ...]) -> QuantizedWeight:
    """Per-output-channel int8: absmax over `contract_axes`, scale in w's dtype."""
    scale = absmax_scale(w, contract_axes, 127, w.dtype)
    return QuantizedWeight(_codes(w, scale, 127), scale)


def einsum(subscripts: str, x: jax.Array, w, out_dtype=None) -> jax.Array:
    """`jnp.einsum(subscripts, x, w)` for a weight w that may be a `QuantizedWeight`, in `out_dtype` (default
    x's; a float32 out_dtype accumulates in float32)."""
    if not isinstance(w, QuantizedWeight):
        return jnp.einsum(subscripts, x, w, preferred_element_type=out_dtype)
    if "->" not in subscripts or "..." in subscripts:  # the scale's axes are placed by letter
        raise DuoJaxError(
            f"quant.einsum over a QuantizedWeight takes explicit subscripts with '->' and no '...', got {subscripts!r}"
        )
    inputs, out = subscripts.split("->")
    w_letters = inputs.split(",")[1]
    y = jnp.einsum(subscripts, x, w.codes.astype(x.dtype), preferred_element_type=jnp.float32)
    # The scale's non-unit axes are the weight's output channels: laid out as y's axes to broadcast, a multiply (an
    # einsum with no contracted index would lower to a dot_general).
    kept = [c for c in w_letters if c in out]  # in w's order
    scale = w.scale.reshape([n for c, n in zip(w_letters, w.scale.shape) if c in out])
    scale = jnp.transpose(scale, [kept.index(c) for c in out if c in kept])  # in y's order
    scale = jnp.expand_dims(scale, [i for i, c in enumerate(out) if c not in kept])
    return (y * scale.astype(jnp.float32)).astype(out_dtype or x.dtype)


def take_rows(w, rows: jax.Array) -> jax.Array:
    """w[rows] for an embedding table (a `QuantizedWeight` scaled per row), in its dtype."""
    if not isinstance(w, QuantizedWeight):
        return w[rows]
    return (w.codes[rows].astype(jnp.float32) * w.scale[rows].astype(jnp.float32)).astype(w.dtype)

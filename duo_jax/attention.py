"""The one place that picks an attention implementation.

Every attention call of the model goes through `flash_attention` (dense causal,
retrieval heads and teacher), `lambda_attention` (streaming heads' Λ mask) or
`decode_attention` (one token over a cache). `impl` chooses how:

* "pallas": the Pallas kernels of `pallas_kernels` (Triton on GPU, interpret
  mode on CPU: correct but slow, meant for tests).
* "reference": dense jnp with an explicit mask, compiled by XLA. O(T * S)
  memory for the scores.
* "auto": "pallas" on GPU, "reference" elsewhere (CPU, and TPU, where the
  kernels' [B, T, H, D] head-strided tiles do not suit Mosaic).

Both implementations take the same arguments and raise the same ValueErrors:
Hq % Hkv != 0, sink < 0, recent < 1 (a query always sees itself; recent >= T is
plain causal attention), non-positive block sizes.
"""

from __future__ import annotations

from typing import Literal

import jax

import pallas_kernels
from pallas_kernels import reference

Impl = Literal["auto", "pallas", "reference"]
_IMPLS = ("auto", "pallas", "reference")


def resolve_impl(impl: str) -> str:
    """Maps "auto" to "pallas" on GPU and to "reference" elsewhere."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}.")
    if impl != "auto":
        return impl
    return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "reference"


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, q_offset=0,
                    kv_len=None, scale: float | None = None, impl: Impl = "auto", block_q: int = 128,
                    block_k: int = 128, interpret: bool | None = None) -> jax.Array:
    """Dense (causal) attention. q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D].

    Query i sits at position q_offset + i (int or int32 scalar or [B]); keys j >= kv_len (None = S,
    int, int32 scalar or [B]) are masked. See `pallas_kernels.flash_attention`.
    """
    _check(q, k, v, block_q=block_q, block_k=block_k)
    if resolve_impl(impl) == "reference":
        return reference.flash_attention_reference(q, k, v, causal=causal, q_offset=q_offset,
                                                   kv_len=kv_len, scale=scale)
    return pallas_kernels.flash_attention(q, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len,
                                          scale=scale, block_q=block_q, block_k=block_k,
                                          interpret=interpret)


def lambda_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sink: int, recent: int,
                     q_offset=0, scale: float | None = None, impl: Impl = "auto",
                     block_q: int = 128, block_k: int = 128,
                     interpret: bool | None = None) -> jax.Array:
    """Streaming heads' attention: position p sees key j iff j <= p and (j < sink or p - j < recent).

    q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D]. See `pallas_kernels.lambda_attention`.
    """
    _check(q, k, v, block_q=block_q, block_k=block_k)
    pallas_kernels.check_window(sink, recent)
    if resolve_impl(impl) == "reference":
        return reference.lambda_attention_reference(q, k, v, sink=sink, recent=recent,
                                                    q_offset=q_offset, scale=scale)
    return pallas_kernels.lambda_attention(q, k, v, sink=sink, recent=recent, q_offset=q_offset,
                                           scale=scale, block_q=block_q, block_k=block_k,
                                           interpret=interpret)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                     scale: float | None = None, impl: Impl = "auto", block_k: int = 128,
                     num_splits: int = 16, interpret: bool | None = None) -> jax.Array:
    """One query per sequence over a cache: q [B, Hq, D], k/v [B, S, Hkv, D], lengths int32 [B].

    Sequence b sees keys j < lengths[b]. See `pallas_kernels.decode_attention`.
    """
    pallas_kernels.check_qkv(q, k, v, q_ndim=3)
    pallas_kernels.check_block("block_k", block_k)
    pallas_kernels.check_block("num_splits", num_splits)
    if resolve_impl(impl) == "reference":
        return reference.decode_attention_reference(q, k, v, lengths, scale=scale)
    return pallas_kernels.decode_attention(q, k, v, lengths, scale=scale, block_k=block_k,
                                           num_splits=num_splits, interpret=interpret)


def _check(q, k, v, *, block_q: int, block_k: int) -> None:
    pallas_kernels.check_qkv(q, k, v)
    pallas_kernels.check_block("block_q", block_q)
    pallas_kernels.check_block("block_k", block_k)

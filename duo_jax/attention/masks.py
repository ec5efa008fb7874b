"""One mask spec for every attention call: which cached keys each query sees.

A `MaskSpec` describes visibility by positions, never by a materialised [T, S] mask, so every
implementation (the blocked XLA path, the Pallas kernels, a dense reference) derives what it needs:
which key blocks to visit, and the element mask inside a block. Query t of sequence b sits at absolute
position `q_positions[b, t]`; key slot s holds position `k_positions[b, s]` (-1: empty), or, for a
contiguous cache (`k_positions=None`), position s itself. Slots s >= `kv_len[b]` are empty. Key j (at
position pk) is visible from a query at position pq iff its slot is filled and

    causal:          pk <= pq
    sliding window:  pq - pk < window                       (Mistral-style local attention)
    Λ (sink, recent): pk < sink  or  pq - pk < recent       (DuoAttention's streaming heads, StreamingLLM)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskSpec:
    q_positions: jax.Array  # int32 [B, T]
    kv_len: jax.Array  # int32 [B]: slots >= kv_len are empty
    k_positions: jax.Array | None = None  # int32 [B, S] (-1: empty); None: slot s holds position s
    causal: bool = dataclasses.field(default=True, metadata=dict(static=True))
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    sink: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # Λ when not None
    recent: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # (query offset, kv_len) as Python ints when the caller gave them so (`prefix_spec` with int arguments: gate
    # training, whole-sequence attention); the same values as q_positions[:, 0] and kv_len, known at trace time,
    # so the TPU kernels can build a static mask (splash attention). None when they are traced.
    static_prefix: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    # With k_positions: the slot where the queries' own keys start, when the slots before it hold tokens before
    # every query, the filled ones first (then empty: -1), and slot own_keys_at + t holds query t's (or nothing):
    # a ring followed by the chunk. Query t then sees no slot past own_keys_at + t, so a kernel's schedule may stop
    # there, and cuDNN may attend to the ring's filled slots and the chunk in two calls.
    own_keys_at: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Every key slot filled (kv_len is the number of slots), known at trace time (`prefix_spec` without a kv_len, or
    # with a Python int equal to it): Λ's kernels and cuDNN calls see every slot, so they serve only such a spec.
    every_key: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self):
        if (self.sink is None) != (self.recent is None):
            raise ValueError("Λ needs both sink and recent (or neither).")
        if self.sink is not None and (self.sink < 0 or self.recent < 1):
            raise ValueError(
                f"Λ needs sink >= 0 and recent >= 1 (a query sees itself), got sink={self.sink}, recent={self.recent}."
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}.")

    @property
    def is_lambda(self) -> bool:
        return self.sink is not None

    def visible(self, q_pos: jax.Array, k_pos: jax.Array, filled: jax.Array) -> jax.Array:
        """Element mask from positions: q_pos [B, T, 1], k_pos and filled [B, 1, S] -> bool [B, T, S]."""
        mask = filled
        if self.causal:
            mask = mask & (k_pos <= q_pos)
        if self.window is not None:
            mask = mask & (q_pos - k_pos < self.window)
        if self.is_lambda:
            mask = mask & ((k_pos < self.sink) | (q_pos - k_pos < self.recent))
        return mask

    def decode_lengths(self) -> jax.Array:
        """A causal step of one query per sequence over a contiguous cache: the keys it sees, int32 [B] (the
        decode kernels' lengths): the filled slots up to and including its own position."""
        return jnp.minimum(self.kv_len, self.q_positions[:, 0] + 1)

    def dense(self, num_keys: int) -> jax.Array:
        """The whole mask, bool [B, T, S]: for references and tests (O(T * S) memory)."""
        slots = jnp.arange(num_keys, dtype=jnp.int32)[None, :]
        k_pos = slots if self.k_positions is None else self.k_positions
        filled = (slots < self.kv_len[:, None]) & (k_pos >= 0)
        return self.visible(self.q_positions[:, :, None], k_pos[:, None, :], filled[:, None, :])


def prefix_spec(
    batch: int,
    num_queries: int,
    *,
    q_offset=0,
    kv_len=None,
    num_keys: int,
    causal: bool = True,
    window: int | None = None,
    sink: int | None = None,
    recent: int | None = None,
) -> MaskSpec:
    """A contiguous cache: query t at position q_offset + t (int, scalar or [B]); keys j < kv_len
    (None: all `num_keys`). Python-int q_offset and kv_len are also kept as `static_prefix`."""
    static = None
    if _python_int(q_offset) and (kv_len is None or _python_int(kv_len)):
        static = (int(q_offset), num_keys if kv_len is None else int(kv_len))
    every_key = kv_len is None or (_python_int(kv_len) and int(kv_len) == num_keys)
    offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32).reshape(-1), (batch,))
    q_positions = offset[:, None] + jnp.arange(num_queries, dtype=jnp.int32)[None, :]
    kv_len = num_keys if kv_len is None else kv_len
    kv_len = jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32).reshape(-1), (batch,))
    return MaskSpec(
        q_positions,
        kv_len,
        None,
        causal=causal,
        window=window,
        sink=sink,
        recent=recent,
        static_prefix=static,
        every_key=every_key,
    )


def _python_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

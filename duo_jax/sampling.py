"""Picking the next token from logits: greedy, or temperature with top-k and nucleus (top-p) filtering.

Pure and jittable: the decode loop (`duo_jax.engine.decode`) samples on the device, inside its while loop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick tokens (hashable: a static argument of the compiled loop). temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token int32 [B] per row of logits [B, V]."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = jax.lax.top_k(scaled, sampling.top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    # Keep the smallest prefix of the sorted tokens whose probability reaches top_p (always the first).
    drop_sorted = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs >= sampling.top_p
    drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
    return jax.random.categorical(key, jnp.where(drop, -jnp.inf, scaled), axis=-1).astype(jnp.int32)

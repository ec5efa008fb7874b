"""Picking the next token from logits: greedy, or temperature with top-k and nucleus (top-p) filtering.

Pure and jittable. Two entry points over one filter (`filtered_logits`):
  * `sample(logits, key, sampling)`: one rule for the whole batch, static (`Sampling` is hashable): the decode
    loop (`duo_jax.engine.decode`) samples on the device, inside its while loop;
  * `sample_rows(logits, keys, temperature, top_p, top_k)`: a rule per row, as runtime arrays, so one compiled
    sampler serves every combination of values (the server's scheduler, where each request brings its own).
`check_sampling` turns user-given values into a `Sampling` or a clear error naming the field: the server,
`infer.py` and `generate` all check through it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from duo_jax.errors import InvalidOption


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick tokens (hashable: a static argument of the compiled loop). temperature 0 is greedy; top_k 0
    (or at least the vocabulary) keeps every token; top_p 1 keeps every token."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


def check_number(
    name: str, value, *, integer: bool = False, minimum=None, maximum=None, above: bool = False, hint: str = ""
):
    """`value` as a Python int (`integer`) or float if it is a finite number of that kind (numpy's count, bools do
    not) in range (`above`: strictly greater than `minimum`); else InvalidOption naming `name`."""
    kinds = numbers.Integral if integer else numbers.Real
    low = "" if minimum is None else f" {'>' if above else '>='} {minimum}"
    high = "" if maximum is None else f"{' and' if low else ''} <= {maximum}"
    need = f"{name} must be {'an integer' if integer else 'a finite number'}{low}{high}{hint}"
    if isinstance(value, bool) or not isinstance(value, kinds) or not integer and not _finite(value):
        raise InvalidOption(f"{need}, got {value!r:.60}", name)
    if (
        minimum is not None
        and (value <= minimum if above else value < minimum)
        or maximum is not None
        and value > maximum
    ):
        raise InvalidOption(f"{need}, got {value!r:.60}", name)
    return int(value) if integer else float(value)


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range (a JSON number of 400 digits)
        return False


SEED_MAX = 2**32 - 1  # JAX keeps a seed's low 32 bits without x64: 2**32 would be seed 0 again


def check_seed(seed) -> int:
    """A sampling seed: an integer in [0, 2**32), or InvalidOption (a larger one would alias a smaller one)."""
    return check_number("seed", seed, integer=True, minimum=0, maximum=SEED_MAX)


def check_sampling(temperature=0.0, top_p=1.0, top_k=0) -> Sampling:
    """A `Sampling` from user-given values, or InvalidOption naming the bad one and its range."""
    return Sampling(
        check_number("temperature", temperature, minimum=0, hint=" (0: greedy)"),
        check_number("top_p", top_p, minimum=0, maximum=1, above=True),
        check_number("top_k", top_k, integer=True, minimum=0, hint=" (0: no top-k)"),
    )


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """logits [B, V] divided by each row's temperature [B] (> 0), with -inf outside the row's top_k tokens
    (top_k [B]; 0 or >= V: no limit, the same tokens) and outside its nucleus: the smallest prefix of the
    remaining tokens, most probable first, whose probability reaches top_p [B] (always the first)."""
    B, V = logits.shape
    scaled = logits / temperature.astype(logits.dtype)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    k = jnp.where((top_k <= 0) | (top_k > V), V, top_k).astype(jnp.int32)
    kth = jnp.take_along_axis(ranked, k[:, None] - 1, axis=-1)  # ties with the k-th value stay
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)
    sorted_probs = jax.nn.softmax(ranked, axis=-1)
    drop_sorted = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs >= top_p.astype(sorted_probs.dtype)[:, None]
    drop = jnp.zeros_like(drop_sorted).at[jnp.arange(B)[:, None], order].set(drop_sorted)
    return jnp.where(drop | (scaled < kth), -jnp.inf, scaled)


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token int32 [B] per row of logits [B, V], every row by the same rule (one key for the batch)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    full = lambda value: jnp.full(logits.shape[:1], value)  # noqa: E731
    masked = filtered_logits(logits, full(sampling.temperature), full(sampling.top_p), full(sampling.top_k))
    return jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)


def sample_rows(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array
) -> jax.Array:
    """Next token int32 [B]: row b by its own rule (temperature[b] 0: greedy) and key keys[b]. The values are
    runtime arrays (no compile per value); a batch of greedy rows skips the sort."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    hot = temperature > 0

    def drawn():
        masked = filtered_logits(logits, jnp.where(hot, temperature, 1), top_p, top_k)
        rows = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, masked).astype(jnp.int32)
        return jnp.where(hot, rows, greedy)

    return jax.lax.cond(jnp.any(hot), drawn, lambda: greedy)

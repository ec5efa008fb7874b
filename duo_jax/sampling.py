"""Picking the next token from logits: greedy, or temperature with top-k and nucleus (top-p) filtering.

Pure and jittable, one filter (`filtered_logits`) and one sampler (`sample_rows`): each row by its own rule, the
rule's values runtime arrays (a `Sampling` of [B] arrays: a pytree), so one compiled sampler serves every value.
Row b's token at output position n is drawn with `fold_in(key(seeds[b]), n)` (`sample_seeded`): the same whatever
else is in the batch, in `generate`'s decode loop and in the server's scheduler alike. `check_sampling` turns
user-given values into a `Sampling` or a clear error naming the field: the server, `infer.py` and `generate` all
check through it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.errors import InvalidOption


@functools.partial(jax.tree_util.register_dataclass, data_fields=["temperature", "top_p", "top_k"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick tokens: Python numbers (one rule, as users give it), or arrays [B] (a rule per row, as the
    compiled samplers take it: a pytree, its values runtime arguments). temperature 0 is greedy; top_k 0 (or at
    least the vocabulary) keeps every token; top_p 1 keeps every token."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        """Whether every token is the argmax (a Python rule of temperature 0, or one that rounds to 0 in float32)."""
        return float(np.float32(self.temperature)) == 0

    def rows(self, batch: int) -> Sampling:
        """This rule for each of `batch` rows (`stack`)."""
        return Sampling.stack([self] * batch)

    @staticmethod
    def stack(rules: Sequence[Sampling]) -> Sampling:
        """One rule per row as the compiled samplers take them: float32 / int32 arrays [len(rules)] (top_k capped
        to int32)."""
        return Sampling(
            np.array([r.temperature for r in rules], np.float32),
            np.array([r.top_p for r in rules], np.float32),
            np.array([min(int(r.top_k), np.iinfo(np.int32).max) for r in rules], np.int32),
        )


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
    remaining tokens, most probable first, whose probability reaches top_p [B] (always the first, as Hugging Face's
    `min_tokens_to_keep`: a top_p that rounds to 0 would otherwise drop every token)."""
    B, V = logits.shape
    # Less the row's max first: the same distribution, and a tiny temperature sends the others to -inf, not every
    # logit to +-inf (then the first +inf, token 0, was drawn).
    top = jnp.max(logits, axis=-1, keepdims=True)
    scaled = (logits - jnp.where(jnp.isfinite(top), top, 0)) / temperature.astype(logits.dtype)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    k = jnp.where((top_k <= 0) | (top_k > V), V, top_k).astype(jnp.int32)
    kth = jnp.take_along_axis(ranked, k[:, None] - 1, axis=-1)  # ties with the k-th value stay
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)
    sorted_probs = jax.nn.softmax(ranked, axis=-1)
    drop_sorted = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs >= top_p.astype(sorted_probs.dtype)[:, None]
    drop_sorted = drop_sorted.at[:, 0].set(False)
    drop = jnp.zeros_like(drop_sorted).at[jnp.arange(B)[:, None], order].set(drop_sorted)
    return jnp.where(drop | (scaled < kth), -jnp.inf, scaled)


def argmax_tokens(logits: jax.Array) -> jax.Array:
    """The greedy token of each row: int32 [B]."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def check_rows(batch: int, rule: Sampling, **per_row) -> None:
    """Refuse a per-row rule that is not arrays [batch], or `per_row` arrays (keys, seeds) whose leading dimension
    is not `batch`: a rule for another batch failed to broadcast, or (one row) silently ruled every row. Static:
    shapes only, so it runs at trace time under a jit."""
    if not isinstance(rule, Sampling):
        raise InvalidOption(f"the sampling rule must be a Sampling, got {type(rule).__name__}", "sampling")
    for name in ("temperature", "top_p", "top_k"):
        shape = list(jnp.shape(getattr(rule, name)))
        if shape != [batch]:
            raise InvalidOption(
                f"the sampling rule's {name} has shape {shape}, not one value per row of the batch ({batch}): "
                f"build the rule for this batch (rule.rows({batch}), or Sampling.stack of one rule per row)",
                name,
            )
    for name, x in per_row.items():
        shape = list(jnp.shape(x))
        if shape[:1] != [batch]:
            raise InvalidOption(
                f"{name} have shape {shape}, not one per row of the batch ({batch}): pass one per row "
                f"(seeds: row_seeds(seed, {batch}))",
                name,
            )


def sample_rows(logits: jax.Array, keys: jax.Array, rule: Sampling) -> jax.Array:
    """Next token int32 [B]: row b by its own rule (`rule`'s arrays [B]; temperature 0: greedy) with key keys[b].
    The values are runtime arrays (no compile per value); a batch of greedy rows skips the sort. In float32
    whatever the logits' dtype (bf16's rounding biases the draw). A rule or keys for another batch: InvalidOption."""
    check_rows(logits.shape[0], rule, keys=keys)
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(rule.temperature, jnp.float32)
    greedy = argmax_tokens(logits)
    hot = temperature > 0

    def drawn():
        masked = filtered_logits(logits, jnp.where(hot, temperature, 1), rule.top_p, rule.top_k)
        rows = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, masked).astype(jnp.int32)
        return jnp.where(hot, rows, greedy)

    return jax.lax.cond(jnp.any(hot), drawn, lambda: greedy)


def row_keys(seeds: jax.Array, position) -> jax.Array:
    """Each row's key for output position `position` (a scalar or [B]): fold_in(key(seeds[b]), position)."""
    position = jnp.broadcast_to(jnp.asarray(position, jnp.int32), seeds.shape)
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, position)


@jax.jit
def sample_seeded(logits: jax.Array, seeds: jax.Array, positions: jax.Array, rule: Sampling) -> jax.Array:
    """Row b's token by its rule, drawn with `row_keys(seeds, positions)[b]` (seeds uint32 [B], positions int32
    [B]): the same whatever the batch. One executable per logits shape."""
    check_rows(logits.shape[0], rule, seeds=seeds)
    return sample_rows(logits, row_keys(seeds, positions), rule)


def row_seeds(seed, batch: int) -> np.ndarray:
    """uint32 [batch]: `seed` (an int: row b gets seed + b, mod 2**32, so that equal prompts draw differently and
    each row draws as it does alone with its seed) or one seed per row (a sequence), each checked."""
    if isinstance(seed, (numbers.Integral, np.integer)) and not isinstance(seed, bool):
        return (check_seed(seed) + np.arange(batch, dtype=np.uint64)).astype(np.uint32)
    seeds = list(seed) if isinstance(seed, (list, tuple, np.ndarray)) else None
    if seeds is None or len(seeds) != batch:
        raise InvalidOption(f"seed must be an integer or one integer per prompt ({batch}), got {seed!r:.60}", "seed")
    return np.array([check_seed(s) for s in seeds], np.uint32)

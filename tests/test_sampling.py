"""The sampler: per-row runtime rules (`sample_rows`) draw each row's distribution (float64 reference), greedy rows
and rows that keep one token are the argmax (also for values that round to 0 in float32), a top_k at or above the
vocabulary is no limit, seeds make a row's draw independent of the batch, and `check_sampling` names the bad
field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from duo_jax.errors import InvalidOption
from duo_jax.sampling import (
    Sampling,
    check_sampling,
    check_seed,
    filtered_logits,
    row_seeds,
    sample_rows,
    sample_seeded,
)

V = 50
LOGITS = jax.random.normal(jax.random.key(0), (6, V)) * 3


def rows(temperature, top_p, top_k, keys):
    return np.asarray(
        sample_rows(
            LOGITS,
            keys,
            Sampling(
                jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32), jnp.asarray(top_k, jnp.int32)
            ),
        )
    )


def test_per_row_rules():
    keys = jax.random.split(jax.random.key(1), 6)
    argmax = np.asarray(jnp.argmax(LOGITS, -1))
    out = rows([0, 1.0, 0.7, 1.0, 2.0, 0], [1, 1, 1e-6, 0.9, 1, 0.5], [0, 1, 0, 0, 10, 3], keys)
    assert out[0] == argmax[0] and out[5] == argmax[5]  # greedy rows
    assert out[1] == argmax[1] and out[2] == argmax[2]  # top_k 1; a nucleus of one token
    assert (rows([0] * 6, [1] * 6, [0] * 6, keys) == argmax).all()  # all greedy: the sort skipped


@pytest.mark.slow
def test_a_top_k_at_or_above_the_vocabulary_is_no_limit():
    keys = jax.random.split(jax.random.key(2), 6)
    free = rows([1.0] * 6, [1] * 6, [0] * 6, keys)
    assert (rows([1.0] * 6, [1] * 6, [V] * 6, keys) == free).all()
    assert (rows([1.0] * 6, [1] * 6, [50_000] * 6, keys) == free).all()


def test_the_filter_keeps_the_top_k_and_the_nucleus():
    masked = np.asarray(
        filtered_logits(
            LOGITS, jnp.ones(6), jnp.asarray([1, 1, 1, 0.5, 0.5, 1e-6]), jnp.asarray([3, 0, V + 1, 0, 5, 0])
        )
    )
    kept = np.isfinite(masked).sum(-1)
    assert kept[0] == 3 and kept[1] == kept[2] == V and 1 <= kept[3] < V and kept[4] <= 5 and kept[5] == 1


@pytest.mark.parametrize(
    "values, field",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("inf")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(temperature=10**400), "temperature"),  # an int past float's range (was an OverflowError)
    ],
)
def test_check_sampling_names_the_field(values, field):
    with pytest.raises(InvalidOption, match=f"^{field} must be") as e:
        check_sampling(**values)
    assert e.value.param == field
    assert check_sampling(0.5, 0.9, 50_000) == Sampling(0.5, 0.9, 50_000)


def test_a_seed_is_a_32_bit_integer():
    """JAX keeps a seed's low 32 bits (without x64): 2**32 would silently be seed 0, -1 seed 2**32 - 1."""
    assert jax.random.key_data(jax.random.key(2**32)).tolist() == jax.random.key_data(jax.random.key(0)).tolist()
    assert check_seed(0) == 0 and check_seed(np.uint32(2**32 - 1)) == 2**32 - 1
    for bad in (2**32, -1, 2**70, 1.0, "7"):
        with pytest.raises(InvalidOption, match="^seed must be an integer >= 0 and <= 4294967295"):
            check_seed(bad)


def reference_probabilities(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Hugging Face's logits warpers in float64: temperature, then top-k (ties with the k-th kept), then top-p (the
    smallest prefix, most probable first, whose mass reaches top_p; at least one token)."""
    scaled = logits.astype(np.float64) / temperature
    if 0 < top_k < len(scaled):
        scaled = np.where(scaled < np.sort(scaled)[::-1][top_k - 1], -np.inf, scaled)
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled[order][0])
    probs /= probs.sum()
    keep = np.cumsum(probs) - probs < top_p
    keep[0] = True
    out = np.zeros(len(scaled))
    out[order[keep]] = probs[keep] / probs[keep].sum()
    return out


@pytest.mark.parametrize("rule", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.5, 1.0, 6), (0.8, 0.6, 10)])
def test_draws_follow_the_reference_distribution(rule):
    """Many rows of one logits vector, each with its own seed: the frequencies match the float64 reference (a
    chi-square test at p = 1e-4 over the tokens it keeps; none drawn outside them)."""
    from scipy import stats

    n = 20_000
    logits = np.asarray(LOGITS[0])
    expected = reference_probabilities(logits, *rule)
    tokens = sample_seeded(
        jnp.broadcast_to(LOGITS[0], (n, V)),
        jnp.arange(n, dtype=jnp.uint32),
        jnp.zeros(n, jnp.int32),
        Sampling(*rule).rows(n),
    )
    counts = np.bincount(np.asarray(tokens), minlength=V)
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    assert stats.chisquare(counts[support], n * expected[support]).pvalue > 1e-4


def test_values_that_round_to_zero_are_greedy_not_token_0():
    """top_p = 1e-50 is accepted but 0 in float32: every token was dropped; temperature = 1e-40 made every logit
    infinite; both drew token 0."""
    argmax = np.asarray(jnp.argmax(LOGITS, -1))
    assert (argmax != 0).all()
    keys = jax.random.split(jax.random.key(4), 6)
    assert (rows([1.0] * 6, [1e-50] * 6, [0] * 6, keys) == argmax).all()
    assert (rows([1e-40] * 6, [1.0] * 6, [0] * 6, keys) == argmax).all()
    assert (rows([1e-46] * 6, [1.0] * 6, [0] * 6, keys) == argmax).all()  # 0 in float32: a greedy row
    assert Sampling(1e-46).greedy and not Sampling(1e-40).greedy


def test_bf16_logits_draw_in_float32():
    keys = jax.random.split(jax.random.key(5), 6)
    rule = Sampling(*(jnp.full(6, v, dtype) for v, dtype in ((0.9, jnp.float32), (0.8, jnp.float32), (0, jnp.int32))))
    bf16 = sample_rows(LOGITS.astype(jnp.bfloat16), keys, rule)
    f32 = sample_rows(LOGITS.astype(jnp.bfloat16).astype(jnp.float32), keys, rule)
    assert (np.asarray(bf16) == np.asarray(f32)).all()


def test_row_seeds():
    """An int seed gives row b seed + b (mod 2**32); a list gives each row its own; both checked."""
    assert row_seeds(7, 3).tolist() == [7, 8, 9] and row_seeds(2**32 - 1, 2).tolist() == [2**32 - 1, 0]
    assert row_seeds([5, 5, 9], 3).tolist() == [5, 5, 9]
    bad_seeds = (([1, 2], "one integer per prompt"), ([1, -1, 2], "seed must be an integer >= 0"), (1.5, "integer"))
    for bad, match in bad_seeds:
        with pytest.raises(InvalidOption, match=match):
            row_seeds(bad, 3)


def test_a_rule_or_seeds_for_another_batch_is_refused():
    """A per-row rule or seeds of another batch than the logits' rows: a rule of 3 rows for 2 failed to broadcast
    (a bare TypeError), a rule of 1 row silently ruled every row, a Python-number rule was an IndexError, seeds of 3
    a vmap error. Each is an InvalidOption naming the field and the fix, under a jit too (shapes only)."""
    logits, seeds, positions = LOGITS[:2], jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.int32)
    rule = Sampling(0.8, 0.9, 5)
    for bad, shape in ((rule.rows(3), "[3]"), (rule.rows(1), "[1]"), (rule, "[]")):
        with pytest.raises(InvalidOption, match=rf"temperature has shape \{shape}, not one value per row .*rows\(2\)"):
            sample_seeded(logits, seeds, positions, bad)
    with pytest.raises(InvalidOption, match=r"seeds have shape \[3\], not one per row of the batch \(2\)"):
        sample_seeded(logits, jnp.zeros(3, jnp.uint32), positions, rule.rows(2))
    keys = jax.random.split(jax.random.key(0), 3)
    with pytest.raises(InvalidOption, match=r"keys have shape \[3\]"):
        jax.jit(sample_rows)(logits, keys, rule.rows(2))
    assert sample_seeded(logits, seeds, positions, rule.rows(2)).shape == (2,)

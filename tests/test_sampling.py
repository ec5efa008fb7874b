"""The sampler: per-row runtime rules (`sample_rows`) agree with the static rule (`sample`), greedy rows and
rows that keep one token are the argmax, a top_k at or above the vocabulary is no limit, and `check_sampling`
names the bad field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from duo_jax.errors import InvalidOption
from duo_jax.sampling import Sampling, check_sampling, check_seed, filtered_logits, sample, sample_rows

V = 50
LOGITS = jax.random.normal(jax.random.key(0), (6, V)) * 3


def rows(temperature, top_p, top_k, keys):
    return np.asarray(
        sample_rows(
            LOGITS,
            keys,
            jnp.asarray(temperature, jnp.float32),
            jnp.asarray(top_p, jnp.float32),
            jnp.asarray(top_k, jnp.int32),
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
    assert np.asarray(sample(LOGITS, jax.random.key(3), Sampling(1.0, 1.0, 50_000))).shape == (6,)


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

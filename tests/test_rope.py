"""RoPE at long positions: float32 angles (`duo_jax.model.rope_angles`) against a float64 reference, up to 4M
tokens and beyond."""

import jax.numpy as jnp
import numpy as np
import pytest

from duo_jax.config import get_config
from duo_jax.model import apply_rope, rope_angles, rope_inv_freq

POSITIONS = np.concatenate(
    [
        np.arange(0, 70),
        [4095, 4096, 4097, 2**24 - 1, 2**24, 2**24 + 1, 2**31 - 1],
        np.random.default_rng(0).integers(0, 4_194_304, 300),
        np.random.default_rng(1).integers(0, 2**31 - 1, 50),
    ]
)


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-8b-1048k", "llama2-7b-32k", "smollm2-135m"])
def test_rope_angles_are_exact_to_float32_resolution_at_any_position(name):
    inv_freq = rope_inv_freq(get_config(name))
    exact = POSITIONS[:, None].astype(np.float64) * inv_freq.astype(np.float64)
    got = np.asarray(rope_angles(jnp.asarray(POSITIONS, jnp.int32), inv_freq), np.float64)
    err = np.abs(np.angle(np.exp(1j * (got - exact))))  # the difference mod 2π
    assert err.max() < 2e-6
    assert np.all(np.abs(got) <= np.pi + 1e-6)
    # The plain float32 product this replaces: off by ~0.1 rad at 4M tokens.
    long = POSITIONS[(POSITIONS > 3_000_000) & (POSITIONS < 4_194_304)]
    plain = long[:, None].astype(np.float32) * inv_freq
    assert np.abs(np.angle(np.exp(1j * (plain - exact[np.isin(POSITIONS, long)])))).max() > 1e-2


def test_apply_rope_rotates_by_the_exact_angle_at_4m():
    config = get_config("llama3-8b")
    inv_freq = rope_inv_freq(config)
    positions = np.array([[3, 1_048_575, 3_999_999, 4_194_303]])
    x = np.random.default_rng(2).normal(size=(1, 4, 2, config.head_dim)).astype(np.float32)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions, jnp.int32), inv_freq), np.float64)
    angles = positions[..., None].astype(np.float64) * inv_freq.astype(np.float64)  # [1, 4, E/2]
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]
    x1, x2 = np.split(x.astype(np.float64), 2, axis=-1)
    want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(x).max())


@pytest.mark.slow
def test_rotary_table_matches_apply_rope_and_is_built_once_per_forward(tiny):
    """The `rotary` table is the cos and sin of `rope_angles` (its conditional on CPU passes them through, jitted
    or not); and in a compiled forward of unrolled layers its sin and cos are computed once, not fused into
    every layer's rotation of its queries and keys (XLA:CPU did that)."""
    import jax

    from duo_jax.model import forward_jit, init_params, rotary, unstack_layers

    inv_freq = rope_inv_freq(tiny)
    positions = jnp.asarray([[0, 7, 511, 4_000_000]], jnp.int32)
    angles = np.asarray(rope_angles(positions, inv_freq))
    for table in (rotary(positions, inv_freq), jax.jit(rotary, static_argnums=1)(positions, tuple(inv_freq))):
        np.testing.assert_allclose(np.asarray(table.cos), np.cos(angles), atol=1e-6)
        np.testing.assert_allclose(np.asarray(table.sin), np.sin(angles), atol=1e-6)

    params = unstack_layers(init_params(tiny, jax.random.key(0)))  # unrolled layers: one rotation per layer
    hlo = forward_jit.lower(params, tiny, jnp.zeros((1, 32), jnp.int32)).compile().as_text()
    assert tiny.num_layers >= 2
    if jax.default_backend() == "cpu":
        assert hlo.count(" sine(") == 1 and hlo.count(" cosine(") == 1, (hlo.count(" sine("), hlo.count(" cosine("))

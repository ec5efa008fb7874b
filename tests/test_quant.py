"""Absmax quantization (`duo_jax.quant`) against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from duo_jax import quant
from duo_jax.errors import DuoJaxError


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    # Heavy tails and an all-zero row: outliers set the scale, zeros must not divide by zero.
    x = rng.standard_t(3, size=shape) * np.exp(rng.normal(size=shape[:-1] + (1,)))
    x[0, 0] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kv_round_trip_is_within_half_a_step(kind, dtype):
    x = np.asarray(jnp.asarray(_data((3, 50, 2, 16)), dtype).astype(jnp.float32), np.float64)
    q = quant.quantize_kv(jnp.asarray(x, dtype), kind)
    assert q.shape == x.shape and q.dtype == jnp.dtype(dtype).name
    assert q.codes.shape == x.shape[:-1] + (16 if kind == "int8" else 8,) and q.codes.dtype == jnp.int8
    assert q.scale.shape == x.shape[:-1] + (1,) and q.scale.dtype == jnp.bfloat16
    scale = np.asarray(q.scale.astype(jnp.float32), np.float64)
    exact = np.abs(x).max(-1, keepdims=True) / quant.QMAX[kind]
    # The stored scale is the exact one rounded up to bf16: at most one bf16 step (2^-7 relative) above.
    assert np.all(scale >= exact) and np.all(scale <= exact * (1 + 2.0**-7))
    err = np.abs(np.asarray(q.dequantize().astype(jnp.float32), np.float64) - x)
    slack = 0.5 if dtype == jnp.float32 else 0.5 + 2.0**-8 * quant.QMAX[kind]  # bf16 output rounding
    assert np.all(err <= slack * scale + 1e-12)
    # Rounding (not truncating): the worst error reaches almost half a step, and the mean is about a quarter.
    ratio = err / np.where(scale > 0, scale, 1)
    assert ratio.max() > 0.45 and 0.2 < ratio[x != 0].mean() < 0.3
    assert np.all(err[0, 0] == 0)


def test_int4_packs_every_code_exactly():
    codes = np.array(np.meshgrid(np.arange(-8, 8), np.arange(-8, 8))).reshape(2, -1).T.reshape(16, 16, 2)
    codes = jnp.asarray(np.concatenate([codes[..., :1], codes[..., 1:]], -1), jnp.int8)  # [16, 16, E=2]
    packed = quant.pack_int4(codes)
    assert packed.shape == (16, 16, 1)
    np.testing.assert_array_equal(quant.unpack_int4(packed), codes)
    x = jnp.asarray(_data((4, 8, 32)))  # the halves go to the two nibbles of one byte
    q = quant.quantize_kv(x, "int4")
    np.testing.assert_array_equal(quant.unpack_int4(q.codes)[..., :16] & 0xF, q.codes & 0xF)


def test_bad_kv_dtype_and_odd_int4_head_dim_raise():
    with pytest.raises(DuoJaxError, match="kv_dtype must be"):
        quant.check_kv_dtype("fp8")
    with pytest.raises(DuoJaxError, match="even"):
        quant.quantize_kv(jnp.ones((2, 3)), "int4")
    # integers were truncated to codes of their own values ([100, -3, 7, 1] came back [100, -3, 7, 0]); kind None
    # was a KeyError; an ellipsis in quant.einsum placed the scale on the wrong axes (shape [1, 2, 3, 4])
    with pytest.raises(DuoJaxError, match="floating keys / values and dtype; x is int32"):
        quant.quantize_kv(jnp.array([[100, -3, 7, 1]], jnp.int32), "int8")
    with pytest.raises(DuoJaxError, match="dtype is int8"):
        quant.quantize_kv(jnp.ones((2, 4)), "int8", dtype=jnp.int8)
    with pytest.raises(DuoJaxError, match="quantizes to 'int8' or 'int4', got kind=None"):
        quant.quantize_kv(jnp.ones((2, 4)), None)
    w = quant.quantize_weight(jnp.ones((8, 4)), (0,))
    with pytest.raises(DuoJaxError, match="explicit subscripts with '->' and no '...'"):
        quant.einsum("...d,dh->...h", jnp.ones((2, 3, 8)), w)


def test_bytes_per_vector_include_the_scale():
    assert quant.kv_bytes_per_vector(128, None, 2) == 256
    assert quant.kv_bytes_per_vector(128, "int8", 2) == 128 + 2
    assert quant.kv_bytes_per_vector(128, "int4", 2) == 64 + 2
    for kind in quant.KV_DTYPES:
        q = quant.kv_zeros((2, 5, 3, 128), kind, jnp.bfloat16)
        assert q.codes.nbytes + q.scale.nbytes == 2 * 5 * 3 * quant.kv_bytes_per_vector(128, kind, 2)


def test_int8_weight_einsum_matches_float64_per_output_channel():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(24, 3, 8)) * rng.uniform(0.1, 10, size=(1, 3, 8))  # channels of very different ranges
    x = rng.normal(size=(2, 5, 24))
    q = quant.quantize_weight(jnp.asarray(w, jnp.float32), (0,))
    assert q.codes.dtype == jnp.int8 and q.scale.shape == (1, 3, 8)
    scale = np.asarray(q.scale, np.float64)
    assert np.all(np.abs(np.asarray(q.dequantize(), np.float64) - w) <= 0.5 * scale * (1 + 1e-6))
    got = np.asarray(quant.einsum("btd,dhe->bthe", jnp.asarray(x, jnp.float32), q), np.float64)
    want = np.einsum("btd,dhe->bthe", x, w)
    # Each output sums 24 products with weight errors <= scale / 2: |error| <= scale / 2 * sum|x|.
    bound = 0.5 * scale[None] * np.abs(x).sum(-1)[..., None, None] + 1e-4
    assert np.all(np.abs(got - want) <= bound)
    assert np.abs(got - want).max() > 1e-3  # it really is quantized
    np.testing.assert_allclose(
        quant.einsum("btd,dhe->bthe", jnp.asarray(x, jnp.float32), q.dequantize()), got, rtol=1e-5, atol=1e-5
    )  # the same as the dequantized weight
    rows = jnp.asarray([[0, 5], [23, 5]])
    np.testing.assert_array_equal(quant.take_rows(q, rows), q.dequantize()[rows])
    # Output axes in another order than the weight's, and the lowering: one matmul, the scale a multiply.
    for subscripts in ("btd,dhe->bteh", "btd,dhe->ehbt"):
        got = quant.einsum(subscripts, jnp.asarray(x, jnp.float32), q)
        np.testing.assert_allclose(got, jnp.einsum(subscripts, x, q.dequantize()), rtol=1e-5, atol=1e-5)
        lowered = jax.jit(lambda x: quant.einsum(subscripts, x, q)).lower(jnp.asarray(x, jnp.float32)).as_text()
        assert lowered.count("stablehlo.dot_general") == 1


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_kv_rotation_is_orthonormal_and_evens_out_channels(head_dim):
    r = quant.kv_rotation(head_dim).astype(np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, head_dim)) * np.exp(rng.normal(size=head_dim))  # channels of log-normal scales
    err = []
    for y, back in ((x, np.eye(head_dim)), (x @ r, r.T)):
        q = quant.quantize_kv(jnp.asarray(y, jnp.float32), "int4")
        err.append(np.linalg.norm(np.asarray(q.dequantize(), np.float64) @ back - x))
    assert err[1] < 0.7 * err[0]  # measured: 0.47 (64), 0.58 (80, random orthogonal), 0.49 (128)

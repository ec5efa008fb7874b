"""duo_jax.attention: the "pallas" and "reference" implementations agree and validate alike."""

import jax
import jax.numpy as jnp
import pytest

from duo_jax import attention
from tests.conftest import rel_err


def _qkv(seq_q=40, seq_k=40, num_heads=4, num_kv_heads=2, head_dim=64, batch=1):
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (batch, seq_q, num_heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, seq_k, num_kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, seq_k, num_kv_heads, head_dim), jnp.float32)
    return q, k, v


def test_auto_is_reference_on_cpu():
    if jax.default_backend() == "cpu":
        assert attention.resolve_impl("auto") == "reference"
    assert attention.resolve_impl("pallas") == "pallas"
    with pytest.raises(ValueError, match="impl"):
        attention.resolve_impl("triton")


def test_lambda_pallas_matches_reference():
    q, k, v = _qkv()
    outs = [attention.lambda_attention(q, k, v, sink=4, recent=8, impl=impl, block_q=16,
                                       block_k=16)
            for impl in ("pallas", "reference")]
    assert rel_err(*outs) <= 1e-5


def test_flash_pallas_matches_reference():
    q, k, v = _qkv(seq_q=16, seq_k=48)
    outs = [attention.flash_attention(q, k, v, q_offset=24, kv_len=40, impl=impl, block_q=16,
                                      block_k=16)
            for impl in ("pallas", "reference")]
    assert rel_err(*outs) <= 1e-5


def test_decode_pallas_matches_reference():
    q, k, v = _qkv(seq_q=1, seq_k=100, batch=2)
    lengths = jnp.array([100, 37], jnp.int32)
    outs = [attention.decode_attention(q[:, 0], k, v, lengths, impl=impl, block_k=32,
                                       num_splits=2)
            for impl in ("pallas", "reference")]
    assert rel_err(*outs) <= 1e-5


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_bad_arguments_raise_value_error(impl):
    q, k, v = _qkv(seq_q=16, seq_k=16)
    cases = [
        (dict(sink=-1, recent=8), "sink must be"),
        (dict(sink=4, recent=0), "recent must be"),
        (dict(sink=4, recent=8, block_q=0), "block_q must be"),
        (dict(sink=4, recent=8, block_k=-16), "block_k must be"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            attention.lambda_attention(q, k, v, impl=impl, **kwargs)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        attention.flash_attention(q[:, :, :3], k, v, impl=impl)
    with pytest.raises(ValueError, match="num_splits must be"):
        attention.decode_attention(q[:, 0], k, v, jnp.array([16]), impl=impl, num_splits=0)

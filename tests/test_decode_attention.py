"""Split-K decode attention kernel (interpret mode) against the dense masked reference."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import decode_attention, reference
from tests.conftest import random_decode_inputs as _inputs
from tests.conftest import rel_err


CASES = {
    # name: (S, Hq, Hkv, D, lengths, block_k, num_splits)
    "ragged_gqa_splits": (300, 4, 2, 64, (300, 1, 0, 157), 32, 4),
    "mha_d128_more_splits_than_blocks": (256, 2, 2, 128, (256, 200), 64, 16),
    "single_split": (96, 4, 1, 64, (50, 96), 32, 1),
    # 17 blocks in 4 splits of 5: the last split has 2 blocks (no padding, no divisor needed)
    "ragged_last_split": (17 * 16, 4, 2, 32, (17 * 16, 250, 81, 1), 16, 4),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case):
    seq_k, hq, hkv, head_dim, lengths, block_k, num_splits = case
    lengths = jnp.asarray(lengths, jnp.int32)
    q, k, v = _inputs(len(lengths), seq_k, hq, hkv, head_dim)
    kernel = jax.jit(lambda q, k, v, lengths: decode_attention(
        q, k, v, lengths, block_k=block_k, num_splits=num_splits, interpret=True))
    out = kernel(q, k, v, lengths)
    out_ref = reference.decode_attention_reference(q, k, v, lengths)
    assert out.shape == q.shape
    assert rel_err(out, out_ref) <= 1e-5
    empty = lengths == 0
    assert bool(jnp.all(jnp.where(empty[:, None, None], out == 0.0, True)))


def test_rejects_bad_arguments():
    q, k, v = _inputs(2, 64, 4, 2, 64)
    lengths = jnp.array([64, 10], jnp.int32)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q, k, v, lengths, num_splits=0)
    with pytest.raises(ValueError, match=r"\[B, Hq, D\]"):
        decode_attention(q[:, None], k, v, lengths)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q[:, :3], k, v, lengths)

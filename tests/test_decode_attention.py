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


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case):
    seq_k, hq, hkv, head_dim, lengths, block_k, num_splits = case
    lengths = jnp.asarray(lengths, jnp.int32)
    q, k, v = _inputs(len(lengths), seq_k, hq, hkv, head_dim)
    kernel = jax.jit(
        lambda q, k, v, lengths: decode_attention(
            q, k, v, lengths, block_k=block_k, num_splits=num_splits, interpret=True
        )
    )
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


def test_partial_decode_returns_the_lse_that_merges_shards():
    """`attend_partial` on a decode step with impl="pallas" (the split-K kernel, interpret mode) over two
    halves of a cache, as a generation mesh splits it: each half's output and log-sum-exp equal float64
    numpy's (a query that sees nothing in a half: zeros and a huge negative lse), and the halves merged by their
    lse equal attention over the whole cache."""
    import numpy as np

    from duo_jax.attention import MaskSpec, attend_partial

    B, S, Hq, Hkv, E = 3, 96, 4, 2, 16
    q, k, v = _inputs(B, S, Hq, Hkv, E, seed=3)
    positions = np.array([95, 30, 47])  # the query's position: it sees keys 0 ... position
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bhe,bshe->bhs", q64, np.repeat(k64, Hq // Hkv, axis=2)) / np.sqrt(E)
    values = np.repeat(v64, Hq // Hkv, axis=2)
    half = S // 2
    partial = jax.jit(lambda q, k, v, spec: attend_partial(q, k, v, spec, impl="pallas"))  # one trace for both
    outs, lses = [], []
    for i in range(2):
        offset = i * half
        spec = MaskSpec(
            jnp.asarray(positions - offset, jnp.int32)[:, None],
            jnp.asarray(np.clip(positions + 1 - offset, 0, half), jnp.int32),
        )
        out, lse = partial(q[:, None], k[:, offset : offset + half], v[:, offset : offset + half], spec)
        out, lse = np.asarray(out[:, 0], np.float64), np.asarray(lse[:, 0], np.float64)
        for b in range(B):
            seen = slice(offset, min(positions[b] + 1, offset + half))
            s = scores[b, :, seen]
            if s.shape[1] == 0:
                assert np.all(out[b] == 0) and np.all(lse[b] < -1e30), (i, b)
                continue
            ref_lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
            ref = np.einsum("hs,hse->he", np.exp(s - ref_lse[:, None]), values[b, seen].transpose(1, 0, 2))
            np.testing.assert_allclose(lse[b], ref_lse, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(out[b], ref, rtol=1e-4, atol=1e-5)
        outs.append(out)
        lses.append(lse)
    lses = np.stack(lses)
    weight = np.exp(lses - lses.max(0))
    merged = (np.stack(outs) * weight[..., None]).sum(0) / weight.sum(0)[..., None]
    mask = np.arange(S)[None, :] <= positions[:, None]
    p = np.where(mask[:, None], np.exp(scores - scores.max(-1, keepdims=True)), 0)
    whole = np.einsum("bhs,bshe->bhe", p / p.sum(-1, keepdims=True), values)
    np.testing.assert_allclose(merged, whole, rtol=1e-4, atol=1e-5)

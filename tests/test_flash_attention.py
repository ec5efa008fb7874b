"""Flash attention kernel (interpret mode) against the dense masked reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common, flash_attention, reference
from tests.conftest import random_attention_inputs, rel_err

CASES = {
    # name: (batch, T, S, Hq, Hkv, D, causal, q_offset, kv_len, block_q, block_k)
    "causal_ragged_gqa": (1, 100, 100, 4, 2, 64, True, 0, None, 32, 32),
    "q_offset_chunk": (1, 40, 104, 4, 2, 64, True, 64, None, 16, 32),
    # Per-sequence offsets and lengths; kv_len 0 leaves every query of sequence 0 empty.
    "per_batch_kv_len": (2, 16, 80, 2, 1, 64, True, (20, 50), (0, 66), 16, 16),
    "non_causal_d128_mha": (1, 48, 72, 2, 2, 128, False, 0, 50, 16, 32),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_forward_and_grad(case):
    batch, seq_q, seq_k, hq, hkv, head_dim, causal, q_offset, kv_len, block_q, block_k = case
    q, k, v, cotangent = random_attention_inputs(batch, seq_q, seq_k, hq, hkv, head_dim)
    q_offset = jnp.asarray(q_offset, jnp.int32)
    kv_len = None if kv_len is None else jnp.asarray(kv_len, jnp.int32)

    @jax.jit  # q_offset and kv_len are traced.
    def kernel(q, k, v, q_offset, kv_len):
        return flash_attention(
            q, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len, block_q=block_q, block_k=block_k, interpret=True
        )

    def ref(q, k, v, q_offset, kv_len):
        return reference.flash_attention_reference(q, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len)

    out, out_ref = kernel(q, k, v, q_offset, kv_len), ref(q, k, v, q_offset, kv_len)
    assert rel_err(out, out_ref) <= 1e-5

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, q_offset, kv_len) * cotangent)

    grads = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert g.shape == g_ref.shape
        assert bool(jnp.all(jnp.isfinite(g))), name
        assert rel_err(g, g_ref) <= 1e-4, name


def test_empty_rows_are_zero():
    q, k, v, _ = random_attention_inputs(1, 16, 16, 2, 2, 64)
    out = flash_attention(q, k, v, kv_len=0, block_q=16, block_k=16, interpret=True)
    assert bool(jnp.all(out == 0.0))


@pytest.mark.slow
def test_bfloat16_forward():
    q, k, v, _ = random_attention_inputs(1, 64, 64, 4, 2, 64)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = flash_attention(q, k, v, block_q=32, block_k=32, interpret=True)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out.astype(jnp.float32), reference.flash_attention_reference(q, k, v).astype(jnp.float32)) <= 2e-2


def test_rejects_bad_arguments():
    q, k, v, _ = random_attention_inputs(1, 16, 16, 3, 2, 64)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        flash_attention(q, k, v)
    q, k, v, _ = random_attention_inputs(1, 16, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="block_k"):
        flash_attention(q, k, v, block_k=0)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attention(q, k[..., :32], v[..., :32])


@pytest.mark.parametrize(
    "causal, window",
    [(True, None), (False, None), (True, (40, 50)), (True, (7, 20))],
    ids=["causal", "bidirectional", "lambda", "lambda-small-sink"],
)
def test_unmasked_blocks_are_exactly_the_wholly_visible_ones(causal, window):
    """`_common.unmasked_kv_blocks` (the tiles the forward kernel leaves unmasked) against the mask itself, over
    random chunk offsets, key lengths and padded query blocks: every row of the query block sees each of those
    key blocks whole, and they are all the whole blocks the schedule visits (a Λ band block that holds sink
    keys may be whole through them: those are left masked, the only exception)."""
    sink, recent = window or (None, None)
    rng = np.random.default_rng(0)
    for bq, bk in [(16, 32), (16, 16)]:
        static = dict(block_q=bq, block_k=bk, causal=causal, sink=sink, recent=recent)

        @jax.jit
        def blocks(q_block, q_offset, kv_len, seq_q):
            args = dict(static, q_offset=q_offset, kv_len=kv_len, seq_q=seq_q)
            schedule = _common.kv_block_schedule(q_block, **args)
            return schedule, _common.unmasked_kv_blocks(q_block, schedule=schedule, **args)

        for _ in range(100):
            seq_q, q_offset = int(rng.integers(1, 70)), int(rng.integers(0, 200))
            kv_len = int(rng.integers(0, q_offset + seq_q + 40))
            for q_block in range(-(-seq_q // bq)):
                check_unmasked_blocks(
                    *blocks(*map(jnp.int32, (q_block, q_offset, kv_len, seq_q))),
                    q_block,
                    q_offset=q_offset,
                    kv_len=kv_len,
                    seq_q=seq_q,
                    **static,
                )


def check_unmasked_blocks(
    schedule, unmasked, q_block, *, q_offset, kv_len, seq_q, block_q, block_k, causal, sink, recent
):
    sink_end, band_start, end = (int(x) for x in schedule)
    sink_whole, lo, hi = (int(x) for x in unmasked)
    assert 0 <= sink_whole <= sink_end and band_start <= lo <= hi <= end
    rows = q_block * block_q + np.arange(block_q)[:, None]
    visited = list(range(sink_end)) + list(range(band_start, end))
    whole = {
        j
        for j in visited
        if np.all(
            _common.attention_mask(
                rows,
                j * block_k + np.arange(block_k)[None, :],
                q_offset=q_offset,
                kv_len=kv_len,
                seq_q=seq_q,
                causal=causal,
                sink=sink,
                recent=recent,
            )
        )
    }
    unmasked = set(range(sink_whole)) | set(range(lo, hi))
    assert unmasked <= whole
    through_sinks = {j for j in whole - unmasked if j >= band_start and sink and j * block_k < sink}
    assert whole - unmasked == through_sinks, (sink_end, band_start, end, sink_whole, lo, hi, sorted(whole))


@pytest.mark.parametrize("own_keys", [False, True], ids=["every_block", "cut_at_the_diagonal"])
@pytest.mark.parametrize("seq_q, block_k", [(1, 32), (24, 16)], ids=["decode", "chunk"])
def test_keys_at_explicit_positions_match_float64(seq_q, block_k, own_keys):
    """k_positions (a streaming head's ring of shuffled positions with empty -1 slots, followed by the chunk's
    own keys): against float64 numpy with the mask written out, GQA 2:1, ragged kv_len, a row of a sequence
    whose keys are all empty getting zeros; S = 70 is not a multiple of the key block. With `own_keys`, the
    kernel is told where the chunk's keys start (key_offset) and stops each query block at its diagonal."""
    import numpy as np

    B, S, Hq, Hkv, D = 2, 70, 4, 2, 32
    q, k, v, _ = random_attention_inputs(B, seq_q, S, Hq, Hkv, D, seed=5)
    rng = np.random.default_rng(1)
    q_offset = np.array([200, 90])
    ring = S - seq_q
    positions = np.stack([rng.permutation(np.arange(q_offset[b] - ring, q_offset[b])) for b in range(B)])
    positions[0, rng.choice(ring, 9, replace=False)] = -1  # empty ring slots
    positions[1, :] = -1  # sequence 1's ring is empty: its first query sees only itself
    positions = np.concatenate([positions, q_offset[:, None] + np.arange(seq_q)], axis=1)
    kv_len = np.array([S, S - 3]) if seq_q > 3 else np.array([S, S])  # sequence 1: its last 3 chunk keys unwritten
    out = jax.jit(
        lambda q, k, v, off, n, pos: flash_attention(
            q,
            k,
            v,
            q_offset=off,
            kv_len=n,
            k_positions=pos,
            key_offset=ring if own_keys else None,
            block_q=16,
            block_k=block_k,
            interpret=True,
        )
    )(q, k, v, jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_len, jnp.int32), jnp.asarray(positions, jnp.int32))

    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    kn, vn = np.repeat(kn, Hq // Hkv, axis=2), np.repeat(vn, Hq // Hkv, axis=2)
    mask = (
        (np.arange(S)[None, None, :] < kv_len[:, None, None])
        & (positions[:, None, :] >= 0)
        & (positions[:, None, :] <= (q_offset[:, None] + np.arange(seq_q))[:, :, None])
    )  # [B, T, S]
    s = np.einsum("bthd,bshd->bhts", qn, kn) / np.sqrt(D)
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - np.max(s, axis=-1, keepdims=True))
    p = np.where(mask[:, None], p, 0.0)
    expected = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), vn)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5 * np.abs(expected).max())
    with pytest.raises(ValueError, match="k_positions must be int32"):
        flash_attention(q, k, v, k_positions=jnp.zeros((B, S + 1), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="key_offset .* needs k_positions"):
        flash_attention(q, k, v, key_offset=0, interpret=True)

"""Λ attention kernel (interpret mode) against the dense masked reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import causal_visited_blocks, lambda_attention, lambda_visited_blocks, reference
from tests.conftest import random_attention_inputs, rel_err

CASES = {
    # name: (batch, T, S, Hq, Hkv, D, sink, recent, q_offset, block_q, block_k)
    "ragged_gqa": (1, 100, 100, 4, 2, 64, 8, 20, 0, 32, 32),
    "sink0_mha_bq_ne_bk": (1, 64, 64, 2, 2, 64, 0, 16, 0, 32, 16),
    "recent_ge_T": (1, 48, 48, 2, 1, 64, 4, 64, 0, 16, 16),
    "head_dim128_batch2": (2, 80, 80, 2, 2, 128, 16, 24, 0, 32, 32),
    "q_offset_chunk": (1, 32, 96, 2, 1, 64, 8, 24, 64, 16, 16),
    # whole sink blocks and whole band blocks, whose tiles the forward leaves unmasked; the last query block padded
    "unmasked_tiles_chunk": (1, 72, 200, 4, 2, 64, 32, 56, 128, 16, 16),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_forward_and_grad(case):
    batch, seq_q, seq_k, hq, hkv, head_dim, sink, recent, q_offset, block_q, block_k = case
    q, k, v, cotangent = random_attention_inputs(batch, seq_q, seq_k, hq, hkv, head_dim)

    def kernel(q, k, v):
        return lambda_attention(
            q, k, v, sink=sink, recent=recent, q_offset=q_offset, block_q=block_q, block_k=block_k, interpret=True
        )

    def ref(q, k, v):
        return reference.lambda_attention_reference(q, k, v, sink=sink, recent=recent, q_offset=q_offset)

    assert rel_err(kernel(q, k, v), ref(q, k, v)) <= 1e-5

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)

    grads = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert g.shape == g_ref.shape
        assert rel_err(g, g_ref) <= 1e-4, name


@pytest.mark.slow
def test_recent_ge_T_is_causal():
    q, k, v, _ = random_attention_inputs(1, 40, 40, 2, 2, 64)
    out = lambda_attention(q, k, v, sink=0, recent=40, block_q=16, block_k=16, interpret=True)
    assert rel_err(out, reference.flash_attention_reference(q, k, v)) <= 1e-5


def _blocks_touched(seq_len, sink, recent, block_q, block_k):
    """Counts (q block, k block) tiles holding at least one True of the dense Λ mask."""
    mask = reference.lambda_mask_np(seq_len, sink, recent)
    nq, nk = -(-seq_len // block_q), -(-seq_len // block_k)
    padded = np.zeros((nq * block_q, nk * block_k), bool)
    padded[:seq_len, :seq_len] = mask
    tiles = padded.reshape(nq, block_q, nk, block_k).any(axis=(1, 3))
    return int(tiles.sum())


@pytest.mark.parametrize(
    "seq_len,sink,recent,block_q,block_k",
    [
        (1000, 128, 256, 128, 128),
        (1000, 100, 200, 64, 32),
        (777, 0, 50, 32, 64),
        (300, 5, 1, 16, 16),
        (512, 64, 600, 64, 64),  # recent >= T: every causal tile.
        (2048, 300, 256, 128, 128),  # sink blocks overlap the band early on.
    ],
)
def test_visited_blocks_equal_touched_tiles(seq_len, sink, recent, block_q, block_k):
    visited = lambda_visited_blocks(seq_len, sink, recent, block_q, block_k)
    assert visited == _blocks_touched(seq_len, sink, recent, block_q, block_k)


def test_visited_blocks_grow_linearly():
    lam = [lambda_visited_blocks(t, 128, 256, 128, 128) for t in (4096, 8192)]
    causal = [causal_visited_blocks(t, 128, 128) for t in (4096, 8192)]
    assert 1.9 <= lam[1] / lam[0] <= 2.05
    assert 3.9 <= causal[1] / causal[0] <= 4.05
    # 32 query blocks: blocks 0..2 see 1, 2, 3 KV blocks, the others one sink block + three band blocks.
    assert lam[0] == 1 + 2 + 3 + 29 * 4


def test_rejects_bad_arguments():
    q, k, v, _ = random_attention_inputs(1, 16, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="sink"):
        lambda_attention(q, k, v, sink=-1, recent=4)
    with pytest.raises(ValueError, match="recent"):
        lambda_attention(q, k, v, sink=4, recent=0)
    with pytest.raises(ValueError, match="block_q"):
        lambda_visited_blocks(16, 4, 4, 0, 16)


@pytest.mark.slow
def test_skipped_blocks_are_never_read():
    # Queries at positions 80..95 with sink 8, recent 16: keys 8..64 are outside every window, so
    # 16-key blocks 1..3 (keys 16..63) must be skipped. NaN values there would poison any visit
    # (p * v = 0 * NaN), in the forward pass and in the dq / dk / dv kernels.
    q, k, v, cotangent = random_attention_inputs(1, 16, 96, 2, 2, 64)
    v = v.at[:, 16:64].set(jnp.nan)

    def loss(q, k, v):
        out = lambda_attention(q, k, v, sink=8, recent=16, q_offset=80, block_q=16, block_k=16, interpret=True)
        return jnp.sum(out * cotangent)

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert bool(jnp.isfinite(value))
    for g in grads:
        assert bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("one_loop", [False, True], ids=["runs", "one_loop"])
def test_one_loop_forward_matches_reference(one_loop):
    """`one_loop` (a tuning knob: every tile masked in one loop) gives Λ's values, over whole sink and band
    blocks and a padded query block; the forward is one while loop with it and four without (Λ's runs)."""
    batch, seq_q, seq_k, hq, hkv, head_dim, sink, recent, q_offset, block_q, block_k = CASES["unmasked_tiles_chunk"]
    q, k, v, _ = random_attention_inputs(batch, seq_q, seq_k, hq, hkv, head_dim)
    kwargs = dict(sink=sink, recent=recent, q_offset=q_offset)
    kernel = functools.partial(
        lambda_attention, **kwargs, block_q=block_q, block_k=block_k, interpret=True, one_loop=one_loop
    )
    ref = reference.lambda_attention_reference(q, k, v, **kwargs)
    assert rel_err(kernel(q, k, v), ref) <= 1e-5
    assert str(jax.make_jaxpr(kernel)(q, k, v)).count("while[") == (1 if one_loop else 4)

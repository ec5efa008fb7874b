"""duo_jax.attention.xla (the blocked online softmax) and MaskSpec against a float64 numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from duo_jax.attention import MaskSpec, prefix_spec, xla
from tests.conftest import random_attention_inputs, rel_err


def mask_np(spec: MaskSpec, num_keys: int) -> np.ndarray:
    """The mask rule by rule in int64 numpy (independent of MaskSpec.visible)."""
    qp = np.asarray(spec.q_positions, np.int64)[:, :, None]
    slots = np.arange(num_keys)[None, None, :]
    kp = slots if spec.k_positions is None else np.asarray(spec.k_positions, np.int64)[:, None, :]
    mask = (slots < np.asarray(spec.kv_len, np.int64)[:, None, None]) & (kp >= 0)
    if spec.causal:
        mask = mask & (kp <= qp)
    if spec.window is not None:
        mask = mask & (qp - kp < spec.window)
    if spec.sink is not None:
        mask = mask & ((kp < spec.sink) | (qp - kp < spec.recent))
    return mask


def attention_np(q, k, v, mask):
    """float64 softmax attention with GQA; empty rows give zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, E = q.shape
    K = k.shape[2]
    s = np.einsum("btkge,bske->bkgts", q.reshape(B, T, K, H // K, E), k) / np.sqrt(E)
    s = np.where(mask[:, None, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(mask[:, None, None], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bkgts,bske->btkge", p, v).reshape(B, T, H, E)


RULES = [
    dict(),
    dict(causal=False),
    dict(window=9),
    dict(sink=4, recent=11),
    dict(sink=0, recent=5),
    dict(sink=3, recent=7, window=12),
]


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES, ids=lambda r: ",".join(f"{k}={v}" for k, v in r.items()) or "causal")
@pytest.mark.parametrize("blocks", [(16, 32), (8, 7), (512, 512)], ids=str)
def test_contiguous_cache_matches_float64(rule, blocks):
    """Ragged per-sequence offsets and key lengths (one sequence empty), GQA 3:1, blocks not dividing T or S."""
    B, T, S = 3, 21, 90
    q, k, v, _ = random_attention_inputs(B, T, S, 6, 2, 16)
    spec = prefix_spec(B, T, q_offset=jnp.array([40, 0, 5]), kv_len=jnp.array([61, 21, 0]), num_keys=S, **rule)
    mask = mask_np(spec, S)
    assert np.array_equal(np.asarray(spec.dense(S)), mask)
    out = xla.attention(q, k, v, spec, block_q=blocks[0], block_k=blocks[1])
    ref = attention_np(q, k, v, mask)
    assert np.max(np.abs(np.asarray(out) - ref)) <= 1e-5 * np.max(np.abs(ref))
    assert not np.any(np.asarray(out)[2]), "a sequence with no keys attends to nothing"


@pytest.mark.slow
@pytest.mark.parametrize("block_k", [16, 64], ids=["tiles", "one-tile"])
def test_explicit_key_positions_match_float64(block_k):
    """A ring cache: slots hold arbitrary positions, -1 empty; in tiles, or all in one (no loop)."""
    B, T, S = 2, 5, 40
    q, k, v, _ = random_attention_inputs(B, T, S, 4, 4, 32, seed=3)
    k_positions = jnp.asarray(np.random.default_rng(0).integers(-1, 70, (B, S)), jnp.int32)
    spec = MaskSpec(jnp.array([[60], [30]]) + jnp.arange(T), jnp.array([S, 33]), k_positions, sink=4, recent=20)
    out = jax.jit(xla.attention, static_argnames="block_k")(q, k, v, spec, block_k=block_k)
    ref = attention_np(q, k, v, mask_np(spec, S))
    assert np.max(np.abs(np.asarray(out) - ref)) <= 1e-5 * np.max(np.abs(ref))


@pytest.mark.slow
@pytest.mark.parametrize("rule", [dict(), dict(sink=4, recent=11), dict(window=9)], ids=str)
def test_gradients_match_dense(rule):
    B, T, S = 2, 33, 33
    q, k, v, cotangent = random_attention_inputs(B, T, S, 4, 2, 16, seed=1)
    spec = prefix_spec(B, T, num_keys=S, **rule)
    mask = jnp.asarray(mask_np(spec, S))

    def dense(q, k, v):  # jnp with the explicit mask: the gradient reference
        G = q.shape[2] // k.shape[2]
        s = jnp.einsum("btkge,bske->bkgts", q.reshape(B, T, 2, G, 16), k) / 4.0
        p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -jnp.inf), axis=-1)
        return jnp.einsum("bkgts,bske->btkge", p, v).reshape(q.shape)

    grads = jax.vjp(lambda *a: xla.attention(*a, spec, block_q=8, block_k=16), q, k, v)[1](cotangent)
    refs = jax.vjp(dense, q, k, v)[1](cotangent)
    for g, r in zip(grads, refs):
        assert rel_err(g, r) <= 1e-4


@pytest.mark.slow
def test_blocks_outside_the_schedule_are_never_read():
    """NaN in every key block the spec cannot see (past the block of the last filled slot; between Λ's
    sinks and band): the output stays finite, so those blocks are skipped, not masked."""
    B, T, S, block = 1, 16, 256, 16
    q, k, v, _ = random_attention_inputs(B, T, S, 2, 1, 16)
    offset, filled = 100, 116
    spec = prefix_spec(B, T, q_offset=offset, kv_len=filled, num_keys=S, sink=16, recent=32)
    poison = np.ones(S, bool)
    poison[:16] = False  # the sink block
    poison[(offset - 32 + 1) // block * block : -(-filled // block) * block] = (
        False  # the band's blocks to the last filled one
    )
    k = jnp.where(jnp.asarray(poison)[None, :, None, None], jnp.nan, k)
    v = jnp.where(jnp.asarray(poison)[None, :, None, None], jnp.nan, v)
    out = xla.attention(q, k, v, spec, block_q=16, block_k=block)
    assert np.isfinite(np.asarray(out)).all()
    ref = attention_np(jnp.nan_to_num(q), jnp.nan_to_num(k), jnp.nan_to_num(v), mask_np(spec, S))
    assert np.max(np.abs(np.asarray(out) - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_temp_memory_does_not_grow_with_capacity():
    """XLA's memory analysis of a 64-token chunk: the same temp bytes for a 1k- and a 16k-slot cache."""

    def temp_bytes(capacity):
        q = jax.ShapeDtypeStruct((1, 64, 8, 64), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, capacity, 2, 64), jnp.bfloat16)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)

        def chunk(q, k, v, lengths):
            spec = prefix_spec(1, 64, q_offset=lengths, kv_len=lengths + 64, num_keys=capacity)
            return xla.attention(q, k, v, spec)

        return jax.jit(chunk).lower(q, kv, kv, lengths).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(1024), temp_bytes(16384)
    assert large <= 1.1 * small, (small, large)


def test_mask_spec_rejects_half_a_lambda():
    with pytest.raises(ValueError, match="both sink and recent"):
        MaskSpec(jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), sink=4)


def test_key_blocks_are_balanced():
    """576 keys (DuoAttention's sink 64 + recent 256 + a 256-token chunk) are two blocks of 288, not 512 + a
    512 shifted back over the first (1024 slots scored); a capacity that 512 divides keeps 512."""
    assert xla.balanced_block(576, 512) == 288
    assert xla.balanced_block(8192, 512) == 512
    assert xla.balanced_block(1152, 512) == 384
    assert xla.balanced_block(5, 512) == 5
    for S in range(1, 700, 37):
        block = xla.balanced_block(S, 64)
        assert block <= max(S, 64) and -(-S // block) * block < S + 8 * -(-S // 64)


def test_key_tiles_follow_the_query_blocks_over_a_contiguous_cache():
    """Over a contiguous causal cache a key tile is a query block long (its causal boundary on a tile
    boundary); over slots holding arbitrary positions, tiles stay balanced; a decode query keeps `block_k`."""
    S = 1152
    spec = prefix_spec(1, 256, q_offset=512, kv_len=768, num_keys=S)
    assert xla.key_block(spec, S, block_q=256, block_k=512) == 256
    assert xla.key_block(prefix_spec(1, 1, q_offset=5, kv_len=6, num_keys=S), S, block_q=1, block_k=512) == 384
    ring = MaskSpec(jnp.zeros((1, 4), jnp.int32), jnp.full((1,), 576), jnp.zeros((1, 576), jnp.int32))
    assert xla.key_block(ring, 576, block_q=4, block_k=512) == 288
    assert xla.key_block(spec, 100, block_q=256, block_k=512) == 100


@pytest.mark.slow
@pytest.mark.parametrize("offsets", [(256, 256), (255, 0), (300, 17)], ids=str)
def test_chunks_at_tile_boundaries_match_float64(offsets):
    """A 64-query chunk in blocks of 16 over 16-slot tiles, its causal edge on a tile boundary or off it,
    per-sequence offsets (the diagonal tile and the shifted last tile of the cache)."""
    B, T, S = 2, 64, 368
    q, k, v, _ = random_attention_inputs(B, T, S, 6, 2, 16, seed=4)
    offsets = jnp.asarray(offsets)
    spec = prefix_spec(B, T, q_offset=offsets, kv_len=offsets + T, num_keys=S)
    out = xla.attention(q, k, v, spec, block_q=16, block_k=64)
    ref = attention_np(q, k, v, mask_np(spec, S))
    assert np.max(np.abs(np.asarray(out) - ref)) <= 1e-5 * np.max(np.abs(ref))


@pytest.mark.slow
@pytest.mark.parametrize("rule", [dict(), dict(window=9)], ids=["causal", "window=9"])
def test_bfloat16_queries_match_float64(rule):
    """bf16 queries keep the scale after the matmul (fp32 ones fold it into the queries) and tiles seen whole
    skip the mask: against float64 on the same bf16-rounded inputs, within bf16's output rounding."""
    B, T, S = 2, 48, 200
    q, k, v, _ = random_attention_inputs(B, T, S, 6, 2, 16, seed=7)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    spec = prefix_spec(B, T, q_offset=jnp.array([100, 30]), kv_len=jnp.array([148, 78]), num_keys=S, **rule)
    out = xla.attention(q, k, v, spec, block_q=16, block_k=16)
    assert out.dtype == jnp.bfloat16
    ref = attention_np(q, k, v, mask_np(spec, S))
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 1e-2 * np.max(np.abs(ref))

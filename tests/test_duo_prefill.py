"""DuoAttention's one-launch prefill kernel (interpret mode, and lowered for CUDA) against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.duo_prefill import duo_prefill_attention
from tests.conftest import rel_err

CASES = {
    # name: (B, T, C, R, kv_order (retrieval heads first), n, G, D, q_offsets, n_valid, ring_filled, block_q, block_k)
    "gqa_ragged_offsets": (2, 48, 128, 20, (2, 0, 1), 1, 2, 32, (0, 37), (48, 30), (0, 20), 16, 16),
    "mixed_order_full_ring": (1, 64, 256, 40, (3, 1, 0, 2), 2, 3, 16, (100,), (64,), (40,), 32, 16),
    "ring_larger_than_chunk": (2, 16, 64, 48, (0, 1), 1, 4, 32, (5, 40), (16, 9), (5, 40), 16, 32),
}


def _case_inputs(B, T, C, R, order, n, G, D, offsets, n_valid, filled, seed=0):
    """Random q / k / v and the caches a duo layer would hold: the retrieval cache with the chunk written at its
    positions, a ring holding `filled` tokens before the chunk (positions of the last ones before it), then the
    chunk's own keys (positions -1 past n_valid)."""
    K = len(order)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, K * G, D)).astype(np.float32)
    k = rng.standard_normal((B, C, n, D)).astype(np.float32)
    v = rng.standard_normal((B, C, n, D)).astype(np.float32)
    window_k = rng.standard_normal((B, R + T, K - n, D)).astype(np.float32)
    window_v = rng.standard_normal((B, R + T, K - n, D)).astype(np.float32)
    positions = np.full((B, R + T), -1, np.int32)
    for b in range(B):
        before = np.arange(offsets[b] - filled[b], offsets[b])  # the ring's tokens, in some slot order
        positions[b, rng.permutation(R)[: filled[b]]] = before
        positions[b, R : R + n_valid[b]] = offsets[b] + np.arange(n_valid[b])
    return q, k, v, window_k, window_v, positions


def _reference(q, k, v, window_k, window_v, positions, order, n, offsets, kv_len):
    """Float64: each query head over its own KV head's visible keys, in the model's head order."""
    q, k, v, window_k, window_v = (np.asarray(x, np.float64) for x in (q, k, v, window_k, window_v))
    B, T, H, D = q.shape
    G = H // len(order)
    slot = {head: i for i, head in enumerate(order)}  # model KV head -> its place in the caches' order
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            place = slot[h // G]
            for t in range(T):
                pos = offsets[b] + t
                if place < n:
                    j = np.arange(min(pos + 1, kv_len[b]))
                    keys, values = k[b, j, place], v[b, j, place]
                else:
                    seen = (positions[b] >= 0) & (positions[b] <= pos)
                    keys, values = window_k[b, seen, place - n], window_v[b, seen, place - n]
                if not len(keys):
                    continue
                scores = keys @ q[b, t, h] / np.sqrt(D)
                p = np.exp(scores - scores.max())
                out[b, t, h] = p @ values / p.sum()
    return out


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_float64(case):
    B, T, C, R, order, n, G, D, offsets, n_valid, filled, block_q, block_k = case
    q, k, v, wk, wv, positions = _case_inputs(B, T, C, R, order, n, G, D, offsets, n_valid, filled)
    kv_len = np.asarray(offsets) + np.asarray(n_valid)
    out = duo_prefill_attention(
        *(jnp.asarray(x) for x in (q, k, v, wk, wv, positions)),
        kv_order=order,
        q_offset=jnp.asarray(offsets, jnp.int32),
        kv_len=jnp.asarray(kv_len, jnp.int32),
        block_q=block_q,
        block_k=block_k,
        interpret=True,
    )
    ref = _reference(q, k, v, wk, wv, positions, order, n, offsets, kv_len)
    valid = np.arange(T)[None, :] < np.asarray(n_valid)[:, None]  # padding rows are never read
    assert out.shape == q.shape
    assert rel_err(out[valid], ref[valid]) < 1e-5


def test_bfloat16_matches_float64():
    B, T, C, R, order, n, G, D, offsets, n_valid, filled, _, _ = CASES["mixed_order_full_ring"]
    q, k, v, wk, wv, positions = _case_inputs(B, T, C, R, order, n, G, D, offsets, n_valid, filled, seed=1)
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    out = duo_prefill_attention(
        *(bf16(x) for x in (q, k, v, wk, wv)),
        jnp.asarray(positions),
        kv_order=order,
        q_offset=offsets[0],
        kv_len=offsets[0] + n_valid[0],
        interpret=True,
    )
    rounded = [np.asarray(bf16(x), np.float32) for x in (q, k, v, wk, wv)]
    ref = _reference(*rounded, positions, order, n, offsets, [offsets[0] + n_valid[0]])
    assert out.dtype == jnp.bfloat16 and rel_err(out.astype(jnp.float32), ref) < 2e-2


def test_rejects_what_it_cannot_serve():
    q, k, v, wk, wv, positions = _case_inputs(1, 16, 64, 8, (0, 1), 1, 2, 16, (0,), (16,), (0,))
    args = dict(kv_order=(0, 1), q_offset=0, kv_len=16, interpret=True)
    with pytest.raises(ValueError, match="retrieval and streaming heads"):
        duo_prefill_attention(q, k[:, :, :0], v[:, :, :0], wk, wv, positions, **args)
    with pytest.raises(ValueError, match="ring slots then the chunk"):
        duo_prefill_attention(q, k, v, wk[:, :8], wv[:, :8], positions[:, :8], **args)
    with pytest.raises(ValueError, match="kv_order"):
        duo_prefill_attention(q, k, v, wk, wv, positions, **dict(args, kv_order=(0, 0)))


def test_lowers_to_one_triton_kernel():
    """Exported for CUDA from this host: one Triton launch on a grid over every head, no gather of heads around it."""
    from tests.test_backend import TRITON, cuda_module, executed, triton_kernels

    B, T, C, R, n, K_s, G, D = 1, 2048, 8192, 320, 3, 5, 4, 128
    shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    ints = shape(B, dtype=jnp.int32)
    order = (5, 0, 7, 1, 2, 3, 4, 6)
    module = cuda_module(
        lambda q, k, v, wk, wv, pos, offset, kv_len: duo_prefill_attention(
            q, k, v, wk, wv, pos, kv_order=order, q_offset=offset, kv_len=kv_len
        ),
        shape(B, T, (n + K_s) * G, D),
        shape(B, C, n, D),
        shape(B, C, n, D),
        shape(B, R + T, K_s, D),
        shape(B, R + T, K_s, D),
        shape(B, R + T, dtype=jnp.int32),
        ints,
        ints,
    )
    assert module.count(f"custom_call @{TRITON}") == 1
    (launch,) = triton_kernels(module)
    # heads last (the slowest grid axis), in the caches' order: the retrieval heads' programs launch first
    assert launch["name"].startswith("duo_prefill_attention") and launch["grid"] == (B, T // 128, (n + K_s) * G)
    assert executed(module, "stablehlo.gather") == 0


def test_streaming_schedule_stops_at_the_diagonal():
    """The streaming heads' key blocks: every ring block, then the chunk's up to each query block's diagonal
    (keys at explicit positions alone would visit every block)."""
    from pallas_kernels import _common
    from pallas_kernels.flash_attention import Config

    R, T, block = 320, 2048, 64
    common = dict(seq_q=T, causal=True, sink=None, recent=None, scale=1.0, block_q=block, block_k=block)
    cut = Config(**common, interpret=True, k_positions=True, key_offset=R)
    uncut = Config(**common, interpret=True, k_positions=True)
    for q_block in (0, 5, T // block - 1):
        visited = {}
        for name, cfg in (("cut", cut), ("uncut", uncut)):
            _, _, end = _common.kv_block_schedule(
                q_block,
                q_offset=cfg.schedule_offset(jnp.int32(10_000)),  # the chunk's position: no bound on slots
                kv_len=jnp.int32(R + T),
                seq_q=T,
                block_q=block,
                block_k=block,
                **cfg.schedule_window,
            )
            visited[name] = int(end)
        assert visited["cut"] == (R + (q_block + 1) * block) // block and visited["uncut"] == (R + T) // block

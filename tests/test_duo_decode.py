"""DuoAttention's one-launch decode kernel (interpret mode, and lowered for CUDA) against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _backend
from pallas_kernels._common import exact_block
from pallas_kernels.duo_decode import duo_decode_attention
from tests.conftest import rel_err

CASES = {
    # name: (B, C, S, n, K_s, G, D, lengths, ring_lengths, block_k, num_splits)
    "gqa_ragged": (3, 256, 48, 2, 3, 4, 64, (256, 97, 1), (48, 20, 0), 32, 4),
    "one_retrieval_head_many_splits": (2, 128, 80, 1, 5, 2, 32, (128, 128), (80, 80), 16, 16),
    "ring_at_capacity_single_split": (1, 64, 320, 3, 1, 1, 128, (40,), (320,), 64, 1),
}


def _reference(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new):
    """Float64: each query head over its own KV head's visible keys, written as one softmax over a key list."""
    q, k, v, ring_k, ring_v, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k, v, ring_k, ring_v, k_new, v_new))
    B, H, D = q.shape
    n = k.shape[2]
    G = H // (n + ring_k.shape[2])
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            kv = h // G
            if kv < n:
                keys, values = k[b, : lengths[b], kv], v[b, : lengths[b], kv]
            else:
                s = kv - n
                keys = np.concatenate([ring_k[b, : ring_lengths[b], s], k_new[b, s][None]])
                values = np.concatenate([ring_v[b, : ring_lengths[b], s], v_new[b, s][None]])
            if not len(keys):
                continue
            scores = keys @ q[b, h] / np.sqrt(D)
            p = np.exp(scores - scores.max())
            out[b, h] = p @ values / p.sum()
    return out


def _inputs(B, C, S, n, K_s, G, D, seed=0):
    keys = jax.random.split(jax.random.key(seed), 7)
    H = (n + K_s) * G
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    return (
        normal(keys[0], (B, H, D)),
        normal(keys[1], (B, C, n, D)),
        normal(keys[2], (B, C, n, D)),
        normal(keys[3], (B, S, K_s, D)),
        normal(keys[4], (B, S, K_s, D)),
        normal(keys[5], (B, K_s, D)),
        normal(keys[6], (B, K_s, D)),
    )


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.slow
def test_matches_float64(case):
    B, C, S, n, K_s, G, D, lengths, ring_lengths, block_k, num_splits = case
    q, k, v, ring_k, ring_v, k_new, v_new = _inputs(B, C, S, n, K_s, G, D)
    lengths, ring_lengths = np.asarray(lengths, np.int32), np.asarray(ring_lengths, np.int32)
    out = jax.jit(lambda *a: duo_decode_attention(*a, block_k=block_k, num_splits=num_splits, interpret=True))(
        q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new
    )
    expected = _reference(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, expected) <= 1e-5
    empty = np.repeat(np.arange(n + K_s) < n, G)[None, :] & (lengths[:, None] == 0)
    assert bool(jnp.all(jnp.where(empty[..., None], out == 0.0, True)))  # a retrieval head with no key: zeros


@pytest.mark.parametrize("page_size, block_k", [(16, 32), (32, 16)])
@pytest.mark.slow
def test_paged_retrieval_cache_matches_float64(page_size, block_k):
    """The retrieval heads' cache in pages of a shared pool (each sequence's pages scattered, "no page" entries
    past its length): the same attention as over the contiguous cache they hold."""
    B, M, S, n, K_s, G, D = 2, 6, 48, 2, 3, 4, 64
    q, k, v, ring_k, ring_v, k_new, v_new = _inputs(B, M * page_size, S, n, K_s, G, D, seed=2)
    pages = np.random.default_rng(0).permutation(B * M + 3).astype(np.int32)[: B * M].reshape(B, M)
    pool = lambda x: (
        jnp.zeros((n, B * M + 3, page_size, D), jnp.float32)  # noqa: E731
        .at[:, pages.reshape(-1)]
        .set(x.reshape(B * M, page_size, n, D).transpose(2, 0, 1, 3))
    )
    lengths, ring_lengths = np.asarray([M * page_size - 5, 17], np.int32), np.asarray([48, 7], np.int32)
    tables = np.where(np.arange(M)[None, :] * page_size < lengths[:, None], pages, 10_000)  # past the length: none
    out = jax.jit(
        lambda *a, t: duo_decode_attention(*a, block_tables=t, block_k=block_k, num_splits=3, interpret=True)
    )(q, pool(k), pool(v), lengths, ring_k, ring_v, ring_lengths, k_new, v_new, t=jnp.asarray(tables))
    expected = _reference(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new)
    assert rel_err(out, expected) <= 1e-5


@pytest.mark.slow
def test_bfloat16_matches_float64():
    B, C, S, n, K_s, G, D = 2, 256, 64, 2, 2, 4, 128
    q, k, v, ring_k, ring_v, k_new, v_new = (x.astype(jnp.bfloat16) for x in _inputs(B, C, S, n, K_s, G, D, seed=1))
    lengths, ring_lengths = np.asarray([200, 256], np.int32), np.asarray([64, 33], np.int32)
    out = duo_decode_attention(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new, interpret=True)
    expected = _reference(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new)
    assert out.dtype == jnp.bfloat16 and rel_err(out.astype(jnp.float32), expected) <= 2e-2


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_heads_in_the_models_order(paged):
    """With kv_order, q, the new token's k / v and the output stay in the model's head order (retrieval heads
    2 and 0, streaming heads 4, 1 and 3): the same attention as the caches' order, heads permuted; the
    retrieval heads' rows of k_new / v_new are never read (filled with NaN)."""
    B, C, S, n, K_s, G, D, page_size = 2, 64, 48, 2, 3, 2, 32, 16
    order = (2, 0, 4, 1, 3)
    q, k, v, ring_k, ring_v, k_new, v_new = _inputs(B, C, S, n, K_s, G, D, seed=3)
    lengths, ring_lengths = np.asarray([64, 23], np.int32), np.asarray([48, 5], np.int32)
    expected = _reference(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new)
    slot = np.argsort(order)  # slot[m]: model head m's place in the caches' order
    query_rows = (slot[:, None] * G + np.arange(G)).reshape(-1)  # the caches'-order rows of each model head's group

    def every_head(x):  # [B, K_s, D] streaming heads -> [B, K, D] in the model's order, NaN on retrieval heads
        rows = np.full((B, n + K_s, D), np.nan, np.float32)
        rows[:, [m for m in range(n + K_s) if slot[m] >= n]] = np.asarray(x)[
            :, [slot[m] - n for m in range(n + K_s) if slot[m] >= n]
        ]
        return jnp.asarray(rows)

    retrieval, extra = (k, v), {}
    if paged:
        pages = np.arange(B * C // page_size, dtype=np.int32).reshape(B, -1)
        retrieval = tuple(x.reshape(B * C // page_size, page_size, n, D).transpose(2, 0, 1, 3) for x in (k, v))
        extra = dict(block_tables=jnp.asarray(pages))
    out = duo_decode_attention(
        q[:, query_rows],
        *retrieval,
        lengths,
        ring_k,
        ring_v,
        ring_lengths,
        every_head(k_new),
        every_head(v_new),
        kv_order=order,
        block_k=16,
        num_splits=2,
        interpret=True,
        **extra,
    )
    assert rel_err(out, expected[:, query_rows]) <= 1e-5


def test_exact_block():
    assert [exact_block(s) for s in (320, 256, 48, 1024, 40, 7)] == [64, 128, 16, 128, None, None]
    assert exact_block(2368, 128) == 64  # a ring of 320 and a chunk of 2,048


def test_rejects_what_it_cannot_serve():
    q, k, v, ring_k, ring_v, k_new, v_new = _inputs(1, 128, 40, 2, 2, 2, 32)
    lengths = np.asarray([10], np.int32)
    with pytest.raises(ValueError, match="power-of-two key block"):
        duo_decode_attention(q, k, v, lengths, ring_k, ring_v, lengths, k_new, v_new, interpret=True)
    with pytest.raises(ValueError, match="retrieval and streaming heads"):
        duo_decode_attention(
            q, k[:, :, :0], v[:, :, :0], lengths, ring_k, ring_v, lengths, k_new, v_new, interpret=True
        )
    with pytest.raises(ValueError, match="k_new / v_new"):
        duo_decode_attention(
            q, k, v, lengths, ring_k[:, :32], ring_v[:, :32], lengths, k_new[:, :1], v_new, interpret=True
        )


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_lowers_to_one_triton_kernel(paged):
    """Exported for CUDA from this host, heads routed and the ring written by the kernel: one Triton launch on the
    decode grid, neither cache copied or padded (the ring + token of S + 1 slots never exists; pages are never
    gathered into a contiguous cache), no gather or scatter around it, the ring (and a contiguous cache) aliased
    in place."""
    from tests.test_backend import TRITON, cuda_module, executed, triton_kernels

    B, C, S, n, K_s, G, D, P = 2, 8192, 320, 2, 6, 4, 128, 16
    shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    ints = shape(B, dtype=jnp.int32)
    retrieval = shape(n, B * C // P, P, D) if paged else shape(B, C, n, D)
    tables = {"block_tables": jnp.zeros((B, C // P), jnp.int32)} if paged else {}
    order = (3, 0, 1, 2, 4, 5, 6, 7)  # heads routed in the index maps: the model's order in, and out
    module = cuda_module(
        lambda *a: duo_decode_attention(
            *a, num_splits=64, kv_order=order, ring_slots=a[3], cache_slots=None if paged else a[3], **tables
        )[0],
        shape(B, (n + K_s) * G, D),
        retrieval,
        retrieval,
        ints,
        shape(B, S, K_s, D),
        shape(B, S, K_s, D),
        ints,
        shape(B, n + K_s, D),
        shape(B, n + K_s, D),
    )
    assert module.count(f"custom_call @{TRITON}") == 1
    (launch,) = triton_kernels(module)
    # one program per (retrieval head, split) and per streaming head: none for a split a ring does not have
    assert launch["name"].startswith("duo_decode_attention") and launch["grid"][:2] == (B, n * 64 + K_s)
    assert f"{B}x{S + 1}x" not in module  # no ring + token copy
    assert executed(module, "stablehlo.gather") == 0  # no head gathered around the kernel
    # the ring (and the contiguous cache) written in place: aliased, no scatter or update around the kernel
    assert executed(module, "stablehlo.scatter") == 0 and executed(module, "stablehlo.dynamic_update_slice") == 0
    assert module.count("output_tuple_indices") == (2 if paged else 4)
    if paged:
        assert f"{B}x{C}x{n}x{D}x" not in module  # no contiguous view of the pages
    else:
        assert f"{B}x{C}x{n}x{D}xbf16" in module
    assert _backend.exporting() is False


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_writes_the_new_token_into_the_ring(paged):
    """With ring_slots the kernel also writes the new token's k / v into each sequence's ring slot after reading
    the ring (the attention is that of the ring before the write), and leaves every other slot, and a sequence
    whose slot is past the ring, as they were."""
    B, C, S, n, K_s, G, D, page_size = 3, 64, 48, 2, 3, 2, 32, 16
    q, k, v, ring_k, ring_v, k_new, v_new = _inputs(B, C, S, n, K_s, G, D, seed=4)
    lengths, ring_lengths = np.asarray([64, 23, 5], np.int32), np.asarray([48, 5, 0], np.int32)
    slots = np.asarray([7, 5, S], np.int32)  # the slot of sequence 0 holds a key its query still sees
    expected = _reference(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new)
    retrieval, extra = (k, v), {}
    if paged:
        pages = np.arange(B * C // page_size, dtype=np.int32).reshape(B, -1)
        retrieval = tuple(x.reshape(B * C // page_size, page_size, n, D).transpose(2, 0, 1, 3) for x in (k, v))
        extra = dict(block_tables=jnp.asarray(pages))
    out, new_k, new_v = jax.jit(
        lambda *a: duo_decode_attention(*a, ring_slots=jnp.asarray(slots), block_k=16, num_splits=2, **extra),
        donate_argnums=(4, 5),  # the ring, updated in place
    )(q, *retrieval, lengths, jnp.array(ring_k), jnp.array(ring_v), ring_lengths, k_new, v_new)
    assert rel_err(out, expected) <= 1e-5
    for ring, new, written in ((ring_k, k_new, new_k), (ring_v, v_new, new_v)):
        want = np.array(ring)
        for b in range(B):
            if slots[b] < S:
                want[b, slots[b]] = np.asarray(new)[b]
        np.testing.assert_array_equal(np.asarray(written), want)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_writes_the_new_token_into_both_caches(paged):
    """With cache_slots too (heads in the model's order), the retrieval heads see their cache below each
    sequence's slot plus the new token, which the kernel writes there (paged: into the page its block table names,
    in a shared pool whose pages are scattered): the attention and both caches equal those of writing the token
    first and attending after (a slot past the cache, a padding row's: nothing written)."""
    B, C, S, n, K_s, G, D, P = 3, 64, 48, 2, 3, 2, 32, 16
    order = (2, 0, 4, 1, 3)
    q, k, v, ring_k, ring_v, _, _ = _inputs(B, C, S, n, K_s, G, D, seed=5)
    k_all, v_all = (jax.random.normal(jax.random.key(s), (B, n + K_s, D), jnp.float32) for s in (6, 7))
    old, ring_lengths = np.asarray([40, 0, 63], np.int32), np.asarray([48, 5, 0], np.int32)
    cache_slots, ring_slots = np.asarray([40, 0, C], np.int32), np.asarray([7, 5, S], np.int32)
    slot = np.argsort(order)
    rows = (slot[:, None] * G + np.arange(G)).reshape(-1)  # the caches'-order query rows of each model head
    kept = cache_slots < C
    # the reference writes first: the caches' order, the new token in the retrieval cache at its slot
    cache_k, cache_v = np.array(k), np.array(v)
    for b in np.flatnonzero(kept):
        cache_k[b, cache_slots[b]] = np.asarray(k_all)[b, list(order[:n])]
        cache_v[b, cache_slots[b]] = np.asarray(v_all)[b, list(order[:n])]
    expected = _reference(
        q,
        cache_k,
        cache_v,
        old + kept,
        ring_k,
        ring_v,
        ring_lengths,
        k_all[:, list(order[n:])],
        v_all[:, list(order[n:])],
    )
    retrieval, extra, M = (jnp.array(k), jnp.array(v)), {}, C // P
    if paged:  # sequence b's page j is pool page pages[b, j], in a pool with spare pages
        pages = np.random.default_rng(1).permutation(B * M + 2).astype(np.int32)[: B * M].reshape(B, M)
        retrieval = tuple(
            jnp.zeros((n, B * M + 2, P, D), jnp.float32)
            .at[:, pages.reshape(-1)]
            .set(x.reshape(B * M, P, n, D).transpose(2, 0, 1, 3))
            for x in (k, v)
        )
        extra = dict(block_tables=jnp.asarray(pages))
    out, new_rk, _, new_k, new_v = jax.jit(
        lambda *a: duo_decode_attention(
            *a,
            kv_order=order,
            ring_slots=jnp.asarray(ring_slots),
            cache_slots=jnp.asarray(cache_slots),
            block_k=16,
            num_splits=2,
            interpret=True,
            **extra,
        )
    )(q[:, rows], *retrieval, old, jnp.array(ring_k), jnp.array(ring_v), ring_lengths, k_all, v_all)
    if paged:  # back to each sequence's contiguous view
        new_k, new_v = (np.asarray(x)[:, pages].transpose(1, 2, 3, 0, 4).reshape(B, C, n, D) for x in (new_k, new_v))
    assert rel_err(out[:2], expected[:2, rows]) <= 1e-5  # sequence 2 (a padding row): its output is never read
    np.testing.assert_array_equal(np.asarray(new_k), np.where(kept[:, None, None, None], cache_k, np.asarray(k)))
    np.testing.assert_array_equal(np.asarray(new_v), np.where(kept[:, None, None, None], cache_v, np.asarray(v)))
    ring_want = np.array(ring_k)
    for b in range(B):
        if ring_slots[b] < S:
            ring_want[b, ring_slots[b]] = np.asarray(k_all)[b, list(order[n:])]
    np.testing.assert_array_equal(np.asarray(new_rk), ring_want)

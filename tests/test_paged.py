"""The paged retrieval partition: pages written and read through random block tables give the contiguous
cache's attention (float64 reference) and the contiguous DuoAttention cache's logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax import attention
from duo_jax.attention import MaskSpec
from duo_jax.cache import make_layout
from duo_jax.engine import Engine
from duo_jax.errors import DuoJaxError
from duo_jax.methods import make_method
from duo_jax.methods.duo import DuoAttention
from duo_jax.methods.paged import gather_pages, paged, write_pages
from tests.conftest import tiny_config

CONFIG = tiny_config(num_layers=3)
# Layer 0: head 0 retrieval; layer 1: head 1 (reordered); layer 2: none (an empty pool).
MASK = np.array([[True, False], [False, True], [False, False]])


def reference_attention(q, k, v, q_pos, kv_len):
    """float64 numpy: q [B, T, H, E] over k / v [B, S, K, E], causal by position, keys < kv_len."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, E = q.shape
    G = H // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            s = q[b, :, h] @ k[b, :, h // G].T / np.sqrt(E)  # [T, S]
            keys = np.arange(k.shape[1])
            s = np.where((keys[None] <= q_pos[b][:, None]) & (keys[None] < kv_len[b]), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h // G]
    return out


def random_tables(rng, lengths, page_size, max_pages, num_pages):
    """Each sequence gets just the pages its length needs, drawn at random from the pool; the rest: none (N)."""
    tables = np.full((len(lengths), max_pages), num_pages, np.int32)
    free = list(rng.permutation(num_pages))
    for b, n in enumerate(lengths):
        for i in range(-(-n // page_size)):
            tables[b, i] = free.pop()
    return tables


@pytest.mark.slow
def test_paged_attention_matches_float64_with_random_tables():
    """Chunks of 7 and 13 tokens written at ragged offsets cross pages of 4; reading the pages back through
    the tables gives float64 attention over each sequence's own tokens, and no other sequence's page changes."""
    rng = np.random.default_rng(0)
    B, P, M, N, K, H, E = 3, 4, 8, 40, 2, 4, 16
    offsets, chunk = np.array([0, 5, 14]), 13
    new_lengths = offsets + np.array([7, 13, 9])  # ragged: a padded chunk of 13
    tables = random_tables(rng, new_lengths, P, M, N)
    keys = rng.standard_normal((B, M * P, K, E)).astype(np.float32)  # each sequence's tokens, by position
    values = rng.standard_normal((B, M * P, K, E)).astype(np.float32)
    pool_k = rng.standard_normal((K, N, P, E)).astype(np.float32)  # stale content everywhere
    pool_v = rng.standard_normal((K, N, P, E)).astype(np.float32)
    for b in range(B):  # the tokens before the chunk, already cached
        for p in range(offsets[b]):
            pool_k[:, tables[b, p // P], p % P], pool_v[:, tables[b, p // P], p % P] = keys[b, p], values[b, p]
    positions = offsets[:, None] + np.arange(chunk)
    valid = positions < new_lengths[:, None]
    chunk_k = np.take_along_axis(keys, np.minimum(positions, M * P - 1)[:, :, None, None], axis=1)
    chunk_v = np.take_along_axis(values, np.minimum(positions, M * P - 1)[:, :, None, None], axis=1)
    pk = write_pages(
        jnp.asarray(pool_k), jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(valid), jnp.asarray(chunk_k)
    )
    pv = write_pages(
        jnp.asarray(pool_v), jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(valid), jnp.asarray(chunk_v)
    )
    unused = np.setdiff1d(np.arange(N), tables)
    np.testing.assert_array_equal(np.asarray(pk)[:, unused], pool_k[:, unused])  # nothing written outside the tables
    q = rng.standard_normal((B, chunk, H, E)).astype(np.float32)
    spec = MaskSpec(jnp.asarray(positions, jnp.int32), jnp.asarray(new_lengths, jnp.int32))
    out = attention.attend(
        jnp.asarray(q), gather_pages(pk, jnp.asarray(tables)), gather_pages(pv, jnp.asarray(tables)), spec, impl="xla"
    )
    ref = reference_attention(q, keys, values, positions, new_lengths)
    np.testing.assert_allclose(np.asarray(out)[valid], ref[valid], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def engine():
    return Engine(duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2), CONFIG)


def all_logits(engine, method, prompts, cache, *, chunk, steps, impl="xla"):
    """Chunked prefill (every chunk's logits), then greedy decode steps: logits [B][position] per sequence."""
    B = len(prompts)
    lengths = np.array([len(p) for p in prompts])
    padded = np.zeros((B, lengths.max()), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    seen = [[] for _ in range(B)]

    def keep(out, start, n_valid):
        for b in range(B):
            seen[b].extend(np.asarray(out[b, : n_valid[b]]))

    last, cache, lens = engine.prefill(
        method, padded, lengths, chunk=chunk, impl=impl, on_chunk=keep, cache=cache, lengths=jnp.zeros((B,), jnp.int32)
    )
    token = jnp.argmax(last, -1).astype(jnp.int32)
    for _ in range(steps):
        out, cache, lens = engine.step(method, cache, lens, token, impl=impl)
        for b in range(B):
            seen[b].append(np.asarray(out[b]))
        token = jnp.argmax(out, -1).astype(jnp.int32)
    return [np.stack(s) for s in seen]


@pytest.mark.slow
@pytest.mark.parametrize("mask", [MASK, None], ids=["duo", "full"])
def test_paged_duo_gives_the_contiguous_caches_logits(engine, mask):
    """Ragged prompts prefilled in chunks of 6 over pages of 4 (chunks cross page boundaries), then decode,
    with pages drawn at random from a pool larger than needed: every position's logits within 1e-5 of the
    contiguous cache's."""
    rng = np.random.default_rng(1)
    contiguous = DuoAttention(make_layout(CONFIG, mask, sink=2, recent=5, context=64))
    method = paged(contiguous, page_size=4, num_pages=50)
    prompts = [rng.integers(1, 128, n).tolist() for n in (17, 9, 23)]
    steps = 4
    ref = all_logits(engine, contiguous, prompts, None, chunk=6, steps=steps)
    totals = [len(p) + steps for p in prompts]
    cache = method.empty_cache(3, engine.dtype)
    cache.block_tables = jnp.asarray(random_tables(rng, totals, 4, method.pages_per_sequence, 50))
    got = all_logits(engine, method, prompts, cache, chunk=6, steps=steps)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * np.abs(r).max())


def xla_and_pallas_logits(engine, *, sink, recent, prompt_lengths, seed, steps=3) -> dict:
    """Paged duo (pages of 4 in a pool of 40, random block tables) on "xla" and on "pallas": every position's
    logits of random prompts and `steps` greedy tokens, by impl."""
    rng = np.random.default_rng(seed)
    method = paged(
        DuoAttention(make_layout(CONFIG, MASK, sink=sink, recent=recent, context=64)), page_size=4, num_pages=40
    )
    prompts = [rng.integers(1, 128, n).tolist() for n in prompt_lengths]
    tables = random_tables(rng, [len(p) + steps for p in prompts], 4, method.pages_per_sequence, 40)
    logits = {}
    for impl in ("xla", "pallas"):
        cache = method.empty_cache(len(prompts), engine.dtype)
        cache.block_tables = jnp.asarray(tables)
        logits[impl] = all_logits(engine, method, prompts, cache, chunk=8, steps=steps, impl=impl)
    return logits


@pytest.mark.slow
def test_paged_decode_through_the_kernel_gives_the_xla_paths_tokens(engine, monkeypatch):
    """The paged method with impl="pallas" (prefill chunks and decode steps read the pages in the paged Pallas
    kernels, in the interpreter here) gives the XLA path's logits and greedy tokens over random block tables;
    each kernel is traced once per layer with retrieval heads (the steps are jitted)."""
    import pallas_kernels

    calls = []
    for name in ("paged_decode_attention", "paged_flash_attention"):
        kernel = getattr(pallas_kernels, name)
        monkeypatch.setattr(pallas_kernels, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    logits = xla_and_pallas_logits(engine, sink=2, recent=5, prompt_lengths=(11, 4), seed=2)
    assert sorted(calls) == ["paged_decode_attention"] * 2 + ["paged_flash_attention"] * 2  # layers 0 and 1
    for x, p in zip(logits["xla"], logits["pallas"]):
        np.testing.assert_allclose(p, x, rtol=0, atol=1e-5 * np.abs(x).max())
        np.testing.assert_array_equal(p.argmax(-1), x.argmax(-1))


@pytest.mark.slow
def test_paged_duo_decode_in_one_kernel_gives_the_xla_paths_logits(engine, monkeypatch):
    """A ring tiled by a power-of-two block (4 + 12 slots): decode steps of the layers with both kinds of heads
    run `duo_decode_attention` over the pages and the ring (interpreted), with the XLA path's logits."""
    import pallas_kernels

    calls = []
    kernel = pallas_kernels.duo_decode_attention
    monkeypatch.setattr(
        pallas_kernels,
        "duo_decode_attention",
        lambda *a, **kw: calls.append(kw.get("block_tables") is not None) or kernel(*a, **kw),
    )
    logits = xla_and_pallas_logits(engine, sink=4, recent=12, prompt_lengths=(21, 6), seed=3)
    mixed = sum(0 < n < CONFIG.num_kv_heads for n in MASK.sum(axis=1))
    assert calls == [True] * mixed  # one trace of the jitted decode step, a launch per mixed layer
    for x, p in zip(logits["xla"], logits["pallas"]):
        np.testing.assert_allclose(p, x, rtol=0, atol=1e-5 * np.abs(x).max())


@pytest.mark.slow
def test_generate_runs_a_paged_method():
    """`init_cache` gives each sequence its own pages: generate with the paged method gives duo's tokens, and
    the cache's bytes are its formula's."""
    config = tiny_config()
    model = duo_jax.Model(config, duo_jax.init_params(config, jax.random.key(3), scale=0.2), None, "random")
    prompts = [list(range(1, 20)), list(range(5, 12))]
    duo = make_method("full", config, context=64)
    ref = duo_jax.generate(model, prompts, method=duo, max_new_tokens=3, chunk_size=8, stop_at_eos=False)
    method = paged(duo, page_size=16)
    out = duo_jax.generate(model, prompts, method=method, max_new_tokens=3, chunk_size=8, stop_at_eos=False)
    assert out.tokens == ref.tokens
    assert out.stats["cache_bytes"] == method.expected_cache_bytes(2, 4) == out.stats["expected_cache_bytes"]
    # a pool of pages for five prompts: not padded to a batch bucket of 6 (whose pages it would lack)
    five = [list(range(1 + i, 9 + 2 * i)) for i in range(5)]
    pool = paged(duo, page_size=16, num_pages=5 * method.pages_per_sequence)
    out = duo_jax.generate(model, five, method=pool, max_new_tokens=3, chunk_size=8, stop_at_eos=False)
    assert out.stats["batch_rows"] == 5
    assert (
        out.tokens
        == duo_jax.generate(model, five, method=duo, max_new_tokens=3, chunk_size=8, stop_at_eos=False).tokens
    )


def test_paged_refuses_what_it_cannot_hold():
    duo = make_method("full", CONFIG, context=64)
    with pytest.raises(DuoJaxError, match="contiguous cache"):
        paged(make_method("h2o", CONFIG, context=64, kv_budget=8))
    with pytest.raises(DuoJaxError, match="page_size"):
        paged(duo, page_size=0)
    for bad in (dict(page_size=4.5), dict(page_size=True), dict(num_pages=2.5)):  # failed later, or were taken
        with pytest.raises(DuoJaxError, match="must be an integer >= 1"):
            paged(duo, **bad)
    with pytest.raises(DuoJaxError, match="cannot give"):
        paged(duo, page_size=16, num_pages=5).init_cache(2, jnp.float32)
    with pytest.raises(DuoJaxError, match="takes no streaming_chunk"):  # its chunks are the scheduler's
        paged(dataclasses.replace(duo, streaming_chunk=64))


def test_only_paged_methods_run_one_row_of_a_batch():
    """`Method.take_row` / `put_row` default to an error: only the paged methods serve one row of a batched cache
    (the server's continuous batching)."""
    from duo_jax.engine import compiled_extend_row

    for method in (make_method("full", CONFIG, context=64), make_method("h2o", CONFIG, context=64, kv_budget=8)):
        with pytest.raises(DuoJaxError, match=f"'{method.name}' cannot run one row of a batched cache"):
            compiled_extend_row(CONFIG, method, 2, 4, "float32")
        with pytest.raises(DuoJaxError, match="cannot run one row"):
            method.put_row(None, 0, None)


@pytest.mark.slow
def test_paged_duo_through_cudnn_without_triton_gives_the_xla_paths_logits(monkeypatch):
    """A GPU without Triton, bf16 ("auto" resolves to "cudnn", the rest to XLA): prefill chunks and decode steps of
    the paged retrieval heads run cuDNN's paged call (the XLA stand-in of its contract, counted), with the XLA
    path's logits and greedy tokens."""
    from duo_jax.attention import cudnn, dispatch

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[2])  # queries per call: a chunk's or 1
        return cudnn.xla_paged_part(*args, **kwargs)

    engine = Engine(duo_jax.init_params(CONFIG, jax.random.key(0), jnp.bfloat16, scale=0.2), CONFIG)
    rng = np.random.default_rng(4)
    method = paged(DuoAttention(make_layout(CONFIG, MASK, sink=2, recent=5, context=64)), page_size=4, num_pages=40)
    prompts = [rng.integers(1, 128, n).tolist() for n in (13, 6)]
    tables = random_tables(rng, [len(p) + 3 for p in prompts], 4, method.pages_per_sequence, 40)
    logits = {}
    for impl in ("xla", "cudnn"):
        if impl == "cudnn":
            monkeypatch.setattr(dispatch, "resolve_impl", lambda impl: "cudnn" if impl in ("auto", "cudnn") else impl)
            monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")
            monkeypatch.setattr(cudnn, "paged_unavailable", lambda *shape: None)
            monkeypatch.setattr(cudnn, "_cudnn", cudnn.xla_part)
            monkeypatch.setattr(cudnn, "_cudnn_paged", counted)
        cache = method.empty_cache(len(prompts), engine.dtype)
        cache.block_tables = jnp.asarray(tables)  # the cache is donated
        logits[impl] = all_logits(engine, method, prompts, cache, chunk=8, steps=3, impl=impl)
    assert sorted(set(calls)) == [1, 8]  # traced for the prefill chunk and the decode step
    for x, c in zip(logits["xla"], logits["cudnn"]):  # bf16 rounding on two paths, three layers deep
        assert np.abs(c - x).max() < 5e-2 * np.abs(x).max() and np.abs(c - x).mean() < 5e-3 * np.abs(x).max()
        np.testing.assert_array_equal(c.argmax(-1), x.argmax(-1))

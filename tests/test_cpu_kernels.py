"""pallas_kernels.cpu (the C++ flash-attention kernel through XLA's FFI) against float64 numpy, and how the
dispatch picks it, differentiates it and falls back to the XLA path where it cannot be built."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.cpu as cpu
from duo_jax import attention
from duo_jax.attention import dispatch, prefix_spec
from duo_jax.errors import BackendError
from tests.conftest import random_attention_inputs
from tests.test_attention_xla import attention_np, mask_np

# Without a C++ compiler the kernel cannot be built (the dispatch then takes the XLA path: the last test); with one,
# a failed build is a failure here.
needs_compiler = pytest.mark.skipif(cpu._compiler() is None, reason="no C++ compiler: the kernel cannot be built")

# (B, T, H, Kh, E, S, q_offset, kv_len, block_q, block_k)
CASES = [
    (2, 37, 9, 3, 64, 300, [0, 150], [37, 187], 16, 64),  # GQA 3:1, ragged offsets
    (2, 37, 9, 3, 64, 300, [5, 150], [20, 100], 16, 64),  # kv_len cuts into the chunk / lies before it
    (2, 50, 4, 2, 32, 200, [-3, 10], [50, 0], 16, 48),  # rows with no visible key; an empty sequence
    (1, 100, 6, 6, 64, 400, [250], [350], 32, 128),  # MHA: 6 row vectors
    (2, 33, 8, 1, 16, 90, [0, 40], [33, 73], 8, 24),  # MQA, blocks not dividing anything
    (1, 200, 9, 3, 64, 2176, [1000], [1200], 64, 64),  # a SmolLM2 chunk, T not a multiple of the block
    (3, 1, 8, 2, 64, 512, [99, 0, 400], [100, 1, 401], 64, 64),  # decode steps
]


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}K{c[3]}E{c[4]}S{c[5]}")
@pytest.mark.parametrize("threads", [0, 1], ids=["pool", "one-thread"])
def test_kernel_matches_float64(case, threads):
    """Random inputs with NaN in the last slot (never filled here): a slot past kv_len must never be read."""
    B, T, H, Kh, E, S, offsets, lengths, block_q, block_k = case
    q, k, v, _ = random_attention_inputs(B, T, S, H, Kh, E, seed=len(CASES) * threads + T)
    k, v = k.at[:, -1].set(jnp.nan), v.at[:, -1].set(jnp.nan)
    offsets, lengths = jnp.asarray(offsets, jnp.int32), jnp.asarray(lengths, jnp.int32)
    out = jax.jit(
        lambda q, k, v, o, n: cpu.flash_attention(q, k, v, o, n, block_q=block_q, block_k=block_k, num_threads=threads)
    )(q, k, v, offsets, lengths)
    spec = prefix_spec(B, T, q_offset=offsets, kv_len=lengths, num_keys=S)
    mask = mask_np(spec, S)
    ref = attention_np(q, jnp.where(jnp.isnan(k), 0, k), jnp.where(jnp.isnan(v), 0, v), mask)
    assert np.all(np.isfinite(np.asarray(out)))
    assert np.max(np.abs(np.asarray(out) - ref)) <= 2e-5 * max(1.0, np.max(np.abs(ref)))
    assert not np.any(np.asarray(out)[~mask.any(-1)]), "a query that sees no key gives zeros"


@needs_compiler
@pytest.mark.parametrize("threads", [0, 1], ids=["pool", "one-thread"])
@pytest.mark.parametrize("block_k", [64, 24], ids=lambda b: f"block_k{b}")
def test_keys_at_explicit_positions_match_float64(threads, block_k):
    """A streaming head's keys: a ring of cached positions in shuffled slots (some empty: -1) followed by the
    chunk, per-sequence offsets, a key length short of the slots for one sequence; NaN in a slot past it."""
    B, T, H, Kh, E, ring = 2, 40, 6, 2, 32, 100
    rng = np.random.default_rng(11)
    offsets = np.array([300, 150], np.int32)
    positions = np.full((B, ring + T), -1, np.int32)
    for b in range(B):
        cached = np.concatenate([np.arange(16), np.arange(offsets[b] - 70, offsets[b])])  # sinks + recent tokens
        slots = rng.permutation(ring)[: len(cached)]
        positions[b, slots] = cached
        positions[b, ring:] = offsets[b] + np.arange(T)
    kv_len = np.array([ring + T, ring + T - 5], np.int32)  # the second sequence's last 5 chunk tokens are not real
    q, k, v, _ = random_attention_inputs(B, T, ring + T, H, Kh, E, seed=12)
    k, v = k.at[1, -1].set(jnp.nan), v.at[1, -1].set(jnp.nan)
    out = jax.jit(
        lambda q, k, v: cpu.flash_attention(
            q, k, v, offsets, kv_len, k_positions=positions, block_k=block_k, num_threads=threads
        )
    )(q, k, v)
    spec = attention.MaskSpec(
        jnp.asarray(offsets[:, None] + np.arange(T), jnp.int32), jnp.asarray(kv_len), jnp.asarray(positions)
    )
    ref = attention_np(q, jnp.nan_to_num(k), jnp.nan_to_num(v), mask_np(spec, ring + T))
    assert np.all(np.isfinite(np.asarray(out)))
    assert np.max(np.abs(np.asarray(out) - ref)) <= 2e-5 * np.max(np.abs(ref))


@needs_compiler
@pytest.mark.parametrize("threads", [0, 1], ids=["pool", "one-thread"])
@pytest.mark.parametrize("block_q, block_k", [(64, 64), (8, 24)], ids=["blocks64", "blocks8x24"])
def test_received_attention_matches_float64(threads, block_q, block_k):
    """H2O's chunk over its kept tokens (any order, some slots empty) and its own tokens, the last 3 of them
    padding (empty, weight 0): the output and each key's attention summed over the weighted queries and the
    group's heads, against float64 probabilities; one sequence keeps nothing."""
    B, T, H, Kh, E, kept = 2, 37, 6, 2, 64, 20
    rng = np.random.default_rng(5)
    offsets = np.array([60, 45], np.int32)
    positions = np.full((B, kept + T), -1, np.int32)
    positions[0, :15] = rng.choice(offsets[0], 15, replace=False)  # the second sequence keeps nothing
    positions[:, kept:] = offsets[:, None] + np.arange(T)
    positions[:, -3:] = -1
    weights = rng.uniform(0.5, 1.5, (B, T)).astype(np.float32)
    weights[:, -3:] = 0
    q, k, v, _ = random_attention_inputs(B, T, kept + T, H, Kh, E, seed=6)
    out, received = jax.jit(
        lambda q, k, v: cpu.flash_attention_received(
            q, k, v, offsets, kept + T, positions, weights, block_q=block_q, block_k=block_k, num_threads=threads
        )
    )(q, k, v)
    spec = attention.MaskSpec(
        jnp.asarray(offsets[:, None] + np.arange(T), jnp.int32),
        jnp.full((B,), kept + T, jnp.int32),
        jnp.asarray(positions),
    )
    mask = mask_np(spec, kept + T)  # [B, T, S]
    G = H // Kh
    scores = np.einsum("bthe,bshe->bhts", np.float64(q), np.repeat(np.float64(k), G, axis=2)) / np.sqrt(E)
    scores = np.where(mask[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ref_received = np.einsum("bhts,bt->bhs", probs, weights).reshape(B, Kh, G, kept + T).sum(2)
    ref_out = attention_np(q, k, v, mask)
    assert received.shape == (B, Kh, kept + T)
    assert np.max(np.abs(np.asarray(received) - ref_received)) <= 2e-5 * np.max(ref_received)
    assert np.max(np.abs(np.asarray(out)[:, :-3] - ref_out[:, :-3])) <= 2e-5 * np.max(np.abs(ref_out))
    assert not np.any(np.asarray(received).transpose(0, 2, 1)[positions < 0]), "an empty slot receives nothing"


@needs_compiler
def test_attend_received_takes_the_kernel_where_it_serves():
    """auto on CPU: the C++ kernel's sums; the XLA path, bf16 and sliding windows: None (the caller materialises
    the probabilities, `attention_received`)."""
    q, k, v, _ = random_attention_inputs(1, 8, 12, 4, 2, 16, seed=7)
    positions = jnp.asarray(np.r_[np.arange(4), np.arange(4, 12)][None], jnp.int32)
    spec = attention.MaskSpec(jnp.arange(4, 12, dtype=jnp.int32)[None], jnp.array([12]), positions, own_keys_at=4)
    weights = jnp.ones((1, 8), jnp.float32)
    out, received = attention.attend_received(q, k, v, spec, weights, impl="auto")
    np.testing.assert_allclose(out, attention.attend(q, k, v, spec, impl="xla"), atol=2e-5)
    assert received.shape == (1, 2, 12)
    np.testing.assert_allclose(received.sum(-1), [[8 * 2, 8 * 2]], rtol=1e-5)  # each query's probabilities sum to 1
    windowed = attention.MaskSpec(spec.q_positions, spec.kv_len, positions, window=3)
    assert attention.attend_received(q, k, v, spec, weights, impl="xla") is None
    assert attention.attend_received(q, k, v, windowed, weights, impl="auto") is None
    bf16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    assert attention.attend_received(*bf16, spec, weights, impl="auto") is None


@needs_compiler
def test_kernel_takes_the_scale():
    q, k, v, _ = random_attention_inputs(1, 16, 40, 4, 2, 32, seed=3)
    spec = prefix_spec(1, 16, q_offset=10, kv_len=26, num_keys=40)
    out = cpu.flash_attention(q, k, v, 10, 26, scale=0.3)
    ref = attention_np(q * (0.3 * np.sqrt(32)), k, v, mask_np(spec, 40))  # attention_np scales by 1/sqrt(E)
    assert np.max(np.abs(np.asarray(out) - ref)) <= 2e-5 * np.max(np.abs(ref))


@needs_compiler
def test_kernel_rejects_what_it_does_not_compute():
    q, k, v, _ = random_attention_inputs(1, 4, 8, 4, 2, 16)
    with pytest.raises(TypeError, match="float32"):
        cpu.flash_attention(q.astype(jnp.bfloat16), k, v, 0, 4)
    with pytest.raises(ValueError, match="H % Kh"):
        cpu.flash_attention(q[..., :3, :], k, v, 0, 4)
    with pytest.raises(ValueError, match="k_positions"):
        cpu.flash_attention(q, k, v, 0, 4, k_positions=jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="weights"):
        cpu.flash_attention_received(q, k, v, 0, 8, jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 3)))


def _uses_kernel(fn, *args) -> bool:
    """Whether fn's lowering calls either entry point of the kernel (slots as positions, or explicit ones)."""
    text = str(jax.jit(fn).lower(*args).as_text())
    return cpu.TARGET in text or cpu.TARGET_AT in text


@needs_compiler
@pytest.mark.slow
def test_auto_on_cpu_runs_the_kernel_where_it_serves():
    """f32 causal attention over consecutive slots or keys at explicit positions takes the kernel; bf16, windows
    and Λ take the XLA path."""
    q, k, v, _ = random_attention_inputs(1, 24, 64, 4, 2, 16)
    spec = prefix_spec(1, 24, q_offset=8, kv_len=32, num_keys=64)
    assert _uses_kernel(lambda q: attention.attend(q, k, v, spec), q)
    assert not _uses_kernel(lambda q: attention.attend(q, k, v, spec, impl="xla"), q)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    assert not _uses_kernel(lambda q: attention.attend(q, *bf16[1:], spec), bf16[0])
    for rule in (dict(window=5), dict(sink=2, recent=4)):
        other = prefix_spec(1, 24, q_offset=8, kv_len=32, num_keys=64, **rule)
        assert not _uses_kernel(lambda q: attention.attend(q, k, v, other), q)
    ring = attention.MaskSpec(spec.q_positions, spec.kv_len, jnp.broadcast_to(jnp.arange(64), (1, 64)))
    assert _uses_kernel(lambda q: attention.attend(q, k, v, ring), q)


@pytest.mark.slow
@needs_compiler
def test_gradients_through_the_kernel_are_the_xla_paths():
    q, k, v, cotangent = random_attention_inputs(2, 20, 50, 6, 2, 16, seed=5)
    spec = prefix_spec(2, 20, q_offset=jnp.array([10, 30]), kv_len=jnp.array([30, 50]), num_keys=50)

    def grads(impl):
        return jax.vjp(lambda q, k, v: attention.attend(q, k, v, spec, impl=impl), q, k, v)[1](cotangent)

    for ours, xla_path in zip(grads("cpu"), grads("xla")):
        assert np.max(np.abs(np.asarray(ours) - np.asarray(xla_path))) <= 1e-5 * np.max(np.abs(np.asarray(xla_path)))


@pytest.fixture
def no_kernel(monkeypatch, tmp_path):
    """A machine whose compiler cannot build the kernel ($CXX exits 1), with an empty kernel cache."""
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\necho 'broken-c++: cannot compile' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("DUO_JAX_CACHE", str(tmp_path))
    cpu._load.cache_clear()
    dispatch._cpu_fallback.cache_clear()
    yield
    cpu._load.cache_clear()
    dispatch._cpu_fallback.cache_clear()


@pytest.mark.slow
def test_a_failed_build_falls_back_to_xla_with_one_warning(no_kernel):
    assert not cpu.available() and "building it failed" in cpu.unavailable()
    assert "cannot compile" in cpu.unavailable()  # the compiler's own words are passed on
    q, k, v, _ = random_attention_inputs(1, 8, 16, 4, 2, 16)
    spec = prefix_spec(1, 8, q_offset=4, kv_len=12, num_keys=16)
    with pytest.warns(RuntimeWarning, match="XLA path"):
        out = attention.attend(q, k, v, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        attention.attend(q, k, v, spec)
    ref = attention_np(q, k, v, mask_np(spec, 16))
    assert np.max(np.abs(np.asarray(out) - ref)) <= 1e-5 * np.max(np.abs(ref))
    with pytest.raises(BackendError, match="C\\+\\+ compiler"):
        attention.attend(q, k, v, spec, impl="cpu")
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu.flash_attention(q, k, v, 4, 12)

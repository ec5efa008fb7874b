"""The cuDNN path's decomposition of a prefill chunk (prefix + its own keys, merged by log-sum-exp) against the
XLA path on the whole mask, with the XLA path standing in for cuDNN's calls (this host has no GPU; the calls
themselves are checked on a GPU by tests/test_gpu.py), and what it serves."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from duo_jax.attention import cudnn, dispatch, xla
from duo_jax.attention.dispatch import attend, resolve_impl
from duo_jax.attention.masks import MaskSpec, prefix_spec
from duo_jax.attention.pages import PagedKV
from duo_jax.errors import BackendError
from duo_jax.quant import quantize_kv
from tests.conftest import rel_err


def _inputs(B, T, C, H, K, E, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(2.0 * rng.standard_normal((B, T, H, E)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, C, K, E)), jnp.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    "offsets, n_valid",
    [((0, 37), (24, 24)), ((100, 5), (24, 11)), ((0, 0), (24, 9))],
    ids=["first_chunk_and_offset", "both_offset_ragged", "first_chunks"],
)
def test_chunk_matches_the_whole_mask(offsets, n_valid):
    """Each sequence's chunk at its offset sees the prefix whole and itself causally; padding rows are not read."""
    B, T, C, H, K, E = 2, 24, 128, 4, 2, 16
    q, k, v = _inputs(B, T, C, H, K, E)
    spec = prefix_spec(
        B, T, q_offset=jnp.asarray(offsets), kv_len=jnp.asarray(offsets) + jnp.asarray(n_valid), num_keys=C
    )
    got = cudnn.attention(q, k, v, spec, attend=cudnn.xla_part)
    want = xla.attention(q, k, v, spec)
    valid = np.arange(T)[None, :] < np.asarray(n_valid)[:, None]
    assert rel_err(np.asarray(got)[valid], np.asarray(want)[valid]) < 1e-5


def test_decode_step_sees_its_cache_up_to_its_position():
    B, C, H, K, E = 3, 64, 4, 2, 16
    q, k, v = _inputs(B, 1, C, H, K, E, seed=3)
    lengths = jnp.asarray([64, 1, 30])
    spec = prefix_spec(B, 1, q_offset=lengths - 1, kv_len=lengths, num_keys=C)
    got = cudnn.attention(q, k, v, spec, attend=cudnn.xla_part)
    assert rel_err(got, xla.attention(q, k, v, spec)) < 1e-5


@pytest.mark.parametrize("T", [16, 1], ids=["chunk", "decode"])
def test_ring_then_own_keys_match_the_whole_mask(T):
    """The streaming heads' keys: a ring (filled slots first, every one before the queries; one sequence's empty,
    one's full with wrapped positions) followed by the queries' own keys (padding past n_valid: -1)."""
    B, R, H, K, E = 2, 12, 4, 2, 16
    q, k, v = _inputs(B, T, R + T, H, K, E, seed=4)
    offsets, n_valid = np.array([0, 40]), np.array([T, max(T - 7, 1)])
    positions = np.full((B, R + T), -1, np.int32)
    positions[1, :R] = np.r_[0:4, 32:40]  # sinks 0..3, then the ring's recent tokens (in slot order)
    for b in range(B):
        positions[b, R : R + n_valid[b]] = offsets[b] + np.arange(n_valid[b])
    spec = MaskSpec(
        jnp.asarray(offsets[:, None] + np.arange(T), jnp.int32),
        jnp.full((B,), R + T, jnp.int32),
        jnp.asarray(positions),
        own_keys_at=R,
    )
    assert cudnn.serves(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), spec)
    got = cudnn.attention(q, k, v, spec, attend=cudnn.xla_part)
    want = xla.attention(q, k, v, spec)
    valid = np.arange(T)[None, :] < n_valid[:, None]
    assert rel_err(np.asarray(got)[valid], np.asarray(want)[valid]) < 1e-5


def test_decode_over_a_ring_is_one_call_with_its_own_key_after_the_filled_slots():
    """A decode step over a ring (empty, partly filled, full) and its own key: one cuDNN call over the filled slots
    with the own key moved up after them, so no slot it must not see (an empty one) and none it must see (the own
    key, past the empty ones) falls outside the call's key lengths."""
    B, R, H, K, E = 3, 12, 4, 2, 16
    q, k, v = _inputs(B, 1, R + 1, H, K, E, seed=8)
    filled = np.array([0, 5, R])
    positions = np.full((B, R + 1), -1, np.int32)
    positions[1, :5] = np.arange(5)
    positions[2, :R] = np.r_[0:4, 32:40]  # sinks, then the recent tokens in slot order (wrapped)
    offsets = np.array([0, 5, 40])
    positions[:, R] = offsets
    q_positions, kv_len = jnp.asarray(offsets[:, None], jnp.int32), jnp.full((B,), R + 1, jnp.int32)
    spec = MaskSpec(q_positions, kv_len, jnp.asarray(positions), own_keys_at=R)
    (part,) = cudnn.calls(q, k, v, spec)
    np.testing.assert_array_equal(part.lengths, filled + 1)
    for b, n in enumerate(filled):  # the filled slots as they were, then the own key
        np.testing.assert_array_equal(part.k[b, :n], k[b, :n])
        np.testing.assert_array_equal(part.k[b, n], k[b, R])
        np.testing.assert_array_equal(part.v[b, n], v[b, R])
    got = cudnn.attention(q, k, v, spec, attend=cudnn.xla_part)
    assert rel_err(got, xla.attention(q, k, v, spec)) < 1e-5
    # the own key counts: without it the step is far off
    ring_only = MaskSpec(spec.q_positions, spec.kv_len, jnp.asarray(np.where(np.arange(R + 1) < R, positions, -1)))
    assert rel_err(xla.attention(q, k, v, ring_only)[1:], got[1:]) > 1e-2


def test_chunk_past_the_cache_end():
    """A last chunk whose padding rows run past the cache: the real rows' keys are gathered right."""
    B, T, C, H, K, E = 1, 32, 64, 2, 1, 8
    q, k, v = _inputs(B, T, C, H, K, E, seed=1)
    spec = prefix_spec(B, T, q_offset=jnp.asarray([50]), kv_len=jnp.asarray([64]), num_keys=C)
    got = cudnn.attention(q, k, v, spec, attend=cudnn.xla_part)
    want = xla.attention(q, k, v, spec)
    assert rel_err(got[:, :14], want[:, :14]) < 1e-5
    # the merge is not a no-op: the prefix alone, or the chunk alone, is far off
    alone = cudnn.xla_part(q, k, v, jnp.asarray([50]), False, scale=1 / np.sqrt(E))[0]
    assert rel_err(alone[:, :14], want[:, :14]) > 1e-2


def test_serves_dense_16_bit_chunks_only():
    B, T, C = 1, 16, 64
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(B, T, C, 4, 2, 64))
    spec = prefix_spec(B, T, q_offset=jnp.asarray([3]), num_keys=C)
    assert cudnn.serves(q, k, v, spec)
    assert not cudnn.serves(q.astype(jnp.float32), k, v, spec)  # fp32
    assert cudnn.serves(q[:, :1], k, v, prefix_spec(B, 1, q_offset=jnp.asarray([3]), num_keys=C))  # decode
    assert cudnn.serves(q, k, v, prefix_spec(B, T, q_offset=jnp.asarray([5]), num_keys=C, sink=4, recent=8))  # Λ, shard
    whole = prefix_spec(B, C, num_keys=C, sink=4, recent=8)  # Λ over a whole sequence (gate training)
    assert cudnn.serves(*(jnp.zeros((B, C, n, 64), jnp.bfloat16) for n in (4, 2, 2)), whole)
    windowed = prefix_spec(B, T, q_offset=jnp.asarray([3]), num_keys=C, window=8)
    assert cudnn.serves(q, k, v, windowed)  # a sliding window (Mistral, Qwen)
    assert not cudnn.serves(q, k, v, dataclasses.replace(windowed, sink=4, recent=8))  # ... with Λ (gate training)
    positions = MaskSpec(spec.q_positions, spec.kv_len, jnp.zeros((B, C), jnp.int32))
    assert not cudnn.serves(q, k, v, positions)  # keys at explicit positions
    assert not cudnn.serves(q, k, v, dataclasses.replace(positions, sink=4, recent=8))  # ... under Λ
    wide = jnp.zeros((B, T, 4, 256), jnp.bfloat16)
    assert not cudnn.serves(wide, wide[:, :, :2], wide[:, :, :2], prefix_spec(B, T, num_keys=T))


def test_refused_off_a_gpu_with_the_reason():
    assert "NVIDIA GPU" in cudnn.unavailable()
    with pytest.raises(BackendError, match="impl='cudnn' cannot run here.*GPU"):
        resolve_impl("cudnn")
    q, k, v = _inputs(1, 4, 8, 2, 1, 8)
    with pytest.raises(BackendError, match="impl='auto'"):
        attend(q, k, v, prefix_spec(1, 4, num_keys=8), impl="cudnn")


def test_probe_reference_is_the_contract():
    """`xla_part`, the stand-in, returns what `_cudnn` promises: the output and the natural log-sum-exp of the
    scaled scores over keys j < kv_len (and j <= i when causal), [B, T, H]."""
    B, T, S, H, K, E = 1, 5, 7, 2, 1, 4
    q, k, v = _inputs(B, T, S, H, K, E, seed=2)
    out, lse = cudnn.xla_part(q, k, v, jnp.asarray([6]), True, scale=0.5)
    s = np.einsum("bthe,bshe->bhts", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, axis=2)) * 0.5
    mask = (np.arange(S)[None, :] <= np.arange(T)[:, None]) & (np.arange(S)[None, :] < 6)
    s = np.where(mask, s, -np.inf)
    want_lse = np.log(np.exp(s).sum(-1))  # [B, H, T]
    np.testing.assert_allclose(np.asarray(lse), np.transpose(want_lse, (0, 2, 1)), rtol=1e-5)
    p = np.exp(s - want_lse[..., None])
    want = np.einsum("bhts,bshe->bthe", p, np.repeat(np.asarray(v, np.float64), 2, axis=2))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)


def test_traced_under_jit():
    q, k, v = _inputs(1, 8, 32, 2, 1, 8)
    fn = jax.jit(
        lambda q, k, v, off: cudnn.attention(
            q, k, v, prefix_spec(1, 8, q_offset=off, kv_len=off + 8, num_keys=32), attend=cudnn.xla_part
        )
    )
    spec = prefix_spec(1, 8, q_offset=jnp.asarray([10]), kv_len=jnp.asarray([18]), num_keys=32)
    assert rel_err(fn(q, k, v, jnp.asarray([10])), xla.attention(q, k, v, spec)) < 1e-5


def _ring_spec(B, T, R):
    """A ring of R slots (one sequence's empty, one's 12 filled with wrapped positions) followed by T own keys."""
    offsets = np.array([0, 40])
    positions = np.full((B, R + T), -1, np.int32)
    positions[1, :12] = np.r_[0:4, 32:40]  # sinks 0..3, then the ring's recent tokens; the rest of the ring empty
    positions[:, R:] = offsets[:, None] + np.arange(T)
    q_positions = jnp.asarray(offsets[:, None] + np.arange(T), jnp.int32)
    return MaskSpec(q_positions, jnp.full((B,), R + T, jnp.int32), jnp.asarray(positions), own_keys_at=R)


# (name, T, spec over C = 48 keys, how many calls): every decomposition `cudnn.calls` makes
GRADIENT_CASES = [
    ("chunk_at_offsets", 8,
     prefix_spec(2, 8, q_offset=jnp.asarray([20, 0]), kv_len=jnp.asarray([28, 8]), num_keys=48), 2),
    ("static_offset", 8, prefix_spec(2, 8, q_offset=16, kv_len=24, num_keys=48), 2),
    ("whole_sequence", 48, prefix_spec(2, 48, num_keys=48), 1),
    ("lambda", 48, prefix_spec(2, 48, num_keys=48, sink=4, recent=12), 2),
    ("lambda_without_sinks", 48, prefix_spec(2, 48, num_keys=48, sink=0, recent=12), 1),
    ("lambda_at_offsets", 24, prefix_spec(2, 24, q_offset=jnp.asarray([7, 24]), num_keys=48, sink=4, recent=12), 4),
    ("lambda_chunk_shorter_than_its_window", 8,
     prefix_spec(2, 8, q_offset=jnp.asarray([0, 30]), num_keys=48, sink=4, recent=12), 4),
    ("lambda_static_offset", 16, prefix_spec(2, 16, q_offset=16, num_keys=48, sink=4, recent=12), 4),
    ("lambda_at_offsets_without_sinks", 24,
     prefix_spec(2, 24, q_offset=jnp.asarray([3, 20]), num_keys=48, sink=0, recent=5), 2),
    ("window_chunk_at_offsets", 8,
     prefix_spec(2, 8, q_offset=jnp.asarray([20, 0]), kv_len=jnp.asarray([28, 8]), num_keys=48, window=6), 2),
    ("window_whole_sequence", 48, prefix_spec(2, 48, num_keys=48, window=7), 1),
    ("window_decode", 1,
     prefix_spec(2, 1, q_offset=jnp.asarray([30, 2]), kv_len=jnp.asarray([31, 3]), num_keys=48, window=6), 1),
    ("ring", 8, _ring_spec(2, 8, 40), 2),
    ("ring_decode", 1, _ring_spec(2, 1, 47), 1),
    ("decode", 1, prefix_spec(2, 1, q_offset=jnp.asarray([30, 0]), kv_len=jnp.asarray([31, 1]), num_keys=48), 1),
]  # fmt: skip


def _grads(fn, q, k, v, seed=6):
    w = jnp.asarray(np.random.default_rng(seed).standard_normal(q.shape), jnp.float32)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("name, T, spec, n_calls", GRADIENT_CASES, ids=[c[0] for c in GRADIENT_CASES])
def test_gradient_through_each_calls_backward_is_the_whole_masks(name, T, spec, n_calls):
    """Each decomposition's gradient, each call's backward given the merged statistics (the stand-in for cuDNN's),
    against the XLA path's gradient on the whole mask; and its forward."""
    q, k, v = _inputs(2, T, 48, 4, 2, 16, seed=5)
    assert len(cudnn.calls(q, k, v, spec)) == n_calls
    run = functools.partial(cudnn.attention, spec=spec, attend=cudnn.xla_part, attend_backward=cudnn.xla_part_backward)
    assert rel_err(run(q, k, v), xla.attention(q, k, v, spec)) < 1e-5
    for got, want in zip(_grads(run, q, k, v), _grads(lambda q, k, v: xla.attention(q, k, v, spec), q, k, v)):
        assert rel_err(got, want) < 1e-5


def test_lambda_rows_that_are_no_query_get_no_gradient():
    """Λ at an offset gathers the queries of its sinks call, one row per sink; a row that is no query (past the
    chunk) is a copy of the last query, whose merged log-sum-exp does not cover the future sinks that row sees.
    A sink key scoring far above it (exp overflows float32) must still give a finite, exact gradient."""
    B, T, H, K, E = 2, 8, 4, 2, 16
    spec = prefix_spec(B, T, q_offset=jnp.asarray([0, 2]), num_keys=48, sink=16, recent=2)
    q, k, v = _inputs(B, T, 48, H, K, E, seed=8)
    k = k.at[:, 12].set(20 * q[:, T - 1, :: H // K])  # key 12, a sink in the future of every query, scores ~300
    run = functools.partial(cudnn.attention, spec=spec, attend=cudnn.xla_part, attend_backward=cudnn.xla_part_backward)
    for got, want in zip(_grads(run, q, k, v), _grads(lambda q, k, v: xla.attention(q, k, v, spec), q, k, v)):
        assert bool(jnp.all(jnp.isfinite(got))) and rel_err(got, want) < 1e-5


def _own_statistics_backward(q, k, v, kv_len, causal, window, out, lse, d_out, *, scale):
    """The binding's own VJP: each call's backward from its own output and log-sum-exp (a wrong merged gradient)."""
    own_out, own_lse = cudnn.xla_part(q, k, v, kv_len, causal, window, scale=scale)
    return cudnn.xla_part_backward(q, k, v, kv_len, causal, window, own_out, own_lse, d_out, scale=scale)


@pytest.mark.parametrize("case", [0, 3], ids=["chunk_at_offsets", "lambda"])
def test_a_backward_from_each_calls_own_statistics_is_wrong(case):
    """What the merged statistics are for: with each call's own, two calls' gradients are far off."""
    _, T, spec, _ = GRADIENT_CASES[case]
    q, k, v = _inputs(2, T, 48, 4, 2, 16, seed=5)
    run = functools.partial(cudnn.attention, spec=spec, attend=cudnn.xla_part, attend_backward=_own_statistics_backward)
    want = _grads(lambda q, k, v: xla.attention(q, k, v, spec), q, k, v)
    assert max(rel_err(g, w) for g, w in zip(_grads(run, q, k, v), want)) > 1e-2


def test_backward_stand_in_is_the_contract():
    """`xla_part_backward`, the stand-in for cuDNN's backward, given one call's own statistics, is that call's
    gradient (autodiff of the XLA path), with a padding mask and with a sliding window."""
    q, k, v = _inputs(2, 12, 20, 4, 2, 8, seed=9)
    d_out = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)
    for kv_len, causal, window in ((jnp.asarray([20, 7]), False, None), (None, True, 5)):
        out, lse = cudnn.xla_part(q, k, v, kv_len, causal, window, scale=0.3)
        got = cudnn.xla_part_backward(q, k, v, kv_len, causal, window, out, lse, d_out, scale=0.3)
        spec = prefix_spec(2, 12, kv_len=kv_len, num_keys=20, causal=causal, window=window)
        _, vjp = jax.vjp(lambda q, k, v: xla.attention(q, k, v, spec, scale=0.3), q, k, v)
        for g, w in zip(got, vjp(d_out), strict=True):
            assert rel_err(g, w) < 1e-5


def _binding_like(q, k, v, kv_len, causal, window=None, *, scale):
    """The stand-in with the binding's VJP: no gradient reaches the log-sum-exp."""
    out, lse = cudnn.xla_part(q, k, v, kv_len, causal, window, scale=scale)
    return out, jax.lax.stop_gradient(lse)


def test_gradient_is_the_kernels_where_cudnns_backward_fails_its_probe():
    """A chunk at an offset (two calls merged) where cuDNN's backward did not pass its probe (as on this host): the
    gradient through the dispatch's cuDNN path is the XLA path's, recomputed."""
    B, T, C, H, K, E = 2, 8, 48, 4, 2, 16
    q, k, v = _inputs(B, T, C, H, K, E, seed=5)
    spec = prefix_spec(B, T, q_offset=jnp.asarray([20, 3]), kv_len=jnp.asarray([28, 11]), num_keys=C)
    assert cudnn.gradient_unavailable() is not None
    want = _grads(lambda q, k, v: xla.attention(q, k, v, spec), q, k, v)
    got = _grads(
        lambda q, k, v: dispatch.cudnn_attention(
            q, k, v, spec, scale=None, backward_impl="xla", attend_part=_binding_like
        ), q, k, v,
    )  # fmt: skip
    for g, h in zip(got, want, strict=True):
        assert rel_err(g, h) < 1e-5


@pytest.mark.parametrize(
    "spec, masks, windows",
    [
        (prefix_spec(1, 256, num_keys=256, sink=16, recent=64), ["CAUSAL", "CAUSAL"], ["64", "0"]),
        (prefix_spec(1, 256, q_offset=jnp.asarray([100]), num_keys=512), ["CAUSAL", "PADDING"], ["0", "0"]),
        (
            prefix_spec(1, 128, q_offset=jnp.asarray([100]), num_keys=256, sink=16, recent=64),
            ["CAUSAL", "PADDING_CAUSAL", "CAUSAL", "NO_MASK"],
            ["64", "0", "0", "0"],
        ),
        (
            prefix_spec(1, 128, q_offset=jnp.asarray([100]), num_keys=256, window=64),
            ["CAUSAL", "PADDING_CAUSAL"],
            ["64", "0"],
        ),  # fmt: skip
    ],
    ids=["lambda", "chunk_at_an_offset", "lambda_at_an_offset", "window_at_an_offset"],
)
def test_gradient_calls_pass_the_bindings_checks(monkeypatch, spec, masks, windows):
    """The gradient through cuDNN lowered for an NVIDIA GPU on this host (the cuDNN version check bypassed): each call
    once forward and once backward (its backward primitive bound with the merged statistics), with the mask and the
    sliding window each call needs, and shapes that pass the binding's checks."""
    import re

    from jax._src.cudnn import fused_attention_stablehlo as binding

    monkeypatch.setattr(binding, "check_cudnn_version", lambda: 90800)
    T, S = spec.q_positions.shape[1], int(spec.kv_len[0])
    q, k = jnp.zeros((1, T, 8, 64), jnp.bfloat16), jnp.zeros((1, S, 2, 64), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(cudnn.attention(q, k, v, spec).astype(jnp.float32))  # noqa: E731
    checks = [jax.export.DisabledSafetyCheck.custom_call(f"__cudnn$fmhaSoftmax{b}") for b in ("", "Backward")]
    exported = jax.export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=("cuda",), disabled_checks=checks
    )
    calls = [line for line in exported(q, k, k).mlir_module().splitlines() if "stablehlo.custom_call @__cudnn" in line]
    forward, backward = ([c for c in calls if f"fmhaSoftmax{b}(" in c] for b in ("", "Backward"))
    assert len(forward) == len(backward) == len(masks)
    field = lambda name, c: re.findall(name + r"\\22: (?:\\22)?(\w+)", c)[0]  # noqa: E731 - from the backend config
    for step in (forward, backward):
        assert [field("mask_type", c) for c in step] == masks
        assert [field("sliding_window_length", c) for c in step] == windows


def test_a_forward_alone_never_runs_the_gradient_probe(monkeypatch):
    """Inference through the dispatch's cuDNN path (a chunk at an offset) does not probe cuDNN's backward: the probe
    compiles gradients, start-up work only a gradient needs. Taking the gradient probes it once."""
    probed = []
    monkeypatch.setattr(cudnn, "gradient_unavailable", lambda: probed.append(1) or None)
    monkeypatch.setattr(cudnn, "_cudnn_backward", cudnn.xla_part_backward)
    q, k, v = _inputs(2, 8, 48, 4, 2, 16, seed=5)
    spec = prefix_spec(2, 8, q_offset=jnp.asarray([20, 3]), kv_len=jnp.asarray([28, 11]), num_keys=48)
    run = functools.partial(dispatch.cudnn_attention, spec=spec, scale=None, backward_impl="xla")
    out = jax.jit(functools.partial(run, attend_part=cudnn.xla_part))(q, k, v)
    assert rel_err(out, xla.attention(q, k, v, spec)) < 1e-5 and not probed
    got = _grads(functools.partial(run, attend_part=cudnn.xla_part), q, k, v)
    for g, w in zip(got, _grads(lambda q, k, v: xla.attention(q, k, v, spec), q, k, v), strict=True):
        assert rel_err(g, w) < 1e-5
    assert probed == [1]


@pytest.fixture
def gpu_without_triton(monkeypatch):
    """This host as a GPU where Triton does not work: "auto" resolves to "cudnn", the rest to the XLA path, and
    cuDNN's calls run on the XLA stand-in, counted by their keys."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape[1])  # the call's keys
        return cudnn.xla_part(*args, **kwargs)

    monkeypatch.setattr(dispatch, "resolve_impl", lambda impl: "cudnn" if impl in ("auto", "cudnn") else impl)
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")
    monkeypatch.setattr(cudnn, "_cudnn", counted)
    return calls


def test_lambda_goes_through_cudnn_only_without_triton(gpu_without_triton, monkeypatch):
    """Gate training's Λ on a GPU where Triton does not work: forward and gradient through cuDNN's two calls (the
    stand-ins, counted), matching the XLA path; where Triton works, or Λ through cuDNN failed its probe, not."""
    calls = gpu_without_triton
    monkeypatch.setattr(cudnn, "gradient_unavailable", lambda: None)
    monkeypatch.setattr(cudnn, "lambda_unavailable", lambda at_offset=False: None)
    monkeypatch.setattr(cudnn, "_cudnn_backward", cudnn.xla_part_backward)
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(1, 64, 64, 4, 2, 16, seed=11))
    run = lambda q, k, v: dispatch.lambda_attention(q, k, v, sink=4, recent=16)  # noqa: E731
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = _grads(lambda q, k, v: dispatch.lambda_attention(q, k, v, sink=4, recent=16, impl="xla"), *f32)
    for g, w in zip(_grads(run, q, k, v), want, strict=True):
        assert rel_err(g.astype(jnp.float32), w) < 2e-2
    assert calls == [64, 4]  # the window over all the keys, then the sinks
    calls.clear()
    shard = lambda q, k, v: dispatch.lambda_attention(q, k, v, sink=4, recent=16, q_offset=jnp.asarray(24))  # noqa: E731
    want = _grads(
        lambda q, k, v: dispatch.lambda_attention(q, k, v, sink=4, recent=16, q_offset=jnp.asarray(24), impl="xla"),
        f32[0][:, 24:48], *f32[1:],
    )  # fmt: skip
    for g, w in zip(_grads(shard, q[:, 24:48], k, v), want, strict=True):
        assert rel_err(g.astype(jnp.float32), w) < 2e-2
    assert calls == [24, 15, 4, 4]  # a shard's queries at a traced offset: own keys, the window before them, sinks
    calls.clear()
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "pallas")
    monkeypatch.setattr(dispatch, "_kernels", lambda *args: "pallas kernels")
    assert run(q, k, v) == "pallas kernels"
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")
    monkeypatch.setattr(cudnn, "lambda_unavailable", lambda at_offset=False: "its sliding window is off")
    run(q, k, v)
    assert not calls


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_chunk_over_codes_dequantizes_its_prefix_a_segment_at_a_time(monkeypatch, kind):
    """A chunk over a quantized cache: its own keys and its prefix dequantized, the prefix in segments of
    PREFIX_SEGMENT slots (one call each; a segment past a sequence's prefix has no keys there), matching the XLA
    path over the codes."""
    monkeypatch.setattr(cudnn, "PREFIX_SEGMENT", 16)
    B, T, C, H, K, E = 2, 8, 48, 4, 2, 16
    q, k, v = _inputs(B, T, C, H, K, E, seed=13)
    k, v = (quantize_kv(x, kind) for x in (k, v))
    spec = prefix_spec(B, T, q_offset=jnp.asarray([20, 3]), kv_len=jnp.asarray([28, 11]), num_keys=C)
    parts = cudnn.calls(q, k, v, spec)
    assert [part.k.shape[1] for part in parts] == [T, 16, 16, 16]
    assert [part.lengths.tolist() for part in parts[1:]] == [[16, 3], [4, 0], [0, 0]]
    assert rel_err(cudnn.attention(q, k, v, spec, attend=cudnn.xla_part), xla.attention(q, k, v, spec)) < 1e-5


def test_codes_go_through_cudnn_for_chunks_only_without_triton(gpu_without_triton, monkeypatch):
    """A GPU where Triton does not work: a prefill chunk over int4 codes through cuDNN (the stand-in, counted),
    matching the XLA path; a decode step over them stays on the XLA path (bound by reading the cache, which a
    dequantized copy would double); where Triton works, the kernels read the codes."""
    calls = gpu_without_triton
    B, T, C = 2, 8, 48
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(B, T, C, 4, 2, 16, seed=14))
    k, v = (quantize_kv(x, "int4") for x in (k, v))
    spec = prefix_spec(B, T, q_offset=jnp.asarray([20, 3]), kv_len=jnp.asarray([28, 11]), num_keys=C)
    want = xla.attention(q, k, v, spec).astype(jnp.float32)
    assert rel_err(attend(q, k, v, spec).astype(jnp.float32), want) < 2e-2
    assert calls == [T, C]  # its own keys, then the prefix (one segment)
    calls.clear()
    decode = prefix_spec(B, 1, q_offset=jnp.asarray([20, 3]), kv_len=jnp.asarray([21, 4]), num_keys=C)
    attend(q[:, :1], k, v, decode)
    assert not calls
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "pallas")
    monkeypatch.setattr(dispatch, "_kernels", lambda *args: "pallas kernels")
    assert attend(q, k, v, spec) == "pallas kernels"


def test_chunk_over_codes_passes_the_bindings_checks(monkeypatch):
    """Lowered for an NVIDIA GPU on this host (the cuDNN version check bypassed): a chunk over int4 codes is the
    causal call over its own keys and one call with a padding mask per prefix segment, on dequantized bf16 keys."""
    import re

    from jax._src.cudnn import fused_attention_stablehlo as binding

    monkeypatch.setattr(binding, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(cudnn, "PREFIX_SEGMENT", 256)
    q = jnp.zeros((1, 128, 8, 64), jnp.bfloat16)
    k = quantize_kv(jnp.zeros((1, 512, 2, 64), jnp.bfloat16), "int4")
    spec = prefix_spec(1, 128, q_offset=jnp.asarray([300]), num_keys=512)
    exported = jax.export.export(
        jax.jit(cudnn.attention),
        platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__cudnn$fmhaSoftmax")],
    )(q, k, k, spec)
    calls = [line for line in exported.mlir_module().splitlines() if "stablehlo.custom_call @__cudnn" in line]
    masks = [re.findall(r"mask_type\\22: (?:\\22)?(\w+)", c)[0] for c in calls]
    assert masks == ["CAUSAL", "PADDING", "PADDING"]
    assert all("tensor<1x256x2x64xbf16>" in c for c in calls[1:])


@pytest.fixture
def gpu_with_cudnn(monkeypatch):
    """This host as a GPU where Triton and cuDNN both work: "auto" resolves to "pallas", cuDNN's probes pass, and
    its calls (counted) and their backward run on the XLA stand-ins; long chunks start at 64 keys, a mixed layer's
    at 128."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return cudnn.xla_part(*args, **kwargs)

    monkeypatch.setattr(dispatch, "resolve_impl", lambda impl: "pallas" if impl == "auto" else impl)
    monkeypatch.setattr(dispatch._backend, "triton_unavailable", lambda: None)
    for probe in (
        "unavailable",
        "gradient_unavailable",
        "lambda_unavailable",
        "window_unavailable",
        "partial_unavailable",
    ):
        monkeypatch.setattr(cudnn, probe, lambda *args: None)
    monkeypatch.setattr(cudnn, "_cudnn", counted)
    monkeypatch.setattr(cudnn, "_cudnn_backward", cudnn.xla_part_backward)
    monkeypatch.setattr(dispatch, "CUDNN_MIN_KEYS", 64)
    monkeypatch.setattr(dispatch, "CUDNN_MIN_KEYS_MIXED", 128)
    monkeypatch.setattr(dispatch, "_kernels", lambda *args: "pallas kernels")
    return calls


def test_auto_takes_cudnn_for_chunks_over_long_caches_only(gpu_with_cudnn):
    B, T, H, K, E = 1, 8, 2, 1, 16
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(B, T, 64, H, K, E, seed=7))
    spec = prefix_spec(B, T, q_offset=jnp.asarray([30]), kv_len=jnp.asarray([38]), num_keys=64)
    got = attend(q, k, v, spec)  # a chunk over a cache of 64 keys: cuDNN
    assert len(gpu_with_cudnn) == 2  # its prefix and its own keys
    want = xla.attention(*(x.astype(jnp.float32) for x in (q, k, v)), spec)
    assert rel_err(got.astype(jnp.float32), want) < 2e-2
    gpu_with_cudnn.clear()
    short = prefix_spec(B, T, q_offset=jnp.asarray([10]), kv_len=jnp.asarray([18]), num_keys=32)
    whole = prefix_spec(B, 64, num_keys=64)  # a sequence attending itself (gate training)
    assert attend(q, k[:, :32], v[:, :32], short) == "pallas kernels"
    assert attend(q, k, v, spec, impl="pallas") == "pallas kernels"  # the kernel asked for by name
    assert attend(*(jnp.zeros((B, 64, H, E), jnp.bfloat16),), k, v, whole) == "pallas kernels"
    decode = prefix_spec(B, 1, q_offset=jnp.asarray([30]), kv_len=jnp.asarray([31]), num_keys=64)
    attend(q[:, :1], k, v, decode)  # a decode step: the Triton decode kernel's, not cuDNN's
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    assert attend(*f32, spec) == "pallas kernels"  # cuDNN takes 16-bit values
    assert not gpu_with_cudnn


def test_auto_takes_cudnn_for_long_whole_sequences_forward_and_backward(gpu_with_cudnn, monkeypatch):
    """Causal attention over a whole sequence (gate training's full attention) of CUDNN_MIN_SEQUENCE tokens or more
    runs through cuDNN's one call under "auto", and so does its gradient (the backward stand-in, counted) where the
    gradient probe passed, else the kernels recompute it; a forward alone never runs that probe. Λ, a shorter
    sequence or "pallas" by name keep the kernels."""
    backward = []

    def counted_backward(*args, **kwargs):
        backward.append(args[0].shape[1])
        return cudnn.xla_part_backward(*args, **kwargs)

    monkeypatch.setattr(dispatch, "CUDNN_MIN_SEQUENCE", 32)
    monkeypatch.setattr(cudnn, "_cudnn_backward", counted_backward)
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(1, 32, 32, 4, 2, 16, seed=12))
    whole = prefix_spec(1, 32, num_keys=32)
    got = _grads(lambda q, k, v: attend(q, k, v, whole), q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = _grads(lambda q, k, v: xla.attention(q, k, v, whole), *f32)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g.astype(jnp.float32), w) < 2e-2
    assert gpu_with_cudnn == [q.shape] and backward == [32]  # one call, its backward
    assert attend(q, k, v, prefix_spec(1, 32, num_keys=32, sink=4, recent=8)) == "pallas kernels"  # Λ
    assert attend(q[:, :16], k[:, :16], v[:, :16], prefix_spec(1, 16, num_keys=16)) == "pallas kernels"  # shorter
    assert attend(q, k, v, whole, impl="pallas") == "pallas kernels"
    gpu_with_cudnn.clear(), backward.clear()
    probed, kernels = [], []
    monkeypatch.setattr(cudnn, "gradient_unavailable", lambda: probed.append(1) or "its backward is off")
    attend(q, k, v, whole)  # a forward: cuDNN, the gradient's probe not run
    assert gpu_with_cudnn == [q.shape] and not probed

    def kernel(q, k, v, spec, scale, impl):
        kernels.append(impl)
        return xla.attention(q, k, v, spec, scale=scale)

    monkeypatch.setattr(dispatch, "_kernels", kernel)
    for g, w in zip(_grads(lambda q, k, v: attend(q, k, v, whole), q, k, v), want, strict=True):
        assert rel_err(g.astype(jnp.float32), w) < 2e-2
    assert probed and not backward and kernels == ["pallas"]  # the gradient recomputed on the kernels


def test_auto_takes_cudnn_for_sliding_windows(gpu_with_cudnn, monkeypatch):
    """A sliding window (Mistral, Qwen), which the Triton kernels do not serve, goes through cuDNN under "auto" (a
    chunk at offsets: its own keys' window and the window's keys before it; a decode step: the window's slots), not
    the XLA path; "pallas" by name, or the window probe failing, leaves it to the XLA path."""
    B, T, C = 2, 8, 48
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(B, T, C, 4, 2, 16, seed=15))
    chunk = prefix_spec(B, T, q_offset=jnp.asarray([20, 0]), kv_len=jnp.asarray([28, 8]), num_keys=C, window=6)
    decode = prefix_spec(B, 1, q_offset=jnp.asarray([30, 2]), kv_len=jnp.asarray([31, 3]), num_keys=C, window=6)
    for spec, queries, rows in ((chunk, q, [T, 5]), (decode, q[:, :1], [1])):  # each call's query rows
        got = attend(queries, k, v, spec)
        assert [shape[1] for shape in gpu_with_cudnn] == rows
        want = xla.attention(*(x.astype(jnp.float32) for x in (queries, k, v)), spec)
        assert rel_err(got.astype(jnp.float32), want) < 2e-2
        gpu_with_cudnn.clear()
    attend(q, k, v, chunk, impl="pallas")
    monkeypatch.setattr(cudnn, "window_unavailable", lambda: "its sliding window is off")
    attend(q, k, v, chunk)
    assert not gpu_with_cudnn


def test_duo_prefill_leaves_long_chunks_to_cudnn(gpu_with_cudnn, monkeypatch):
    """Under "auto" a mixed layer's chunk over a long retrieval cache runs per partition (the retrieval heads
    through cuDNN); over a short one, or with the kernel asked for by name, in the one-launch kernel."""
    monkeypatch.setattr(dispatch.pallas_kernels, "duo_prefill_attention", lambda *a, **kw: "one launch")
    B, T, R, E = 1, 8, 16, 16
    q = jnp.zeros((B, T, 4, E), jnp.bfloat16)
    window = jnp.zeros((B, R + T, 1, E), jnp.bfloat16)
    positions = jnp.full((B, R + T), -1, jnp.int32)

    def chunk(capacity, impl="auto"):
        cache = jnp.zeros((B, capacity, 1, E), jnp.bfloat16)
        return dispatch.duo_prefill(
            q, cache, cache, window, window, positions, kv_order=(1, 0), q_offset=jnp.asarray([0]),
            kv_len=jnp.asarray([T]), impl=impl,
        )  # fmt: skip

    assert chunk(128) is None
    assert chunk(64) == "one launch"
    assert chunk(128, impl="pallas") == "one launch"


def _paged(B, N, M, P, K, E, lengths, seed):
    """A pool [K, N, P, E] and tables [B, M] handing each sequence distinct pages in a shuffled order, "no page" (N)
    past its length."""
    rng = np.random.default_rng(seed)
    pages_k, pages_v = (jnp.asarray(rng.standard_normal((K, N, P, E)), jnp.float32) for _ in range(2))
    order = iter(rng.permutation(N))
    tables = np.full((B, M), N, np.int32)
    for b, length in enumerate(lengths):
        for m in range(-(-length // P)):
            tables[b, m] = next(order)
    return PagedKV(pages_k, jnp.asarray(tables)), PagedKV(pages_v, jnp.asarray(tables))


@pytest.mark.parametrize(
    "B, N, M, offsets, T",
    [
        (2, 8, 3, (12, 0), 9),  # both sequences in one call, tables 4 wide (padded)
        (3, 7, 2, (5, 0, 7), 6),  # 7 pages: one call per sequence, tables 7 wide
        (4, 8, 4, (0, 3, 11, 2), 4),  # two calls of two sequences
        (1, 2, 3, (13,), 3),  # a pool of fewer pages than the table: cut to 2 entries
        (3, 6, 2, (10, 1, 12), 1),  # decode steps
    ],
    ids=["one_call", "per_sequence", "two_calls", "table_cut", "decode"],
)
def test_paged_chunk_matches_the_whole_mask(B, N, M, offsets, T):
    """A chunk (or a decode step) over pages: the prefix through the paged call (the stand-in follows the binding's
    documented contract), each KV head a sequence of its own, against the XLA path over the same pages."""
    P, H, K, E = 8, 6, 2, 16
    offsets = np.asarray(offsets)
    k, v = _paged(B, N, M, P, K, E, offsets + T, seed=B + N)
    q = jnp.asarray(np.random.default_rng(9).standard_normal((B, T, H, E)), jnp.float32)
    spec = prefix_spec(B, T, q_offset=jnp.asarray(offsets), kv_len=jnp.asarray(offsets + T), num_keys=M * P)
    stand_in = functools.partial(cudnn.attention, attend=cudnn.xla_part, attend_paged=cudnn.xla_paged_part)
    got = jax.jit(stand_in)(q, k, v, spec)
    want = jax.jit(xla.attention)(q, k.contiguous(), v.contiguous(), spec)
    assert rel_err(got, want) < 1e-5


def test_paged_prefix_reads_every_head_from_its_own_pages():
    """Swapping the two heads' pages changes the result: the table entries carry the head's offset (h * N)."""
    B, N, M, P, K, E, T = 1, 4, 2, 8, 2, 16, 1
    k, v = _paged(B, N, M, P, K, E, [12], seed=3)
    q = jnp.asarray(np.random.default_rng(4).standard_normal((B, T, 4, E)), jnp.float32)
    lengths = jnp.asarray([12])
    prefix = jax.jit(functools.partial(cudnn.paged_prefix, attend=functools.partial(cudnn.xla_paged_part, scale=0.25)))
    out, lse = prefix(q, k, v, lengths)
    spec = prefix_spec(B, T, q_offset=lengths - 1, kv_len=lengths, num_keys=M * P)
    want_out, want_lse = xla.attention_with_lse(q, k.contiguous(), v.contiguous(), spec, scale=0.25)
    assert rel_err(out, want_out) < 1e-5 and rel_err(lse, want_lse) < 1e-5
    swapped = PagedKV(k.pages[::-1], k.block_tables), PagedKV(v.pages[::-1], v.block_tables)
    other, _ = prefix(q, *swapped, lengths)
    assert rel_err(other, want_out) > 1e-2


def test_sequences_per_call():
    assert cudnn.sequences_per_call(8, 64, 8) == 8  # the pool holds every table: one call
    assert cudnn.sequences_per_call(8, 32, 8) == 4  # tables 8 wide for 4 sequences: two calls
    assert cudnn.sequences_per_call(6, 35, 5) == 1  # 35 pages divide among no 2, 3 or 6 sequences
    assert cudnn.sequences_per_call(2, 3, 8) == 1  # a pool smaller than one table


def test_serves_pages_of_16_bit_values():
    B, T, N, M, P, K, E = 2, 4, 8, 2, 8, 2, 64
    k, v = _paged(B, N, M, P, K, E, [16, 8], seed=5)
    k16, v16 = (PagedKV(x.pages.astype(jnp.bfloat16), x.block_tables) for x in (k, v))
    q = jnp.zeros((B, T, 4, E), jnp.bfloat16)
    chunk = prefix_spec(B, T, q_offset=jnp.asarray([4, 0]), num_keys=M * P)
    assert cudnn.serves(q, k16, v16, chunk)
    assert cudnn.serves(q[:, :1], k16, v16, prefix_spec(B, 1, q_offset=jnp.asarray([4, 0]), num_keys=M * P))
    assert not cudnn.serves(q, k, v, chunk)  # fp32 pages
    assert not cudnn.serves(q, k16, v16, prefix_spec(B, T, num_keys=M * P, window=8))
    assert not cudnn.takes(q, k16, v16)  # "auto" with Triton keeps the paged kernels


def test_paged_calls_pass_the_bindings_checks(monkeypatch):
    """The operands as the binding sees them: lowered for an NVIDIA GPU on this host (the cuDNN version check
    bypassed), a chunk over pages is one causal call and one paged call per group of sequences, whose shapes pass the
    binding's own checks (num_blocks = rows x table width, ranks, dtypes)."""
    from jax._src.cudnn import fused_attention_stablehlo as binding

    if not hasattr(binding, "paged_attention"):
        pytest.skip("this JAX's cuDNN binding has no paged attention")
    monkeypatch.setattr(binding, "check_cudnn_version", lambda: 90800)
    B, T, N, M, P, K, E = 4, 16, 8, 4, 64, 2, 64
    k, v = _paged(B, N, M, P, K, E, [70, 20, 200, 5], seed=6)
    k, v = (PagedKV(x.pages.astype(jnp.bfloat16), x.block_tables) for x in (k, v))
    q = jnp.zeros((B, T, 8, E), jnp.bfloat16)
    spec = prefix_spec(B, T, q_offset=jnp.asarray([54, 4, 184, 0]), num_keys=M * P)
    exported = jax.export.export(
        jax.jit(cudnn.attention),
        platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__cudnn$fmhaSoftmax")],
    )(q, k, v, spec)
    calls = [line for line in exported.mlir_module().splitlines() if "stablehlo.custom_call @__cudnn" in line]
    paged = [c for c in calls if "\\22is_paged_attention\\22: true" in c]
    assert len(calls) == 3 and len(paged) == 2  # the chunk's own keys, then two groups of two sequences
    # rows (sequence, KV head) = 2 x 2, 4 query heads each; the pool as K * N blocks of one head; tables 4 wide
    assert "(tensor<4x4x16x64xbf16>, tensor<16x1x64x64xbf16>, tensor<16x1x64x64xbf16>" in paged[0]
    assert "tensor<4x1x4x1xi32>" in paged[0]


def test_pages_go_through_cudnn_only_without_triton(monkeypatch):
    """A GPU where Triton does not work ("auto" resolves to "cudnn", the rest to XLA): a paged decode step and a
    paged chunk run through cuDNN's paged call (the stand-in, counted); where Triton works they keep its kernels."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return cudnn.xla_paged_part(*args, **kwargs)

    monkeypatch.setattr(dispatch, "resolve_impl", lambda impl: "cudnn" if impl in ("auto", "cudnn") else impl)
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")
    monkeypatch.setattr(cudnn, "paged_unavailable", lambda *shape: None)
    monkeypatch.setattr(cudnn, "_cudnn", cudnn.xla_part)
    monkeypatch.setattr(cudnn, "_cudnn_paged", counted)
    B, N, M, P, K, E = 2, 8, 3, 8, 2, 16
    k, v = (PagedKV(x.pages.astype(jnp.bfloat16), x.block_tables) for x in _paged(B, N, M, P, K, E, [20, 9], seed=7))
    f32 = [PagedKV(x.pages.astype(jnp.float32), x.block_tables) for x in (k, v)]
    rng = np.random.default_rng(8)
    for T, offsets in ((1, [19, 8]), (5, [15, 4])):
        q = jnp.asarray(rng.standard_normal((B, T, 4, E)), jnp.bfloat16)
        spec = prefix_spec(B, T, q_offset=jnp.asarray(offsets), kv_len=jnp.asarray(offsets) + T, num_keys=M * P)
        got = attend(q, k, v, spec)
        assert calls == [(B * K, 2, T, E)]  # one paged call of both sequences' (sequence, KV head) rows
        assert rel_err(got.astype(jnp.float32), xla.attention(q.astype(jnp.float32), *f32, spec)) < 2e-2
        calls.clear()
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "pallas")
    monkeypatch.setattr(dispatch, "_kernels", lambda *args: "pallas kernels")
    assert attend(q, k, v, spec) == "pallas kernels" and not calls


def test_paged_probe_passes_the_contract_and_catches_a_wrong_call(monkeypatch):
    """The probe run with the stand-in for cuDNN's calls passes, at the default shape and another; with a paged call
    that ignores the tables (reads the blocks in order) it names the error instead."""
    monkeypatch.setattr(cudnn, "unavailable", lambda: None)
    monkeypatch.setattr(cudnn, "_cudnn", cudnn.xla_part)
    monkeypatch.setattr(cudnn, "_cudnn_paged", cudnn.xla_paged_part)
    assert cudnn.paged_unavailable.__wrapped__() is None
    assert cudnn.paged_unavailable.__wrapped__(16, 32, 3, jnp.float16) is None  # another page size, head dim, group

    def in_block_order(q, blocks_k, blocks_v, q_len, kv_len, tables, *, scale):
        order = jnp.arange(tables.size, dtype=jnp.int32).reshape(tables.shape) % blocks_k.shape[0]
        return cudnn.xla_paged_part(q, blocks_k, blocks_v, q_len, kv_len, order, scale=scale)

    monkeypatch.setattr(cudnn, "_cudnn_paged", in_block_order)
    jax.clear_caches()  # `jax.jit(attention)` traced with the stand-in above
    assert "cuDNN paged attention (T=64) is off by" in cudnn.paged_unavailable.__wrapped__()


def test_gradient_probes_pass_the_contract_and_catch_wrong_calls(monkeypatch):
    """The gradient, Λ, window and shard probes run with the stand-ins for cuDNN's call and backward pass. With a
    backward from each call's own statistics (the binding's VJP), the gradient probe names the error; with a backward
    that raises (an operand this JAX's primitive does not take), the exception; with a call that ignores the sliding
    window, the Λ and window probes name the error and the gradient probe still passes; with one that ignores key
    lengths, the shard probe."""
    monkeypatch.setattr(cudnn, "unavailable", lambda: None)
    monkeypatch.setattr(cudnn, "_cudnn", cudnn.xla_part)
    monkeypatch.setattr(cudnn, "_cudnn_backward", cudnn.xla_part_backward)
    assert cudnn.gradient_unavailable.__wrapped__() is None
    monkeypatch.setattr(cudnn, "gradient_unavailable", lambda: None)
    assert cudnn.lambda_unavailable.__wrapped__() is None
    assert cudnn.lambda_unavailable.__wrapped__(at_offset=True) is None
    assert cudnn.window_unavailable.__wrapped__() is None
    assert cudnn.partial_unavailable.__wrapped__() is None

    def no_window(q, k, v, kv_len, causal, window=None, *, scale):
        return cudnn.xla_part(q, k, v, kv_len, causal, scale=scale)

    monkeypatch.setattr(cudnn, "_cudnn", no_window)
    jax.clear_caches()  # the probes' jitted functions traced with the stand-ins above
    assert "Λ through cuDNN over a whole sequence is off by" in cudnn.lambda_unavailable.__wrapped__()
    assert "Λ through cuDNN at offsets is off by" in cudnn.lambda_unavailable.__wrapped__(at_offset=True)
    assert "a sliding window through cuDNN is off by" in cudnn.window_unavailable.__wrapped__()

    def no_lengths(q, k, v, kv_len, causal, window=None, *, scale):
        return cudnn.xla_part(q, k, v, None, causal, window, scale=scale)

    monkeypatch.setattr(cudnn, "_cudnn", no_lengths)
    jax.clear_caches()
    assert "over a shard of the keys" in cudnn.partial_unavailable.__wrapped__()
    monkeypatch.undo()
    monkeypatch.setattr(cudnn, "unavailable", lambda: None)
    monkeypatch.setattr(cudnn, "_cudnn", cudnn.xla_part)
    monkeypatch.setattr(cudnn, "_cudnn_backward", _own_statistics_backward)
    jax.clear_caches()
    assert "cuDNN attention's gradient (a chunk) is off by" in cudnn.gradient_unavailable.__wrapped__()

    def raises(*args, **kwargs):
        raise TypeError("bind() got an unexpected keyword argument 'score_mod'")

    monkeypatch.setattr(cudnn, "_cudnn_backward", raises)
    jax.clear_caches()
    assert (
        cudnn.gradient_unavailable.__wrapped__() == "TypeError: bind() got an unexpected keyword argument 'score_mod'"
    )


def test_windowed_model_through_cudnn_gives_the_xla_paths_logits(gpu_without_triton, monkeypatch):
    """A model whose second layer has a sliding window (Mistral, Qwen's windowed layers), bf16, through cuDNN's calls
    (the XLA stand-in, counted by their windows): the windowed layer's prefill chunks as its own keys' window and the
    window's keys before them, its decode steps over the window's slots; the prompts' logits as the XLA path's."""
    import duo_jax
    from duo_jax.engine import Engine
    from duo_jax.methods import make_method
    from tests.conftest import tiny_config
    from tests.test_paged import all_logits

    windows = []

    def counted(q, k, v, kv_len, causal, window=None, *, scale):
        windows.append(window)
        return cudnn.xla_part(q, k, v, kv_len, causal, window, scale=scale)

    config = tiny_config(sliding_window=6, window_layers=(1,), max_position_embeddings=128)
    engine = Engine(duo_jax.init_params(config, jax.random.key(0), jnp.bfloat16, scale=0.05), config)
    method = make_method("full", config, context=64)
    prompts = [np.random.default_rng(6).integers(1, 128, n).tolist() for n in (29, 12)]
    logits = {}
    for impl in ("xla", "auto"):
        if impl == "auto":
            monkeypatch.setattr(cudnn, "_cudnn", counted)
            monkeypatch.setattr(cudnn, "window_unavailable", lambda: None)
        cache = method.init_cache(len(prompts), engine.dtype)
        logits[impl] = all_logits(engine, method, prompts, cache, chunk=8, steps=2, impl=impl)
    assert sorted(set(windows), key=str) == [6, None]  # the windowed layer's own keys, and every other call
    for x, c, prompt in zip(logits["xla"], logits["auto"], prompts):
        x, c = x[: len(prompt)], c[: len(prompt)]
        assert np.abs(c - x).max() < 3e-2 * np.abs(x).max() and np.abs(c - x).mean() < 3e-3 * np.abs(x).max()
        np.testing.assert_array_equal(c.argmax(-1), x.argmax(-1))


@pytest.mark.parametrize("T", [8, 1], ids=["chunk", "decode"])
def test_shard_partials_merge_into_attention_over_the_whole_cache(T):
    """A cache split in 4 shards of 12 slots (a generation mesh's `model` axis): each shard's partial through cuDNN's
    calls (the stand-in) at shard-local positions (the chunk before, across and after a shard) matches the XLA
    path's partial, out and log-sum-exp (the finite "no key" value where a query sees none of the shard), and the
    partials merged as `sharding.merge_partials` does are attention over the whole cache."""
    B, C, S = 3, 48, 12
    q, k, v = _inputs(B, T, C, 4, 2, 16, seed=21)
    lengths = jnp.asarray([28, 8, 48])
    offsets = lengths - T
    full = xla.attention(q, k, v, prefix_spec(B, T, q_offset=offsets, kv_len=lengths, num_keys=C))
    outs, lses = [], []
    for first in range(0, C, S):
        spec = MaskSpec(offsets[:, None] + jnp.arange(T)[None] - first, jnp.clip(lengths - first, 0, S))
        keys = (k[:, first : first + S], v[:, first : first + S])
        out, lse = cudnn.attention_with_lse(q, *keys, spec, attend=cudnn.xla_part)
        want_out, want_lse = xla.attention_with_lse(q, *keys, spec)
        assert rel_err(out, want_out) < 1e-5
        assert bool(jnp.all((lse > -1e30) == (want_lse > -1e30)))
        assert float(jnp.max(jnp.abs(jnp.where(want_lse > -1e30, lse - want_lse, 0.0)))) < 1e-5
        outs.append(out), lses.append(lse)
    lse = jnp.stack(lses)
    weight = jnp.exp(lse - lse.max(0))
    merged = (jnp.stack(outs) * weight[..., None]).sum(0) / weight.sum(0)[..., None]
    assert rel_err(merged, full) < 1e-5


def test_shard_partials_go_through_cudnn_under_auto(gpu_with_cudnn, monkeypatch):
    """`attend_partial` under "auto" on a GPU with Triton: a chunk over a shard through cuDNN (its two calls), a
    decode step through the split-K kernel; "pallas" by name keeps the chunk on the XLA path; without Triton the
    decode step goes through cuDNN too."""
    monkeypatch.setattr(dispatch.pallas_kernels, "decode_attention", lambda *a, **kw: (a[0], a[0][..., 0]))
    B, T, S = 2, 8, 32
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(B, T, S, 4, 2, 16, seed=22))
    chunk = MaskSpec(jnp.asarray([[-3], [10]]) + jnp.arange(T)[None], jnp.asarray([5, 18]))
    decode = MaskSpec(jnp.asarray([[4], [17]]), jnp.asarray([5, 18]))
    out, lse = dispatch.attend_partial(q, k, v, chunk)
    assert len(gpu_with_cudnn) == 2
    want, _ = xla.attention_with_lse(*(x.astype(jnp.float32) for x in (q, k, v)), chunk)
    assert rel_err(out.astype(jnp.float32), want) < 2e-2
    gpu_with_cudnn.clear()
    dispatch.attend_partial(q[:, :1], k, v, decode)
    dispatch.attend_partial(q, k, v, chunk, impl="pallas")
    assert not gpu_with_cudnn
    monkeypatch.setattr(dispatch, "resolve_impl", lambda impl: "cudnn" if impl in ("auto", "cudnn") else impl)
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")
    dispatch.attend_partial(q[:, :1], k, v, decode)
    assert len(gpu_with_cudnn) == 1

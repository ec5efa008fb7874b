"""On a GPU: the Pallas kernels compiled through Triton, and the engine running on them, against references.

`pytest -m gpu` runs this file; the default test command deselects it (pyproject's `addopts`) and it is
skipped on a machine without a GPU (CI has none). Shapes are Llama-3-8B's per-head shapes (head_dim 128,
GQA 4:1) at lengths where every kernel's block schedule matters (ragged last blocks, query offsets, empty
sequences), in float32 and bfloat16, each against attention computed in float64 numpy on the host with an
explicit mask.

Tolerances: fp32 kernels may multiply in TF32 on the tensor cores (10-bit mantissa), so fp32 outputs are
held to 5e-3 of the largest reference value and bf16 ones to 3e-2; the queries are scaled up (x3) so that the
softmax is peaked and a key wrongly seen or missed by the mask moves the output by far more than that.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from duo_jax.attention import dispatch
from duo_jax.attention.masks import MaskSpec
from pallas_kernels import (
    _backend,
    decode_attention,
    flash_attention,
    lambda_attention,
    paged_decode_attention,
    paged_flash_attention,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (run with pytest -m gpu)"),
]

TOL = {jnp.float32: 5e-3, jnp.bfloat16: 3e-2}
DTYPES = [jnp.float32, jnp.bfloat16]


def needs_triton():
    reason = _backend.triton_unavailable()
    if reason is not None:
        pytest.skip(f"Pallas's Triton backend does not run here: {reason}")


def inputs(batch, seq_q, seq_k, hq, hkv, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = 3.0 * rng.standard_normal((batch, seq_q, hq, head_dim))
    k, v = (rng.standard_normal((batch, seq_k, hkv, head_dim)) for _ in range(2))
    # the float64 reference sees exactly the values the kernel sees (rounded to `dtype`)
    q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64) for x in (q, k, v))
    return q, k, v


def attention_f64(q, k, v, mask):
    """q [B, T, H, E], k / v [B, S, K, E], mask [B, T, S] -> [B, T, H, E] in float64; empty rows give 0."""
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    # batched matmuls (BLAS, every core), not np.einsum: einsum's one-thread loops took minutes at 1k x 4k x 32 heads
    s = (q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)) / math.sqrt(q.shape[-1])
    s = np.where(mask[:, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(mask[:, None], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    l = p.sum(-1, keepdims=True)
    return ((p / np.where(l > 0, l, 1.0)) @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def positions_mask(seq_q, seq_k, q_offset, kv_len, sink=None, recent=None):
    q_offset, kv_len = (np.reshape(np.asarray(x), (-1, 1, 1)) for x in (q_offset, kv_len))
    p = q_offset + np.arange(seq_q)[None, :, None]
    j = np.arange(seq_k)[None, None, :]
    mask = (j <= p) & (j < kv_len)
    if sink is not None:
        mask &= (j < sink) | (p - j < recent)
    return mask


def check(out, ref, dtype):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]}"


def check_grads(kernel, reference, args, dtype=jnp.float32):
    """Gradients of <out, cotangent> through the kernel at `args` (of `dtype`) vs XLA's autodiff of the dense
    reference at full precision, at the same inputs in float32, within `dtype`'s tolerance."""
    cot = jnp.asarray(np.random.default_rng(1).standard_normal(args[0].shape), jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * cot)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        want = jax.grad(loss(reference), argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float32) for x in args))
    got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(*args)
    for g, w in zip(got, want):
        check(g, np.asarray(w, np.float64), dtype)


def test_triton_backend_runs_on_this_jax():
    """Records whether Pallas's Triton backend still compiles and runs on this JAX (deprecated in 0.11);
    where it does not, `impl="auto"` falls back to XLA (test below)."""
    assert _backend.triton_unavailable() is None, (
        f"JAX {jax.__version__}: Pallas's Triton backend does not run: {_backend.triton_unavailable()}"
    )
    assert dispatch.resolve_impl("auto") == "pallas"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_flash_attention_chunk_against_a_cache(dtype):
    """A 512-token prefill chunk at positions 1,000.. over a 2,048-slot cache of which 1,400 / 1,512 are
    filled (ragged key blocks), forward and gradients."""
    needs_triton()
    q, k, v = inputs(2, 512, 2048, 16, 4, 128, dtype)
    q_offset, kv_len = np.array([888, 1000]), np.array([1400, 1512])
    fn = jax.jit(
        lambda q, k, v: flash_attention(
            q, k, v, causal=True, q_offset=jnp.asarray(q_offset), kv_len=jnp.asarray(kv_len)
        )
    )
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    check(fn(*args), attention_f64(q, k, v, positions_mask(512, 2048, q_offset, kv_len)), dtype)
    if dtype == jnp.float32:
        check_grads(
            fn,
            lambda q, k, v: dispatch.flash_attention(
                q, k, v, q_offset=jnp.asarray(q_offset), kv_len=jnp.asarray(kv_len), impl="reference"
            ),
            args,
        )


@pytest.mark.parametrize("seq_q", [1, 2048], ids=["decode", "chunk"])
def test_flash_attention_over_keys_at_explicit_positions(seq_q):
    """A streaming head's ring (sink 64 + recent 256, shuffled positions, some slots empty) followed by the
    chunk's own keys, bf16, through the dispatch on "pallas" (the flash kernel's k_positions operand)."""
    needs_triton()
    ring, B = 320, 2
    S = ring + seq_q
    q, k, v = inputs(B, seq_q, S, 32, 8, 128, jnp.bfloat16)
    rng = np.random.default_rng(2)
    q_offset = np.array([5000, 700])
    positions = np.stack([rng.permutation(np.arange(o - ring, o)) for o in q_offset])
    positions[1, rng.choice(ring, 100, replace=False)] = -1
    positions = np.concatenate([positions, q_offset[:, None] + np.arange(seq_q)], axis=1).astype(np.int32)
    spec = MaskSpec(
        jnp.asarray(q_offset[:, None] + np.arange(seq_q), jnp.int32),
        jnp.full((B,), S, jnp.int32),
        jnp.asarray(positions),
    )
    out = jax.jit(lambda q, k, v: dispatch.attend(q, k, v, spec, impl="pallas"))(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    )
    mask = (positions[:, None, :] >= 0) & (positions[:, None, :] <= (q_offset[:, None] + np.arange(seq_q))[:, :, None])
    check(out, attention_f64(q, k, v, mask), jnp.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_lambda_attention_streaming_heads(dtype):
    """Λ over 3,000 tokens (not a multiple of any block) with sink 100, recent 300: forward and gradients."""
    needs_triton()
    T, sink, recent = 3000, 100, 300
    q, k, v = inputs(1, T, T, 16, 4, 128, dtype)
    fn = jax.jit(lambda q, k, v: lambda_attention(q, k, v, sink=sink, recent=recent))
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    check(fn(*args), attention_f64(q, k, v, positions_mask(T, T, 0, T, sink, recent)), dtype)
    if dtype == jnp.float32:
        check_grads(
            fn, lambda q, k, v: dispatch.lambda_attention(q, k, v, sink=sink, recent=recent, impl="reference"), args
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_decode_attention_split_k(dtype):
    """One query per sequence over 4,224 slots (33 blocks of 128 in 16 ragged splits), lengths full, 1, 0
    and mid-block."""
    needs_triton()
    lengths = np.array([4224, 1, 0, 3001])
    q, k, v = inputs(4, 1, 4224, 32, 8, 128, dtype)
    fn = jax.jit(lambda q, k, v, n: decode_attention(q, k, v, n, block_k=128, num_splits=16))
    out = fn(*(jnp.asarray(x, dtype) for x in (q[:, 0], k, v)), jnp.asarray(lengths, jnp.int32))
    check(out[:, None], attention_f64(q, k, v, positions_mask(1, 4224, lengths - 1, lengths)), dtype)
    assert bool(jnp.all(out[2] == 0))


@pytest.mark.parametrize("routed", [False, True], ids=["caches_order", "models_order"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_duo_decode_attention_both_partitions(dtype, routed):
    """DuoAttention's one-launch decode: 2 retrieval KV heads over 4,224 slots (lengths full, 1, mid-block) and
    6 streaming heads over a ring of sink 64 + recent 256 (full, partly filled, empty) plus the new token; heads in
    the caches' order, or (routed) in the model's order with the heads routed in the kernel's index maps and the
    new token written into the ring (slots 5, 77, past the ring) by the kernel."""
    from pallas_kernels import duo_decode_attention

    needs_triton()
    lengths, ring_lengths = np.array([4224, 1, 3001]), np.array([320, 77, 0])
    q, k, v = inputs(3, 1, 4224, 32, 2, 128, dtype)
    _, ring_k, ring_v = inputs(3, 1, 321, 32, 6, 128, dtype, seed=1)  # slot 320: the new token
    retrieval = attention_f64(q[:, :, :8], k, v, positions_mask(1, 4224, lengths - 1, lengths))
    seen = (np.arange(321)[None, :] < ring_lengths[:, None]) | (np.arange(321)[None, :] == 320)
    streaming = attention_f64(q[:, :, 8:], ring_k, ring_v, seen[:, None, :])
    expected = np.concatenate([retrieval, streaming], axis=2)
    k_new, v_new, rows, extra = ring_k[:, 320], ring_v[:, 320], np.arange(32), {}
    if routed:  # model head m sits at slot[m] of the caches' order
        order = (5, 1, 0, 2, 3, 4, 6, 7)
        slot = np.argsort(order)
        rows = (slot[:, None] * 4 + np.arange(4)).reshape(-1)
        k_new, v_new = (
            np.where(slot[None, :, None] >= 2, x[:, np.maximum(slot - 2, 0)], np.nan) for x in (k_new, v_new)
        )
        extra = dict(kv_order=order, ring_slots=jnp.asarray([5, 77, 320], jnp.int32))
    fn = jax.jit(lambda *a: duo_decode_attention(*a, num_splits=64, **extra))
    out = fn(
        *(jnp.asarray(x, dtype) for x in (q[:, 0, rows], k, v)),
        jnp.asarray(lengths, jnp.int32),
        *(jnp.asarray(x[:, :320], dtype) for x in (ring_k, ring_v)),
        jnp.asarray(ring_lengths, jnp.int32),
        *(jnp.asarray(x, dtype) for x in (k_new, v_new)),
    )
    if routed:
        out, rings = out[0], out[1:]
        for ring, written in zip((ring_k, ring_v), rings):
            want = np.array(jnp.asarray(ring[:, :320], dtype).astype(jnp.float32))
            want[0, 5], want[1, 77] = ring[0, 320], ring[1, 320]  # sequence 2's slot is past the ring
            np.testing.assert_array_equal(np.asarray(jnp.asarray(written).astype(jnp.float32)), want)
    check(out[:, None], expected[:, :, rows], dtype)


def test_mosaic_gpu_duo_decode_both_partitions():
    """DuoAttention's decode step in Pallas Mosaic GPU (no Triton), bf16: 2 retrieval KV heads over 4,224 slots
    (lengths full, 1, mid-tile) holding the new token, 6 streaming heads over a ring of sink 64 + recent 256 (full,
    partly filled, empty) plus the new token, heads in the model's order routed by the kernel."""
    from pallas_kernels.mosaic_gpu import duo_decode_attention

    dtype = jnp.bfloat16
    lengths, ring_lengths = np.array([4224, 1, 3001]), np.array([320, 77, 0])
    q, k, v = inputs(3, 1, 4224, 32, 2, 128, dtype)
    _, ring_k, ring_v = inputs(3, 1, 321, 32, 6, 128, dtype, seed=1)  # slot 320: the new token
    retrieval = attention_f64(q[:, :, :8], k, v, positions_mask(1, 4224, lengths - 1, lengths))
    seen = (np.arange(321)[None, :] < ring_lengths[:, None]) | (np.arange(321)[None, :] == 320)
    expected = np.concatenate([retrieval, attention_f64(q[:, :, 8:], ring_k, ring_v, seen[:, None, :])], axis=2)
    order = (5, 1, 0, 2, 3, 4, 6, 7)  # model head m sits at slot[m] of the caches' order
    slot = np.argsort(order)
    rows = (slot[:, None] * 4 + np.arange(4)).reshape(-1)
    k_new, v_new = (
        np.where(slot[None, :, None] >= 2, x[:, np.maximum(slot - 2, 0), :], np.nan)
        for x in (ring_k[:, 320], ring_v[:, 320])
    )
    fn = jax.jit(lambda *a: duo_decode_attention(*a, kv_order=order, num_splits=64))
    out = fn(
        *(jnp.asarray(x, dtype) for x in (q[:, 0, rows], k, v)),
        jnp.asarray(lengths, jnp.int32),
        *(jnp.asarray(x[:, :320], dtype) for x in (ring_k, ring_v)),
        jnp.asarray(ring_lengths, jnp.int32),
        *(jnp.asarray(x, dtype) for x in (k_new, v_new)),
    )
    check(out[:, None], expected[:, :, rows], dtype)


def test_engine_decode_step_on_mosaic_gpu_matches_cudnn(monkeypatch):
    """One bf16 decode step of the engine from the same cache (two sequences, 200 and 77 tokens, prefilled through
    cuDNN) with impl="mosaic" (each mixed layer in the Mosaic GPU kernel, whose calls the test counts) and with
    impl="cudnn". Tolerance: two correct bf16 attention paths differ by 2.6% of the largest logit here (the XLA path
    vs the dense reference, measured on CPU); a head routed to the wrong cache differs by over 100%."""
    import duo_jax
    import pallas_kernels.mosaic_gpu
    from duo_jax.cache import make_layout
    from duo_jax.engine import Engine
    from duo_jax.methods import DuoAttention
    from tests.conftest import tiny_config

    calls = []
    kernel = pallas_kernels.mosaic_gpu.duo_decode_attention
    monkeypatch.setattr(
        pallas_kernels.mosaic_gpu, "duo_decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    config = tiny_config(num_layers=3, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=128, vocab_size=512)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), duo_jax.init_params(config, jax.random.key(0), scale=0.2))
    retrieval = np.array([[1, 0], [0, 1], [0, 0]], bool)  # two mixed layers, one all streaming
    method = DuoAttention(make_layout(config, retrieval, sink=16, recent=48, context=256))
    engine = Engine(params, config)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 200)).astype(np.int32)
    _, cache, lengths = engine.prefill(method, tokens, np.asarray([200, 77]), chunk=64, impl="cudnn")
    logits = {
        impl: np.asarray(engine.step(method, jax.tree.map(jnp.copy, cache), lengths, jnp.asarray([3, 4]), impl=impl)[0])
        for impl in ("mosaic", "cudnn")
    }
    assert len(calls) == 2  # traced once per mixed layer
    assert np.abs(logits["mosaic"] - logits["cudnn"]).max() <= 0.1 * np.abs(logits["cudnn"]).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_duo_prefill_attention_both_partitions(dtype):
    """DuoAttention's one-launch prefill chunk at Llama-3-8B's head shapes: 3 retrieval KV heads over a cache of
    4,096 slots and 5 streaming heads over a ring of sink 64 + recent 256 then the chunk, heads routed from the
    model's order; a chunk of 1,024 (ragged: 1,024 and 700 real tokens) at offsets 2,000 and 0 (the ring empty)."""
    from pallas_kernels import duo_prefill_attention
    from tests.test_duo_prefill import _case_inputs, _reference

    needs_triton()
    B, T, C, R, order, n, G, D = 2, 1024, 4096, 320, (5, 0, 7, 1, 2, 3, 4, 6), 3, 4, 128
    offsets, n_valid, filled = (2000, 0), (1024, 700), (320, 0)
    q, k, v, wk, wv, positions = _case_inputs(B, T, C, R, order, n, G, D, offsets, n_valid, filled)
    q = 3.0 * q  # a peaked softmax: a key wrongly seen or missed moves the output past the tolerance
    q, k, v, wk, wv = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v, wk, wv))
    kv_len = np.asarray(offsets) + np.asarray(n_valid)
    fn = jax.jit(
        lambda q, k, v, wk, wv, pos, off, kv: duo_prefill_attention(
            q, k, v, wk, wv, pos, kv_order=order, q_offset=off, kv_len=kv
        )
    )
    out = fn(
        *(jnp.asarray(x, dtype) for x in (q, k, v, wk, wv)),
        jnp.asarray(positions),
        jnp.asarray(offsets, jnp.int32),
        jnp.asarray(kv_len, jnp.int32),
    )
    ref = _reference(q, k, v, wk, wv, positions, order, n, offsets, kv_len)
    valid = np.arange(T)[None, :] < np.asarray(n_valid)[:, None]  # padding rows are never read
    check(np.asarray(jnp.asarray(out).astype(jnp.float32))[valid], ref[valid], dtype)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_kernels_over_a_quantized_cache(kind):
    """The flash kernel's forward (a 256-token chunk at positions 1,000.. over a 1,536-slot cache, ragged lengths)
    and the split-K decode kernel (lengths full, 1, 0, mid-block) reading int8 / packed int4 codes and bf16 scales,
    bf16 queries, against float64 attention over the dequantized values (independent numpy unpacking)."""
    from duo_jax.quant import quantize_kv
    from tests.test_quantized_kernels import numpy_dequantize

    needs_triton()
    dtype = jnp.bfloat16
    q, k, v = inputs(4, 256, 1536, 16, 4, 128, dtype)
    qk, qv = (quantize_kv(jnp.asarray(x, dtype), kind) for x in (k, v))
    k, v = (numpy_dequantize(x.codes, x.scale, kind) for x in (qk, qv))
    codes = (qk.codes, qv.codes)
    scales = dict(k_scale=qk.scale, v_scale=qv.scale, kv_quant=kind)
    q_offset, kv_len = np.array([1000, 1100, 0, 888]), np.array([1256, 1536, 0, 1144])
    prefill = jax.jit(lambda q, kc, vc, o, n: flash_attention(q, kc, vc, q_offset=o, kv_len=n, **scales))
    out = prefill(jnp.asarray(q, dtype), *codes, jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_len, jnp.int32))
    check(out, attention_f64(q, k, v, positions_mask(256, 1536, q_offset, kv_len)), dtype)
    lengths = np.array([1536, 1, 0, 1001])
    decode = jax.jit(lambda q, kc, vc, n: decode_attention(q, kc, vc, n, **scales))
    out = decode(jnp.asarray(q[:, 0], dtype), *codes, jnp.asarray(lengths, jnp.int32))
    check(out[:, None], attention_f64(q[:, :1], k, v, positions_mask(1, 1536, lengths - 1, lengths)), dtype)
    assert bool(jnp.all(out[2] == 0))


def paged(k, v, page_size, seed=0):
    """The caches k / v [B, S, K, E] moved into pages of a shuffled pool [K, N, P, E] (3 more pages than
    needed, holding stale values): (k_pages, v_pages, block_tables [B, S / P])."""
    rng = np.random.default_rng(seed)
    B, S, K, E = k.shape
    M = S // page_size
    N = B * M + 3
    tables = rng.permutation(N)[: B * M].reshape(B, M).astype(np.int32)
    pools = []
    for x in (k, v):
        pool = rng.standard_normal((K, N, page_size, E))
        for b in range(B):
            pool[:, tables[b]] = np.moveaxis(x[b].reshape(M, page_size, K, E), 2, 0)
        pools.append(pool)
    return pools[0], pools[1], tables


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_paged_decode_attention(dtype, S=4224, page_size=16, lengths=(4224, 1, 0, 3001)):
    """One query per sequence over 264 pages of 16 per sequence in a shuffled pool (33 blocks of 8 pages in 11
    splits of 3 blocks), lengths full, 1, 0 and mid-page."""
    needs_triton()
    lengths = np.array(lengths)
    q, k, v = inputs(len(lengths), 1, S, 32, 8, 128, dtype)
    kp, vp, tables = paged(k, v, page_size)
    fn = jax.jit(lambda q, kp, vp, t, n: paged_decode_attention(q, kp, vp, t, n, block_k=128, num_splits=16))
    out = fn(*(jnp.asarray(x, dtype) for x in (q[:, 0], kp, vp)), jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))
    check(out[:, None], attention_f64(q, k, v, positions_mask(1, S, lengths - 1, lengths)), dtype)
    assert bool(jnp.all(out[2] == 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_paged_flash_attention_chunk(dtype, T=512, S=2048, page_size=16, q_offset=(888, 1000), kv_len=(1400, 1512)):
    """A 512-token prefill chunk at positions 1,000.. over 128 pages of 16 per sequence in a shuffled pool, of
    which 1,400 / 1,512 tokens are filled (ragged key blocks)."""
    needs_triton()
    q_offset, kv_len = np.array(q_offset), np.array(kv_len)
    q, k, v = inputs(2, T, S, 16, 4, 128, dtype)
    kp, vp, tables = paged(k, v, page_size)
    fn = jax.jit(
        lambda q, kp, vp, t: paged_flash_attention(
            q, kp, vp, t, q_offset=jnp.asarray(q_offset), kv_len=jnp.asarray(kv_len)
        )
    )
    out = fn(*(jnp.asarray(x, dtype) for x in (q, kp, vp)), jnp.asarray(tables))
    check(out, attention_f64(q, k, v, positions_mask(T, S, q_offset, kv_len)), dtype)


def test_cudnn_prefill_chunk_and_decode():
    """A 1,024-token chunk through cuDNN (bf16, GQA 4:1, head_dim 128) at offsets 2,000 and 0 (a first chunk, 700
    real tokens) over a cache of 4,096: the prefix and the chunk's own keys in two cuDNN calls, merged by their
    log-sum-exps, a decode step, and a streaming head's ring followed by a chunk and by a decode step's own key,
    against float64. Skipped, with the probe's reason, where cuDNN attention does not run."""
    from duo_jax.attention import cudnn

    reason = cudnn.unavailable()
    if reason is not None:
        pytest.skip(f"cuDNN attention does not run here: {reason}")
    offsets, n_valid = np.array([2000, 0]), np.array([1024, 700])
    q, k, v = inputs(2, 1024, 4096, 32, 8, 128, jnp.bfloat16)
    spec = dispatch.prefix_spec(
        2, 1024, q_offset=jnp.asarray(offsets), kv_len=jnp.asarray(offsets + n_valid), num_keys=4096
    )
    out = jax.jit(cudnn.attention)(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), spec)
    want = attention_f64(q, k, v, positions_mask(1024, 4096, offsets, offsets + n_valid))
    valid = np.arange(1024)[None, :] < n_valid[:, None]
    check(np.asarray(out.astype(jnp.float32))[valid], want[valid], jnp.bfloat16)
    # a decode step (one call, a padding mask): lengths full, 1 and mid-block
    lengths = np.array([4096, 1, 3001])
    q, k, v = inputs(3, 1, 4096, 32, 8, 128, jnp.bfloat16, seed=1)
    spec = dispatch.prefix_spec(3, 1, q_offset=jnp.asarray(lengths - 1), kv_len=jnp.asarray(lengths), num_keys=4096)
    out = jax.jit(cudnn.attention)(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), spec)
    check(out, attention_f64(q, k, v, positions_mask(1, 4096, lengths - 1, lengths)), jnp.bfloat16)
    # a streaming head's ring of sink 64 + recent 256 (full, wrapped; and empty) followed by a chunk of 1,024
    q, k, v = inputs(2, 1024, 320 + 1024, 32, 8, 128, jnp.bfloat16, seed=2)
    offsets = np.array([5000, 0])
    positions = np.full((2, 320 + 1024), -1, np.int32)
    positions[0, :320] = np.r_[0:64, 4744:5000]
    positions[:, 320:] = offsets[:, None] + np.arange(1024)
    q_positions = jnp.asarray(offsets[:, None] + np.arange(1024), jnp.int32)
    spec = MaskSpec(q_positions, jnp.full((2,), 1344, jnp.int32), jnp.asarray(positions), own_keys_at=320)
    out = jax.jit(cudnn.attention)(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), spec)
    seen = (positions[:, None, :] >= 0) & (positions[:, None, :] <= np.asarray(q_positions)[:, :, None])
    check(out, attention_f64(q, k, v, seen), jnp.bfloat16)
    # a decode step over the ring (full and wrapped, partly filled, empty) and its own key: one call
    q, k, v = inputs(3, 1, 321, 32, 8, 128, jnp.bfloat16, seed=3)
    offsets = np.array([5000, 100, 0])
    positions = np.full((3, 321), -1, np.int32)
    positions[0, :320] = np.r_[0:64, 4744:5000]
    positions[1, :100] = np.arange(100)
    positions[:, 320] = offsets
    spec = MaskSpec(jnp.asarray(offsets[:, None], jnp.int32), jnp.full((3,), 321, jnp.int32), jnp.asarray(positions),
                    own_keys_at=320)  # fmt: skip
    assert len(cudnn.calls(q, k, v, spec)) == 1
    out = jax.jit(cudnn.attention)(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), spec)
    check(out, attention_f64(q, k, v, (positions >= 0)[:, None, :]), jnp.bfloat16)


@pytest.mark.parametrize(
    "sink, offsets", [(None, None), (64, None), (64, (0, 200, 1024))], ids=["causal", "lambda", "lambda_at_offsets"]
)
def test_cudnn_gate_training_forward_and_gradients(sink, offsets):
    """Gate training's attention without Triton: a whole 2,048-token sequence (bf16, GQA 4:1, head_dim 128), causal
    (one cuDNN call) or Λ with sink 64 and recent 256 (cuDNN's sliding window and a call over the sinks, merged), or
    Λ for a shard's 1,024 queries at offsets over the 2,048 keys (all-gather sequence parallelism: four calls), forward
    against float64 and gradients through cuDNN's backward given the merged statistics against the dense reference's
    in float32 at the same inputs. Skipped, with the probe's reason, where that backward (or Λ's calls) does not
    run."""
    from duo_jax.attention import cudnn

    at_offset = offsets is not None
    reason = cudnn.gradient_unavailable() if sink is None else cudnn.lambda_unavailable(at_offset)
    if reason is not None:
        pytest.skip(f"cuDNN attention's gradient{'' if sink is None else ' (Λ)'} does not run here: {reason}")
    S, recent = 2048, None if sink is None else 256
    T, q_offset = (1024, np.asarray(offsets)) if at_offset else (S, 0)
    q, k, v = inputs(len(offsets) if at_offset else 1, T, S, 32, 8, 128, jnp.bfloat16, seed=3)
    spec = dispatch.prefix_spec(
        q.shape[0], T, q_offset=jnp.asarray(q_offset) if at_offset else 0, num_keys=S, sink=sink, recent=recent
    )
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    check(
        jax.jit(cudnn.attention)(*args, spec),
        attention_f64(q, k, v, positions_mask(T, S, q_offset, S, sink, recent)),
        jnp.bfloat16,
    )
    check_grads(
        lambda q, k, v: cudnn.attention(q, k, v, spec),
        lambda q, k, v: dispatch.attend(q, k, v, spec, impl="reference"),
        args,
        jnp.bfloat16,
    )


def test_cudnn_sliding_window_chunk_and_decode():
    """A sliding window of 1,024 through cuDNN (bf16, GQA 4:1, head_dim 128): 1,024-token chunks at offsets 0, 700 and
    3,000 of a 4,096-slot cache (its own keys' window, the window's keys before it in reverse order) and decode steps
    near the start, mid-cache and at the end (the window's slots gathered), against float64; skipped, with the probe's
    reason, where the window's calls do not run."""
    from duo_jax.attention import cudnn

    reason = cudnn.window_unavailable()
    if reason is not None:
        pytest.skip(f"a sliding window through cuDNN does not run here: {reason}")
    S, T, W = 4096, 1024, 1024
    for queries, offsets in ((T, np.asarray([0, 700, 3000])), (1, np.asarray([5, 1500, 4095]))):
        q, k, v = inputs(3, queries, S, 32, 8, 128, jnp.bfloat16, seed=4)
        kv_len = offsets + queries
        spec = dispatch.prefix_spec(3, queries, q_offset=jnp.asarray(offsets), kv_len=jnp.asarray(kv_len), num_keys=S,
                                    window=W)  # fmt: skip
        p = offsets[:, None, None] + np.arange(queries)[None, :, None]
        mask = positions_mask(queries, S, offsets, kv_len) & (p - np.arange(S)[None, None, :] < W)
        out = jax.jit(cudnn.attention)(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), spec)
        check(out, attention_f64(q, k, v, mask), jnp.bfloat16)


def test_cudnn_chunk_over_int4_codes(monkeypatch):
    """A prefill chunk over an int4 cache through cuDNN (a GPU without Triton runs it so): 1,024-token chunks at
    offsets 0, 700 and 3,000 of a 4,096-slot cache, the prefix dequantized in segments (2,048 slots here), against
    float64 over the dequantized values."""
    from duo_jax.attention import cudnn
    from duo_jax.quant import quantize_kv

    reason = cudnn.unavailable()
    if reason is not None:
        pytest.skip(f"cuDNN attention does not run here: {reason}")
    S, T = 4096, 1024
    offsets = np.asarray([0, 700, 3000])
    q, k, v = inputs(3, T, S, 32, 8, 128, jnp.bfloat16, seed=5)
    codes = [quantize_kv(jnp.asarray(x, jnp.bfloat16), "int4") for x in (k, v)]
    values = [np.asarray(x.dequantize().astype(jnp.float32), np.float64) for x in codes]
    spec = dispatch.prefix_spec(3, T, q_offset=jnp.asarray(offsets), kv_len=jnp.asarray(offsets + T), num_keys=S)
    monkeypatch.setattr(cudnn, "PREFIX_SEGMENT", 2048)
    out = jax.jit(cudnn.attention)(jnp.asarray(q, jnp.bfloat16), *codes, spec)
    check(out, attention_f64(q, *values, positions_mask(T, S, offsets, offsets + T)), jnp.bfloat16)


def test_cudnn_shard_partials_merge_into_the_whole_attention():
    """The retrieval cache split in 4 shards of 1,024 slots (a generation mesh's `model` axis): each shard's partial
    through cuDNN (`cudnn.attention_with_lse`, bf16, GQA 4:1, head_dim 128) for 512-token chunks at offsets 0, 1,500
    and 3,584 (before, across and after shards), merged as `sharding.merge_partials` does, against float64."""
    from duo_jax.attention import cudnn
    from duo_jax.attention.masks import MaskSpec

    reason = cudnn.unavailable()
    if reason is not None:
        pytest.skip(f"cuDNN attention does not run here: {reason}")
    C, S, T = 4096, 1024, 512
    offsets = np.asarray([0, 1500, 3584])
    q, k, v = inputs(3, T, C, 32, 8, 128, jnp.bfloat16, seed=6)
    q16, k16, v16 = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    outs, lses = [], []
    for first in range(0, C, S):
        spec = MaskSpec(
            jnp.asarray(offsets[:, None] + np.arange(T)[None, :] - first, jnp.int32),
            jnp.asarray(np.clip(offsets + T - first, 0, S), jnp.int32),
        )
        out, lse = jax.jit(cudnn.attention_with_lse)(q16, k16[:, first : first + S], v16[:, first : first + S], spec)
        outs.append(np.asarray(out.astype(jnp.float32), np.float64))
        lses.append(np.asarray(lse, np.float64))
    lse = np.stack(lses)
    weight = np.exp(lse - lse.max(0))
    merged = (np.stack(outs) * weight[..., None]).sum(0) / weight.sum(0)[..., None]
    check(merged, attention_f64(q, k, v, positions_mask(T, C, offsets, offsets + T)), jnp.bfloat16)


def test_cudnn_paged_chunk_and_decode():
    """The caches of the test above in a shuffled pool of 64-token pages (and 3 stale pages): a 1,024-token chunk at
    offsets 2,000 and 0 (700 real tokens) and a decode step (lengths full, 1 and mid-page) through cuDNN's paged
    attention (`duo_jax.attention.cudnn.paged_prefix`: each KV head a sequence of its own, one call per sequence
    here as the pool's 131 pages do not split between two), against float64. Skipped, with the probe's reason,
    where cuDNN's paged attention does not run."""
    from duo_jax.attention import cudnn
    from duo_jax.attention.pages import PagedKV

    reason = cudnn.paged_unavailable(64, 128, 4, jnp.bfloat16)
    if reason is not None:
        pytest.skip(f"cuDNN paged attention does not run here: {reason}")
    offsets, n_valid = np.array([2000, 0]), np.array([1024, 700])
    q, k, v = inputs(2, 1024, 4096, 32, 8, 128, jnp.bfloat16)
    kp, vp, tables = paged(k, v, 64)
    pages = [PagedKV(jnp.asarray(x, jnp.bfloat16), jnp.asarray(tables)) for x in (kp, vp)]
    spec = dispatch.prefix_spec(
        2, 1024, q_offset=jnp.asarray(offsets), kv_len=jnp.asarray(offsets + n_valid), num_keys=4096
    )
    out = jax.jit(cudnn.attention)(jnp.asarray(q, jnp.bfloat16), *pages, spec)
    want = attention_f64(q, k, v, positions_mask(1024, 4096, offsets, offsets + n_valid))
    valid = np.arange(1024)[None, :] < n_valid[:, None]
    check(np.asarray(out.astype(jnp.float32))[valid], want[valid], jnp.bfloat16)
    lengths = np.array([4096, 1, 3001])
    q, k, v = inputs(3, 1, 4096, 32, 8, 128, jnp.bfloat16, seed=1)
    kp, vp, tables = paged(k, v, 64, seed=1)
    pages = [PagedKV(jnp.asarray(x, jnp.bfloat16), jnp.asarray(tables)) for x in (kp, vp)]
    spec = dispatch.prefix_spec(3, 1, q_offset=jnp.asarray(lengths - 1), kv_len=jnp.asarray(lengths), num_keys=4096)
    out = jax.jit(cudnn.attention)(jnp.asarray(q, jnp.bfloat16), *pages, spec)
    check(out, attention_f64(q, k, v, positions_mask(1, 4096, lengths - 1, lengths)), jnp.bfloat16)


@pytest.mark.parametrize("method", ["full", "duo", "paged_duo"])
def test_engine_on_the_kernels_matches_the_reference(method):
    """Chunked prefill (chunks of 64 over a 200-token prompt) and 16 decode steps through the Pallas kernels
    vs the dense reference, teacher-forced on the same tokens, fp32 (paged_duo: duo with its retrieval heads in
    pages of 16, read by the paged kernels)."""
    needs_triton()
    logits = {impl: _engine_logits(method, impl) for impl in ("pallas", "reference")}
    ref = logits["reference"]
    assert np.abs(logits["pallas"] - ref).max() <= 5e-3 * np.abs(ref).max()


def test_auto_falls_back_to_xla_where_triton_fails(monkeypatch):
    """With the Triton probe failing, "auto" runs the engine on the XLA path, warns once, and gives the
    reference's logits."""
    monkeypatch.setattr(_backend, "triton_unavailable", lambda: "simulated: Triton backend removed")
    dispatch._triton_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="XLA path"):
        auto = _engine_logits("duo", "auto")
    dispatch._triton_fallback.cache_clear()
    ref = _engine_logits("duo", "reference")
    assert np.abs(auto - ref).max() <= 5e-3 * np.abs(ref).max()


def _engine_logits(method_name, impl):
    import duo_jax
    from duo_jax.cache import make_layout
    from duo_jax.methods import DuoAttention, make_method
    from tests.conftest import run_method, tiny_config

    config = tiny_config(
        num_layers=3,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        vocab_size=512,
        max_position_embeddings=1024,
    )
    params = duo_jax.init_params(config, jax.random.key(0), scale=0.2)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, 200).tolist()
    force = np.random.default_rng(1).integers(0, config.vocab_size, 16)
    if method_name in ("duo", "paged_duo"):  # layer 0: head 0 retrieval, layer 1: head 1, layer 2: none
        retrieval = np.array([[1, 0], [0, 1], [0, 0]], bool)
        method = DuoAttention(make_layout(config, retrieval, sink=16, recent=32, context=256))
        if method_name == "paged_duo":
            from duo_jax.methods.paged import paged

            method = paged(method, page_size=16)
    else:
        method = make_method(method_name, config, context=256)
    _, logits, _, _ = run_method(params, config, method, prompt, chunk=64, decode_steps=16, impl=impl, force=force)
    return logits

"""TPU kernels (splash attention and own Mosaic kernels) in TPU interpret mode on CPU.

Every kernel against the dense jnp references of `pallas_kernels.reference` and, for the forward
pass, a float64 numpy attention with an explicit mask. Static offsets (Python ints) run splash
attention, traced ones the own scalar-prefetch kernel; `test_dispatch` checks which is which.
The export tests lower each kernel for TPU from this CPU host.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import _backend, reference, tpu
from pallas_kernels.tpu.launches import pallas_launches
from tests.conftest import random_attention_inputs, random_decode_inputs, rel_err


def numpy_attention(q, k, v, mask, scale=None):
    """float64 masked softmax attention; q [B, T, Hq, D], k/v [B, S, Hkv, D], mask [B, T, S]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    mask = np.broadcast_to(np.asarray(mask)[:, None], s.shape)
    s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    p /= np.maximum(p.sum(axis=-1, keepdims=True), 1e-300)
    return np.einsum("bhts,bshd->bthd", p, v)


def check_forward_and_grad(kernel, ref, mask, q, k, v, cotangent):
    """Forward vs the jnp and float64 references, gradients vs the jnp one; returns the output.
    One jax.vjp each: the forward checked is the one whose residuals the backward kernels read (a
    second, residual-free forward would cost another interpret-mode kernel build), and the jnp
    reference runs jitted (op by op it costs as much CPU as the interpreted kernel)."""
    out, vjp = jax.vjp(kernel, q, k, v)
    ref_out, ref_vjp = jax.vjp(jax.jit(ref), q, k, v)
    assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))
    assert rel_err(out, ref_out) <= 1e-5
    assert rel_err(out, numpy_attention(q, k, v, mask)) <= 1e-5
    grads = vjp(cotangent)
    ref_grads = ref_vjp(cotangent)
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        assert g.shape == g_ref.shape, name
        assert bool(jnp.all(jnp.isfinite(g))), name
        assert rel_err(g, g_ref) <= 1e-4, name
    return out


def as_arg(x, traced):
    """A Python int (static: splash) or an int32 array passed through jit (traced: own kernel)."""
    return jnp.asarray(x, jnp.int32) if traced else x


FLASH_CASES = {
    # name: (batch, T, S, Hq, Hkv, D, causal, q_offset, kv_len, traced)
    "splash_gqa4_ragged": (2, 200, 200, 8, 2, 64, True, 0, None, False),
    "splash_q_offset_mha_d128": (1, 72, 200, 2, 2, 128, True, 128, None, False),
    "own_per_sequence_offsets_and_len0": (2, 200, 300, 4, 1, 64, True, (100, 30), (0, 250), True),
    "own_non_causal_mha_d128": (1, 72, 200, 2, 2, 128, False, 0, 150, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", FLASH_CASES.values(), ids=FLASH_CASES.keys())
def test_flash_attention(case):
    batch, seq_q, seq_k, hq, hkv, head_dim, causal, q_offset, kv_len, traced = case
    q, k, v, cotangent = random_attention_inputs(batch, seq_q, seq_k, hq, hkv, head_dim)
    q_offset, kv_len = as_arg(q_offset, traced), None if kv_len is None else as_arg(kv_len, traced)

    def kernel(q, k, v):
        call = lambda q, k, v, q_offset, kv_len: tpu.flash_attention(  # noqa: E731
            q, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len
        )
        if traced:  # q_offset and kv_len enter the jit as arrays.
            return jax.jit(call)(q, k, v, q_offset, kv_len)
        return call(q, k, v, q_offset, kv_len)

    def ref(q, k, v):
        return reference.flash_attention_reference(q, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len)

    if causal:
        mask = reference.causal_mask(seq_q, seq_k, q_offset, kv_len)
    else:
        mask = jnp.arange(seq_k)[None, None, :] < jnp.reshape(jnp.asarray(kv_len), (-1, 1, 1))
    mask = np.broadcast_to(np.asarray(mask), (batch, seq_q, seq_k))
    out = check_forward_and_grad(kernel, ref, mask, q, k, v, cotangent)
    if traced and causal:  # kv_len 0: sequence 0 sees nothing, its output is exactly zero.
        assert bool(jnp.all(out[0] == 0.0))


LAMBDA_CASES = {
    # name: (batch, T, S, Hq, Hkv, D, sink, recent, q_offset, traced)
    "splash_gqa4_ragged": (1, 300, 300, 4, 1, 64, 8, 40, 0, False),
    "splash_sink0_recent_ge_T_d128": (2, 200, 200, 2, 2, 128, 0, 256, 0, False),
    "splash_q_offset": (1, 100, 300, 4, 2, 64, 16, 64, 200, False),
    # Padded query rows 249..255 (T = 200 -> 256) see no key: they must not poison the gradients.
    "splash_sink0_empty_padded_rows": (1, 200, 200, 2, 1, 64, 0, 50, 0, False),
    "own_per_sequence_q_offset_gqa4": (2, 100, 300, 4, 1, 64, 8, 40, (200, 130), True),
    "own_sink0_mha_d128": (1, 200, 200, 2, 2, 128, 0, 50, 0, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", LAMBDA_CASES.values(), ids=LAMBDA_CASES.keys())
def test_lambda_attention(case):
    batch, seq_q, seq_k, hq, hkv, head_dim, sink, recent, q_offset, traced = case
    q, k, v, cotangent = random_attention_inputs(batch, seq_q, seq_k, hq, hkv, head_dim)
    q_offset = as_arg(q_offset, traced)

    def kernel(q, k, v):
        call = lambda q, k, v, q_offset: tpu.lambda_attention(  # noqa: E731
            q, k, v, sink=sink, recent=recent, q_offset=q_offset
        )
        return jax.jit(call)(q, k, v, q_offset) if traced else call(q, k, v, q_offset)

    def ref(q, k, v):
        return reference.lambda_attention_reference(q, k, v, sink=sink, recent=recent, q_offset=q_offset)

    mask = reference.lambda_mask(seq_q, seq_k, sink=sink, recent=recent, q_offset=q_offset)
    mask = np.broadcast_to(np.asarray(mask), (batch, seq_q, seq_k))
    check_forward_and_grad(kernel, ref, mask, q, k, v, cotangent)


@pytest.mark.slow
@pytest.mark.parametrize("traced", [False, True], ids=["splash", "own"])
def test_lambda_skipped_blocks_are_never_read(traced):
    # Queries at positions 384..511, sink 8, recent 64: keys 128..255 are outside every window, so
    # that 128-key block must be skipped. NaN values there would poison any visit (p * v = 0 * NaN)
    # in the forward pass and in the dq / dk / dv kernels.
    q, k, v, cotangent = random_attention_inputs(1, 128, 512, 2, 1, 64)
    v = v.at[:, 128:256].set(jnp.nan)
    q_offset = as_arg(384, traced)

    def loss(q, k, v, q_offset):
        out = tpu.lambda_attention(q, k, v, sink=8, recent=64, q_offset=q_offset)
        return jnp.sum(out * cotangent)

    if traced:
        loss = jax.jit(loss)
    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, q_offset)
    assert bool(jnp.isfinite(value))
    for g in grads:
        assert bool(jnp.all(jnp.isfinite(g[:, :128]))) and bool(jnp.all(jnp.isfinite(g[:, 256:])))


def ring_and_chunk_positions(lengths, ring: int, sink: int, chunk: int, rng):
    """Key positions [B, ring + chunk] of a streaming head: a ring of `ring` slots holding, for a sequence
    of length L, the sinks and the most recent tokens in shuffled slots (-1: empty), then the chunk at
    positions L ... L + chunk - 1."""
    rows = []
    for length in lengths:
        held = [p for p in range(length) if p < sink or p >= length - (ring - sink)]
        slots = np.full(ring, -1)
        slots[rng.permutation(ring)[: len(held)]] = held
        rows.append(np.concatenate([slots, length + np.arange(chunk)]))
    return np.asarray(rows, np.int32)


@pytest.mark.slow
def test_attention_over_keys_at_explicit_positions():
    """The own kernel's position operands (DuoAttention's streaming heads: ring + chunk): a query at
    position p sees slot s iff 0 <= k_positions[b, s] <= p. Two 128-key blocks, per-sequence positions
    (a full ring and a partly empty one), queries out of order too; forward and gradients.
    (Decode steps over a real ring: `test_engine_with_mosaic_kernels_matches_xla`.)"""
    lengths, chunk = (300, 10), 24
    rng = np.random.default_rng(0)
    q, k, v, cotangent = random_attention_inputs(2, chunk, 200 + chunk, 2, 1, 64)
    k_pos = ring_and_chunk_positions(lengths, 200, 4, chunk, rng)
    q_pos = k_pos[:, 200:].copy()
    q_pos[1] = rng.permutation(q_pos[1])  # the dispatch's specs have consecutive queries; the kernel need not
    mask = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
    attn = jax.jit(lambda q, k, v, q_pos, k_pos: tpu.flash_attention(q, k, v, q_positions=q_pos, k_positions=k_pos))
    (launch,) = pallas_launches(attn, q, k, v, q_pos, k_pos)
    assert launch["grid"] == [2, 2, 1, 2] and launch["blocks"][3:5] == [[None, 128, 1], [None, 1, 128]]

    def kernel(q, k, v):
        return attn(q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos))

    def ref(q, k, v):
        return reference.attention_reference(q, k, v, jnp.asarray(mask))

    check_forward_and_grad(kernel, ref, mask, q, k, v, cotangent)
    with pytest.raises(ValueError, match="k_positions must be int32"):
        tpu.flash_attention(q, k, v, k_positions=jnp.asarray(k_pos[:, :-1]))
    with pytest.raises(ValueError, match="q_positions goes with k_positions"):
        tpu.flash_attention(q, k, v, q_positions=jnp.asarray(q_pos))


DECODE_CASES = {
    # name: (S, Hq, Hkv, D, lengths, num_splits)
    "gqa4_ragged_splits": (300, 8, 2, 64, (300, 1, 0, 157), 2),
    "mha_d128_more_splits_than_blocks": (256, 2, 2, 128, (256, 129), 16),
    "gqa4_single_split": (200, 4, 1, 64, (0, 200), 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode_attention(case):
    seq_k, hq, hkv, head_dim, lengths, num_splits = case
    lengths = jnp.asarray(lengths, jnp.int32)
    q, k, v = random_decode_inputs(len(lengths), seq_k, hq, hkv, head_dim)
    # NaN in whole blocks past each sequence's length: they must be skipped, not read.
    past = (jnp.arange(seq_k) // 128 * 128)[None, :] >= lengths[:, None]  # block starts at/past len
    v = jnp.where(past[:, :, None, None], jnp.nan, v)
    kernel = jax.jit(lambda q, k, v, lengths: tpu.decode_attention(q, k, v, lengths, num_splits=num_splits))
    out = kernel(q, k, v, lengths)
    assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))
    assert rel_err(out, reference.decode_attention_reference(q, k, jnp.nan_to_num(v), lengths)) <= 1e-5
    mask = np.arange(seq_k)[None, None, :] < np.asarray(lengths)[:, None, None]
    expected = numpy_attention(q[:, None], k, np.nan_to_num(np.asarray(v)), mask)[:, 0]
    assert rel_err(out, expected) <= 1e-5
    assert bool(jnp.all(jnp.where((lengths == 0)[:, None, None], out == 0.0, True)))


@pytest.mark.slow
def test_bfloat16_forward():
    q, k, v, _ = random_attention_inputs(2, 200, 200, 4, 2, 64)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    lengths = jnp.array([200, 77], jnp.int32)
    outs = {
        "splash": (
            tpu.lambda_attention(q, k, v, sink=4, recent=64),
            reference.lambda_attention_reference(q, k, v, sink=4, recent=64),
        ),
        "own": (
            jax.jit(tpu.flash_attention)(q, k, v, q_offset=jnp.zeros((2,), jnp.int32)),
            reference.flash_attention_reference(q, k, v),
        ),
        "decode": (
            tpu.decode_attention(q[:, -1], k, v, lengths),
            reference.decode_attention_reference(q[:, -1], k, v, lengths),
        ),
    }
    for name, (out, ref) in outs.items():
        assert out.dtype == jnp.bfloat16, name
        assert rel_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= 2e-2, name


def test_static_steps_cover_every_schedule():
    """The own kernel's inner grid axes are static bounds; no block schedule may be longer."""
    from pallas_kernels import _common
    from pallas_kernels.tpu.block_sparse import _Config

    rng = np.random.default_rng(0)
    for _ in range(40):  # 40 shapes and windows, each with 64 (q_offset, kv_len) pairs at once
        block_q, block_k = (int(b) for b in rng.choice([128, 256, 512], 2))
        seq_q, seq_k = (int(n) for n in rng.integers(1, 2000, 2))
        sink = int(rng.choice([0, int(rng.integers(1, 600))]))
        recent = int(rng.integers(1, 1500))
        window = (
            dict(causal=True, sink=sink, recent=recent)
            if rng.random() < 0.7
            else dict(causal=bool(rng.random() < 0.5), sink=None, recent=None)
        )
        cfg = _Config(seq_q=seq_q, scale=1.0, block_q=block_q, block_k=block_k, group=1, interpret=True, **window)
        num_q, num_k = -(-seq_q // block_q), -(-seq_k // block_k)
        q_offset = jnp.asarray(rng.integers(-50, 2000, (64, 1)), jnp.int32)
        kv_len = jnp.asarray(rng.integers(0, seq_k + 1, (64, 1)), jnp.int32)
        blocks = jnp.arange(16)[None]  # a fixed shape (eager ops compile once); T, S < 2048
        sink_end, band_start, end = _common.kv_block_schedule(
            blocks, q_offset=q_offset, kv_len=kv_len, seq_q=seq_q, block_q=block_q, block_k=block_k, **window
        )
        count = jnp.where(blocks < num_q, sink_end + end - band_start, 0)
        assert int(jnp.max(count)) <= cfg.kv_steps(num_k), cfg
        start, stop = _common.q_block_schedule(
            blocks, q_offset=q_offset, kv_len=kv_len, num_q_blocks=num_q, block_q=block_q, block_k=block_k, **window
        )
        count = jnp.where(blocks < num_k, stop - start, 0)
        assert int(jnp.max(count)) <= cfg.q_steps(num_q), cfg


def test_splash_mask_tiles_equal_the_mask_function():
    """DuoMask answers all-visible and all-hidden tiles from their corners; every tile must still
    equal the mask function evaluated on it (1 x 1 tiles test the corner rules at every point)."""
    from pallas_kernels.tpu.splash import DuoMask

    for causal, sink, recent in ((True, None, None), (False, None, None), (True, 0, 9), (True, 5, 17)):
        for q_offset, kv_len in ((0, 96), (13, 70), (40, 0)):
            mask = DuoMask((64, 96), q_offset=q_offset, kv_len=kv_len, causal=causal, sink=sink, recent=recent)
            for block_q, block_k in ((1, 1), (2, 2), (2, 3), (3, 5), (16, 32)):
                for q0 in range(0, 64, block_q):
                    for k0 in range(0, 96, block_k):
                        rows, cols = slice(q0, min(q0 + block_q, 64)), slice(k0, min(k0 + block_k, 96))
                        expected = mask.mask_function(
                            np.arange(rows.start, rows.stop)[:, None], np.arange(cols.start, cols.stop)[None, :]
                        )
                        assert np.array_equal(mask[rows, cols], expected), (mask.params, rows, cols)


def test_interpret_argument():
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.tpu import _mosaic

    assert isinstance(_mosaic.interpret_mode(None), pltpu.InterpretParams)  # CPU: TPU interpret mode
    assert _mosaic.interpret_mode(True) is True and _mosaic.interpret_mode(False) is False
    with _backend.lowering_for("tpu"):
        assert _mosaic.interpret_mode(None) is False  # compiled with Mosaic


@pytest.mark.slow
@pytest.mark.parametrize("traced", [False, True], ids=["splash", "own"])
def test_generic_interpreter_under_remat(traced):
    """interpret=True (JAX's generic interpreter) runs under jax.checkpoint, as gate training needs;
    TPU interpret mode's callbacks cannot be rematerialised."""
    q, k, v, cotangent = random_attention_inputs(1, 200, 200, 4, 2, 64)
    q_offset = as_arg(0, traced)

    def loss(attn):
        return lambda q, k, v: jnp.sum(jax.checkpoint(attn)(q, k, v) * cotangent)

    def kernel(q, k, v):
        return tpu.lambda_attention(q, k, v, sink=4, recent=64, q_offset=q_offset, interpret=True)

    def ref(q, k, v):
        return reference.lambda_attention_reference(q, k, v, sink=4, recent=64)

    grads = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
    for g, g_ref in zip(grads, jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)):
        assert rel_err(g, g_ref) <= 1e-4


def test_dispatch():
    """Static masks run splash; traced offsets, per-sequence lengths and empty rows the own kernel."""
    q, k, v, _ = random_attention_inputs(2, 64, 64, 2, 1, 64)

    def names(fn):
        return {
            "splash"
            if launch["name"].startswith("splash_")
            else "own"
            if launch["name"].startswith("tpu_block_sparse_")
            else launch["name"]
            for launch in pallas_launches(fn, q, k, v)
        }

    assert names(lambda q, k, v: tpu.flash_attention(q, k, v)) == {"splash"}
    assert names(lambda q, k, v: tpu.lambda_attention(q, k, v, sink=4, recent=16)) == {"splash"}
    own = {"own"}
    assert names(lambda q, k, v: tpu.flash_attention(q, k, v, q_offset=jnp.int32(0))) == own
    assert names(lambda q, k, v: tpu.flash_attention(q, k, v, kv_len=jnp.array([3, 64]))) == own
    assert names(lambda q, k, v: tpu.flash_attention(q, k, v, kv_len=0)) == own  # empty rows
    # Λ without sinks whose last queries lie past the keys' reach: rows with no key.
    assert names(lambda q, k, v: tpu.lambda_attention(q, k, v, sink=0, recent=4, q_offset=64)) == own


def test_rejects_bad_arguments():
    q, k, v, _ = random_attention_inputs(1, 16, 16, 3, 2, 64)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        tpu.flash_attention(q, k, v)
    q, k, v, _ = random_attention_inputs(1, 16, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 128"):
        tpu.flash_attention(q, k, v, block_k=64)
    with pytest.raises(ValueError, match="recent"):
        tpu.lambda_attention(q, k, v, sink=4, recent=0)
    with pytest.raises(ValueError, match=r"\[B, Hq, D\]"):
        tpu.decode_attention(q, k, v, jnp.array([4]))
    with pytest.raises(ValueError, match="block_k"):
        tpu.decode_attention(q[:, 0], k, v, jnp.array([4]), block_k=100)


# ---------------------------------------------------------------- lowering for TPU from this host

T, S, HQ, HKV, D = 384, 640, 8, 2, 128  # T != S: any [T, S] tensor in the module is dense attention


def _export(fn, *args):
    with _backend.lowering_for("tpu"):
        return export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module(), pallas_launches(fn, *args)


def _assert_mosaic_only(module: str, launches: list[dict], count: int):
    assert module.count("stablehlo.custom_call @tpu_custom_call") == count
    assert len(launches) == count
    for dims in (f"{T}x{S}x", f"{S}x{T}x", f"x{T}x{S}>", f"x{S}x{T}>"):
        assert dims not in module, f"a dense [T, S] tensor ({dims}) left outside the kernels"
    for launch in launches:
        for block in launch["blocks"]:  # TPU tiling: last dim whole or a lane multiple.
            assert block[-1] in (1, D, 128) or block[-1] % 128 == 0, (launch["name"], block)


def _vjp(attn):
    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(out)

    return fwd_bwd


@pytest.mark.parametrize("kind", ["splash_lambda", "splash_causal", "own_lambda", "own_causal"])
def test_export_prefill_lowers_to_mosaic(kind):
    q = jax.ShapeDtypeStruct((1, T, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, S, HKV, D), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((1,), jnp.int32)
    if kind.startswith("splash"):
        q_offset = S - T  # static: splash

        def attn(q, k, v):
            if kind == "splash_lambda":
                return tpu.lambda_attention(q, k, v, sink=64, recent=128, q_offset=q_offset)
            return tpu.flash_attention(q, k, v, q_offset=q_offset)

        module, launches = _export(_vjp(attn), q, kv, kv)
    else:

        def step(q, k, v, q_offset):
            if kind == "own_lambda":
                attn = lambda q, k, v: tpu.lambda_attention(  # noqa: E731
                    q, k, v, sink=64, recent=128, q_offset=q_offset
                )
            else:
                attn = lambda q, k, v: tpu.flash_attention(  # noqa: E731
                    q, k, v, q_offset=q_offset, kv_len=q_offset + T
                )
            return _vjp(attn)(q, k, v)

        module, launches = _export(step, q, kv, kv, offsets)
    _assert_mosaic_only(module, launches, count=3)  # forward, dq, dk/dv
    assert all(launch["scalar_prefetch"] >= 1 for launch in launches)
    grids = [launch["grid"] for launch in launches]
    if kind == "own_lambda":  # (B, Hq, query blocks, KV steps): 1 sink block + a 3-block band at most
        assert grids == [[1, HQ, 3, 4], [1, HQ, 3, 4], [1, HQ, 5, 3]]
    elif kind == "own_causal":  # every one of the 5 KV blocks may be visited
        assert grids == [[1, HQ, 3, 5], [1, HQ, 3, 5], [1, HQ, 5, 3]]
    else:  # (B * Hq, query blocks, KV steps): splash shrinks the KV axis to the widest row of tiles
        assert grids[0][:2] == [HQ, 3] and grids[0][2] == (3 if kind == "splash_lambda" else 5)


def test_export_decode_lowers_to_mosaic():
    q = jax.ShapeDtypeStruct((4, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, S, HKV, D), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    module, launches = _export(
        lambda q, k, v, lengths: tpu.decode_attention(q, k, v, lengths, num_splits=2), q, kv, kv, lengths
    )
    _assert_mosaic_only(module, launches, count=1)
    (launch,) = launches
    assert launch["grid"] == [4, 2, 3]  # batch, splits, blocks per split (640 keys / 128)
    assert launch["blocks"][1] == [None, 128, HKV * D]  # one [block_k, Hkv * D] cache tile


@pytest.mark.slow
def test_benchmark_records_tpu_export(tmp_path, capsys):
    import importlib
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    kernels = importlib.import_module("kernels")
    out = tmp_path / "tpu_export.json"
    kernels.main(
        [
            "--tpu-export",
            "--seq-lens",
            "512",
            "--num-heads",
            "4",
            "--num-kv-heads",
            "2",
            "--head-dim",
            "128",
            "--sink",
            "16",
            "--recent",
            "64",
            "--chunk",
            "128",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["tpu_export"]
    calls = {row["kernel"]: row["tpu_custom_calls"] for row in rows}
    assert calls == {
        "lambda splash fwd+bwd": 3,
        "causal splash fwd+bwd": 3,
        "lambda own (traced q_offset) fwd+bwd": 3,
        "causal own chunk of 128 vs cache fwd": 1,
        "decode own fwd": 1,
        "streaming own chunk of 128 vs ring of 80 fwd": 1,
        "streaming own decode step vs ring of 80 fwd": 1,
    }
    decode = next(row for row in rows if row["kernel"] == "decode own fwd")["launches"][0]
    assert decode["grid"] == [1, 4, 1]  # 512 keys: 4 splits of one 128-key block
    streaming = next(row for row in rows if row["kernel"].startswith("streaming own decode"))["launches"][0]
    assert streaming["grid"] == [1, 4, 1, 1]  # batch, heads, one query block, the one 128-key block (81 keys)
    assert streaming["blocks"][3:5] == [[None, 128, 1], [None, 1, 128]]  # query positions, key positions
    assert "tpu_decode_attention_split" in capsys.readouterr().out

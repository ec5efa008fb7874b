"""The decode and prefill (flash) kernels over a quantized KV cache (int8 / int4 codes + bf16 scales,
`duo_jax.quant`): the GPU kernels in the Pallas interpreter, the TPU kernels in TPU interpret mode, each against a
float64 numpy attention over values dequantized here with numpy (an unpacker independent of the code's); the
dispatch that hands them codes; and all lowered from this host (Triton for CUDA, Mosaic for TPU) without a
dequantized copy of the cache outside the kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from duo_jax import attention
from duo_jax.attention import MaskSpec
from duo_jax.quant import quantize_kv
from pallas_kernels import tpu
from tests.conftest import random_attention_inputs, random_decode_inputs, rel_err
from tests.test_backend import TRITON, cuda_module
from tests.test_tpu_kernels import _export, numpy_attention


def numpy_dequantize(codes, scale, kind) -> np.ndarray:
    """float64 values of int8 codes, or of int4 codes packed as byte j = element j (low nibble) | element j + E/2
    (high nibble), times their scales."""
    c = np.asarray(codes).astype(np.int64)
    if kind == "int4":
        nibble = lambda x: ((x & 0xF) ^ 8) - 8  # noqa: E731  (4-bit two's complement)
        c = np.concatenate([nibble(c), nibble(c >> 4)], axis=-1)
    return c * np.asarray(jnp.asarray(scale, jnp.float32), np.float64)


def quantized_case(kind, batch_lengths, seq_k, hq, hkv, head_dim, seed=0):
    q, k, v = random_decode_inputs(len(batch_lengths), seq_k, hq, hkv, head_dim, seed=seed)
    k = k * jnp.linspace(0.2, 3.0, head_dim)  # uneven channels: the codes' scales differ by token and head
    qk, qv = quantize_kv(k, kind), quantize_kv(v, kind)
    lengths = jnp.asarray(batch_lengths, jnp.int32)
    mask = np.arange(seq_k)[None, None, :] < np.asarray(lengths)[:, None, None]
    expected = numpy_attention(
        q[:, None], numpy_dequantize(qk.codes, qk.scale, kind), numpy_dequantize(qv.codes, qv.scale, kind), mask
    )[:, 0]
    exact = numpy_attention(q[:, None], k, v, mask)[:, 0]
    return q, qk, qv, lengths, expected, exact


CASES = {
    # name: (kernel, kind, S, Hq, Hkv, D, lengths, splits): ragged lengths (full, 1, 0, mid-block), GQA; the GPU
    # kernel with 32-key blocks (a ragged last split, a padded last block), the TPU one with 128-key blocks
    "gpu_int8_gqa": ("gpu", "int8", 300, 4, 2, 16, (300, 1, 0, 157), 4),
    "gpu_int4_mha_d32": ("gpu", "int4", 256, 2, 2, 32, (256, 129), 16),
    "tpu_int8_mha_d32": ("tpu", "int8", 256, 2, 2, 32, (256, 129), 16),
    "tpu_int4_gqa": ("tpu", "int4", 300, 4, 2, 16, (300, 1, 0, 157), 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decode_kernel_reads_codes_and_scales(case):
    kernel, kind, seq_k, hq, hkv, head_dim, lengths, splits = case
    q, qk, qv, lengths, expected, exact = quantized_case(kind, lengths, seq_k, hq, hkv, head_dim)
    if kernel == "gpu":  # the GPU kernel in the Pallas interpreter
        run = lambda q, kc, vc, ks, vs, n: pallas_kernels.decode_attention(  # noqa: E731
            q, kc, vc, n, k_scale=ks, v_scale=vs, kv_quant=kind, block_k=32, num_splits=splits, interpret=True
        )
    else:  # the Mosaic kernel in TPU interpret mode
        run = lambda q, kc, vc, ks, vs, n: tpu.decode_attention(  # noqa: E731
            q, kc, vc, n, k_scale=ks, v_scale=vs, kv_quant=kind, num_splits=splits
        )
    out = jax.jit(run)(q, qk.codes, qv.codes, qk.scale, qv.scale, lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, expected) <= 1e-5
    assert rel_err(out, exact) > 1e-4  # the codes were read: int8 / int4 error, not the exact values
    assert bool(jnp.all(jnp.where((lengths == 0)[:, None, None], out == 0.0, True)))


@pytest.mark.slow
def test_decode_kernels_check_their_cache_arguments():
    q, k, v = random_decode_inputs(2, 64, 4, 2, 16)
    qk, qv, lengths = quantize_kv(k, "int4"), quantize_kv(v, "int4"), jnp.asarray([64, 10], jnp.int32)
    for kernel in (pallas_kernels.decode_attention, tpu.decode_attention):
        with pytest.raises(ValueError, match="needs its scales"):
            kernel(q, qk.codes, qv.codes, lengths, kv_quant="int4")
        with pytest.raises(ValueError, match=r"int8 k codes must be int8 \[B, S, Hkv, 16\]"):
            kernel(q, qk.codes, qv.codes, lengths, k_scale=qk.scale, v_scale=qv.scale, kv_quant="int8")
        with pytest.raises(ValueError, match="are for a quantized cache"):
            kernel(q, qk.dequantize(), qv.dequantize(), lengths, k_scale=qk.scale, v_scale=qv.scale)
        with pytest.raises(ValueError, match="kv_quant must be one of"):
            kernel(q, qk.codes, qv.codes, lengths, k_scale=qk.scale, v_scale=qv.scale, kv_quant="int2")


def prefill_case(kind, seq_q, seq_k, offsets, lengths, seed=0, positions=False):
    """Random q [B, T, 4, 16], a quantized GQA cache (2 KV heads) of S keys, query i of sequence b at offsets[b] + i
    seeing keys j <= its position and j < lengths[b] (a sequence with length 0: rows that see nothing); with
    `positions`, the keys sit at a random permutation of positions instead (a ring of cached tokens), slots
    >= lengths[b] empty. -> (q, codes, values, expected over the dequantized values, over the exact values,
    the kernels' position arguments)."""
    q, k, v, _ = random_attention_inputs(len(offsets), seq_q, seq_k, 4, 2, 16, seed=seed)
    k = k * jnp.linspace(0.2, 3.0, 16)  # uneven channels: the codes' scales differ by token and head
    qk, qv = quantize_kv(k, kind), quantize_kv(v, kind)
    q_pos = np.asarray(offsets)[:, None] + np.arange(seq_q)[None]
    k_pos = np.stack(
        [
            np.random.default_rng(seed + b).permutation(seq_k) if positions else np.arange(seq_k)
            for b in range(len(offsets))
        ]
    )
    filled = np.arange(seq_k)[None, None] < np.asarray(lengths)[:, None, None]
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & filled
    expected = numpy_attention(
        q, numpy_dequantize(qk.codes, qk.scale, kind), numpy_dequantize(qv.codes, qv.scale, kind), mask
    )
    exact = numpy_attention(q, k, v, mask)
    args = dict(q_offset=jnp.asarray(offsets, jnp.int32), kv_len=jnp.asarray(lengths, jnp.int32))
    if positions:
        args.update(q_positions=jnp.asarray(q_pos, jnp.int32), k_positions=jnp.asarray(k_pos, jnp.int32))
    return q, qk, qv, expected, exact, args


PREFILL_CASES = {
    # name: (kernel, kind, T, S, positions): a chunk at a query offset over a longer cache, ragged lengths (whole,
    # mid-block, 0), GQA 4/2; the GPU kernel with 16-query / 32-key blocks (2 query blocks, a padded last key
    # block), the TPU one with 128-row tiles (2 key blocks); and the TPU kernel's keys at explicit positions
    "gpu_int8": ("gpu", "int8", 20, 150, False),
    "gpu_int4": ("gpu", "int4", 20, 150, False),
    "tpu_int8": ("tpu", "int8", 20, 150, False),
    "tpu_int4_positions": ("tpu", "int4", 20, 150, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_prefill_kernel_reads_codes_and_scales(case):
    kernel, kind, seq_q, seq_k, positions = case
    q, qk, qv, expected, exact, args = prefill_case(kind, seq_q, seq_k, (130, 30, 0), (150, 45, 0), positions=positions)
    if kernel == "gpu":  # the GPU kernel in the Pallas interpreter
        run = lambda q, kc, vc, ks, vs, args: pallas_kernels.flash_attention(  # noqa: E731
            q, kc, vc, k_scale=ks, v_scale=vs, kv_quant=kind, block_q=16, block_k=32, interpret=True, **args
        )
    else:  # the Mosaic kernel in TPU interpret mode (traced offsets: the own kernel, never splash)
        run = lambda q, kc, vc, ks, vs, args: tpu.flash_attention(  # noqa: E731
            q, kc, vc, k_scale=ks, v_scale=vs, kv_quant=kind, **args
        )
    out = jax.jit(run)(q, qk.codes, qv.codes, qk.scale, qv.scale, args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, expected) <= 1e-5
    assert rel_err(out, exact) > 1e-4  # the codes were read: int8 / int4 error, not the exact values
    assert bool(jnp.all(out[2] == 0.0))  # a sequence with no keys


def test_prefill_kernels_check_their_cache_arguments():
    q, qk, qv, _, _, args = prefill_case("int4", 4, 64, (60, 10), (64, 14))
    for kernel in (pallas_kernels.flash_attention, tpu.flash_attention):
        with pytest.raises(ValueError, match="needs its scales"):
            kernel(q, qk.codes, qv.codes, kv_quant="int4", **args)
        with pytest.raises(ValueError, match=r"int8 k codes must be int8 \[B, S, Hkv, 16\]"):
            kernel(q, qk.codes, qv.codes, k_scale=qk.scale, v_scale=qv.scale, kv_quant="int8", **args)
        with pytest.raises(ValueError, match="are for a quantized cache"):
            kernel(q, qk.dequantize(), qv.dequantize(), k_scale=qk.scale, v_scale=qv.scale, **args)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_dispatch_hands_a_quantized_cache_to_the_kernels(impl):
    """One query over a contiguous quantized cache runs the decode kernel, a prefill chunk over it the flash
    kernel's forward (each a pallas_call reading int8 codes), also over keys at explicit positions (a streaming
    head's ring: the k_positions operand). Each equals attention over the dequantized values."""
    q, qk, qv, lengths, expected, _ = quantized_case("int4", (256, 70), 256, 4, 2, 16, seed=1)
    decode = MaskSpec(lengths[:, None] - 1, lengths)
    out = attention.attend(q[:, None], qk, qv, decode, impl=impl)[:, 0]
    assert rel_err(out, expected) <= 1e-5
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention.attend(q, k, v, decode, impl=impl))(q[:, None], qk, qv))
    assert "pallas_call" in jaxpr and "decode_attention_split" in jaxpr
    for positions in (False, True):
        q, qk, qv, expected, _, args = prefill_case("int8", 5, 96, (40, 90), (45, 96), seed=3, positions=positions)
        spec = MaskSpec(
            args.get("q_positions", args["q_offset"][:, None] + jnp.arange(5)), args["kv_len"], args.get("k_positions")
        )
        assert rel_err(attention.attend(q, qk, qv, spec, impl=impl), expected) <= 1e-5
        jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention.attend(q, k, v, spec, impl=impl))(q, qk, qv))  # noqa: B023
        assert "block_sparse_attention_fwd" in jaxpr


B, S, HQ, HKV, D = 2, 1024, 8, 2, 128


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_decode_lowers_to_one_kernel_reading_codes(kind):
    """Lowered for CUDA (Triton) and for TPU (Mosaic) from this host: one kernel launch whose operands are the
    int8 codes and bf16 scales, and no dequantized [B, S, Hkv, D] cache anywhere in the module."""
    width = D // 2 if kind == "int4" else D
    q = jax.ShapeDtypeStruct((B, HQ, D), jnp.bfloat16)
    codes = jax.ShapeDtypeStruct((B, S, HKV, width), jnp.int8)
    scales = jax.ShapeDtypeStruct((B, S, HKV, 1), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    dense = f"{B}x{S}x{HKV}x{D}x"
    for kernels, lower in (
        (pallas_kernels, lambda fn, *a: cuda_module(fn, *a)),
        (tpu, lambda fn, *a: _export(fn, *a)[0]),
    ):
        fn = lambda q, kc, vc, ks, vs, n: kernels.decode_attention(  # noqa: E731,B023
            q, kc, vc, n, k_scale=ks, v_scale=vs, kv_quant=kind
        )
        module = lower(fn, q, codes, codes, scales, scales, lengths)
        call = f"custom_call @{TRITON}" if kernels is pallas_kernels else "custom_call @tpu_custom_call"
        assert module.count(call) == 1
        for dtype in ("bf16", "f32"):  # neither the values nor int4's unpacked halves exist outside the kernel
            assert f"{dense}{dtype}" not in module and f"{B}x{S}x{HKV}x{D // 2}x{dtype}" not in module


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_prefill_lowers_to_one_kernel_reading_codes(kind):
    """A prefill chunk (T = 256, traced per-sequence offsets and lengths) over a quantized cache, lowered for CUDA
    (Triton) and for TPU (Mosaic) from this host: one forward kernel launch whose operands are the int8 codes and
    bf16 scales, and no dequantized cache anywhere in the module, in the cache's layout or the TPU kernel's
    heads-major one ([B, Hkv, S, D])."""
    width, chunk = (D // 2 if kind == "int4" else D), 256
    q = jax.ShapeDtypeStruct((B, chunk, HQ, D), jnp.bfloat16)
    codes = jax.ShapeDtypeStruct((B, S, HKV, width), jnp.int8)
    scales = jax.ShapeDtypeStruct((B, S, HKV, 1), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((B,), jnp.int32)
    for kernels, lower in (
        (pallas_kernels, lambda fn, *a: cuda_module(fn, *a)),
        (tpu, lambda fn, *a: _export(fn, *a)[0]),
    ):
        fn = lambda q, kc, vc, ks, vs, o, n: kernels.flash_attention(  # noqa: E731,B023
            q, kc, vc, q_offset=o, kv_len=n, k_scale=ks, v_scale=vs, kv_quant=kind
        )
        module = lower(fn, q, codes, codes, scales, scales, offsets, offsets)
        call = f"custom_call @{TRITON}" if kernels is pallas_kernels else "custom_call @tpu_custom_call"
        assert module.count(call) == 1 and f"{B}x{S}x{HKV}x{width}xi8" in module  # the codes go in
        for dtype in ("bf16", "f32"):
            for half in (D, D // 2):  # the values, or int4's unpacked halves
                assert f"{B}x{S}x{HKV}x{half}x{dtype}" not in module and f"{B}x{HKV}x{S}x{half}x{dtype}" not in module

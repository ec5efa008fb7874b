"""Attention that reads a paged cache in place (`duo_jax.attention.pages.PagedKV`): the GPU paged split-K kernel
in the Pallas interpreter, JAX's TPU paged attention in TPU interpret mode, the blocked XLA path and the
dispatch between them, each against a float64 numpy attention that follows the block tables itself, on pools
whose pages are shuffled and hold stale values; the engine's paged method through the kernels gives the XLA
path's greedy tokens; and the GPU / TPU / CPU lowerings build no gathered [B, C, K, E] copy of the pool."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from duo_jax import attention
from duo_jax.attention import MaskSpec
from duo_jax.attention.pages import PagedKV
from pallas_kernels import tpu
from tests.test_backend import TRITON, cuda_module
from tests.test_tpu_kernels import _export

P, M, N = 4, 6, 23  # pages of 4 tokens, at most 6 per sequence (C = 24 slots), a pool of 23 pages
LENGTHS = [0, 1, 4, 9, 24]  # empty, one token, exactly one page, mid-page, every page full
E = 16


def as_float64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def random_case(hq, hkv, dtype, lengths=LENGTHS, seed=0, e=E):
    """q [B, Hq, E]; a pool [Hkv, N, P, E] of random (stale) values; tables giving each sequence the pages its
    length needs, drawn from a shuffled pool, and "no page" (N) or a random page past its length."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    q = jnp.asarray(rng.standard_normal((B, hq, e)), dtype)
    k_pages = jnp.asarray(rng.standard_normal((hkv, N, P, e)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((hkv, N, P, e)), dtype)
    free = list(rng.permutation(N))
    tables = np.full((B, M), N, np.int32)
    for b, n in enumerate(lengths):
        used = -(-n // P)
        tables[b, :used] = [free.pop() for _ in range(used)]
        tables[b, used:] = rng.choice([N, rng.integers(N)], M - used)  # none, or someone else's page
    return q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)


def numpy_paged_attention(q, k_pages, v_pages, tables, lengths, scale=None):
    """float64: sequence b's slot s is row s % P of page tables[b, s // P]; keys s < lengths[b]; returns the
    output [B, Hq, E] (zeros for length 0) and the log-sum-exp [B, Hq]."""
    q, kp, vp = as_float64(q), as_float64(k_pages), as_float64(v_pages)
    tables, lengths = np.asarray(tables), np.asarray(lengths)
    B, H, D = q.shape
    G = H // kp.shape[0]
    scale = 1 / np.sqrt(D) if scale is None else scale
    out, lse = np.zeros_like(q), np.full((B, H), -np.inf)
    for b in range(B):
        slots = np.arange(lengths[b])
        if not len(slots):
            continue
        pages, rows = tables[b, slots // P], slots % P
        for h in range(H):
            s = kp[h // G, pages, rows] @ q[b, h] * scale
            p = np.exp(s - s.max())
            out[b, h] = p @ vp[h // G, pages, rows] / p.sum()
            lse[b, h] = s.max() + np.log(p.sum())
    return out, lse


def check_close(out, ref, dtype):
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: the output's own rounding
    assert out.shape == ref.shape and bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(as_float64(out), ref, rtol=0, atol=tol * np.abs(ref).max())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2), (2, 2)], ids=["gqa2", "gqa3", "mha"])
def test_gpu_paged_kernel_matches_float64(hq, hkv, dtype):
    """Blocks of 2 pages, 2 splits (a table padded to whole splits): ragged lengths 0 / 1 / a page boundary /
    mid-page / full, and the log-sum-exp for merging shards."""
    q, kp, vp, tables, lengths = random_case(hq, hkv, dtype)
    out, lse = pallas_kernels.paged_decode_attention(
        q, kp, vp, tables, lengths, block_k=8, num_splits=2, return_lse=True
    )
    ref, ref_lse = numpy_paged_attention(q, kp, vp, tables, lengths)
    check_close(out, ref, dtype)
    assert out.dtype == dtype
    filled = np.asarray(lengths) > 0
    np.testing.assert_allclose(np.asarray(lse)[filled], ref_lse[filled], rtol=0, atol=1e-4)
    assert np.all(np.asarray(lse)[~filled] < -1e30)


def test_gpu_paged_kernel_single_split_and_large_blocks():
    """One split holding every page, one block of 8 pages (past M: padded entries read page 0, masked)."""
    q, kp, vp, tables, lengths = random_case(4, 2, jnp.float32, seed=1)
    out = pallas_kernels.paged_decode_attention(q, kp, vp, tables, lengths, block_k=32, num_splits=1)
    check_close(out, numpy_paged_attention(q, kp, vp, tables, lengths)[0], jnp.float32)


@pytest.mark.slow
def test_tpu_paged_kernel_matches_float64():
    """JAX's TPU paged attention in TPU interpret mode: a bf16 pool exactly (up to bf16 output rounding); an
    fp32 pool at bf16 precision, as its docstring says (it rounds K and V tiles to bf16), which is why the
    dispatch gives it bf16 pools only."""
    q, kp, vp, tables, lengths = random_case(4, 2, jnp.bfloat16, seed=2)
    out = tpu.paged_decode_attention(q, kp, vp, tables, lengths, block_k=8)
    check_close(out, numpy_paged_attention(q, kp, vp, tables, lengths)[0], jnp.bfloat16)
    q, kp, vp, tables, lengths = random_case(4, 2, jnp.float32, seed=2)
    out = tpu.paged_decode_attention(q, kp, vp, tables, lengths, block_k=8)
    as_bf16 = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    check_close(out, numpy_paged_attention(q, as_bf16(kp), as_bf16(vp), tables, lengths)[0], jnp.float32)


def decode_spec(lengths):
    """One query per sequence at position lengths - 1 over its lengths slots."""
    return MaskSpec(jnp.maximum(lengths - 1, 0)[:, None], lengths)


@pytest.mark.slow
@pytest.mark.parametrize(
    "impl,dtype", [("pallas", jnp.float32), ("mosaic", jnp.bfloat16), ("xla", jnp.float32), ("reference", jnp.float32)]
)
def test_dispatch_reads_pages_for_decode(impl, dtype, monkeypatch):
    """`attend` over PagedKV: each impl's path (the kernel it names, checked by counting calls) gives float64
    (head dim 128: what JAX's TPU kernel needs)."""
    calls = []
    for module in (pallas_kernels, tpu):
        kernel = module.paged_decode_attention
        monkeypatch.setattr(
            module, "paged_decode_attention", lambda *a, _k=kernel, **kw: calls.append(1) or _k(*a, **kw)
        )
    q, kp, vp, tables, lengths = random_case(4, 2, dtype, seed=3, e=128)
    out = attention.attend(q[:, None], PagedKV(kp, tables), PagedKV(vp, tables), decode_spec(lengths), impl=impl)
    check_close(out[:, 0], numpy_paged_attention(q, kp, vp, tables, lengths)[0], dtype)
    assert len(calls) == (impl in ("pallas", "mosaic"))


@pytest.mark.parametrize(
    "impl,page_size,dtype",
    [("pallas", 3, jnp.float32), ("mosaic", 4, jnp.float32), ("mosaic", 4, jnp.bfloat16)],
    ids=["pallas-p3", "mosaic-fp32", "mosaic-e16"],
)
def test_dispatch_takes_the_xla_path_where_a_kernel_cannot_serve(impl, page_size, dtype, monkeypatch):
    """A page size Triton cannot tile (3), an fp32 pool on TPU (JAX's kernel would round it to bf16), a head dim
    (16) Mosaic cannot tile: the XLA path, exact."""
    for module in (pallas_kernels, tpu):
        monkeypatch.setattr(module, "paged_decode_attention", lambda *a, **kw: pytest.fail("kernel called"))
    rng = np.random.default_rng(4)
    lengths = jnp.asarray([2, 7, 12], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 4, E)), dtype)
    kp, vp = (jnp.asarray(rng.standard_normal((2, 20, page_size, E)), dtype) for _ in range(2))
    tables = jnp.asarray(rng.permutation(20)[:12].reshape(3, 4), jnp.int32)
    out = attention.attend(q[:, None], PagedKV(kp, tables), PagedKV(vp, tables), decode_spec(lengths), impl=impl)
    q64, k64, v64 = as_float64(q), as_float64(kp), as_float64(vp)
    for b in range(3):  # float64 over the sequence's slots, by hand
        slots = np.arange(int(lengths[b]))
        keys = k64[:, np.asarray(tables)[b, slots // page_size], slots % page_size]  # [K, L, E]
        values = v64[:, np.asarray(tables)[b, slots // page_size], slots % page_size]
        for h in range(4):
            s = keys[h // 2] @ q64[b, h] / np.sqrt(E)
            p = np.exp(s - s.max())
            ref = p @ values[h // 2] / p.sum()
            np.testing.assert_allclose(as_float64(out[b, 0, h]), ref, atol=1e-5 if dtype == jnp.float32 else 2e-2)


def numpy_paged_chunk(q, k_pages, v_pages, tables, q_offset, kv_len):
    """float64 reference for a chunk q [B, T, Hq, E]: query t at q_offset + t sees slots <= its position and
    < kv_len (zeros where it sees none)."""
    q_offset, kv_len = np.asarray(q_offset), np.asarray(kv_len)
    return np.stack(
        [
            numpy_paged_attention(q[:, t], k_pages, v_pages, tables, np.minimum(q_offset + t + 1, kv_len))[0]
            for t in range(q.shape[1])
        ],
        axis=1,
    )


def random_chunk(T, hq, seed):
    """A chunk of T queries per sequence ending at its length (the last sequence's starts mid-page and stops
    at the end of its pages; the first is empty: its queries see nothing)."""
    q, kp, vp, tables, lengths = random_case(hq, 2, jnp.float32, lengths=[0, 5, 9, 24], seed=seed)
    q_offset = jnp.maximum(lengths - T, 0)
    chunk_q = jax.random.normal(jax.random.key(seed), (4, T, hq, E), jnp.float32)
    return chunk_q, kp, vp, tables, q_offset, lengths


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq", [4, 6], ids=["gqa2", "gqa3"])
def test_gpu_paged_flash_kernel_matches_float64(hq, dtype):
    """Chunked prefill over pages: query blocks of 2 (3 per chunk of 5, the last padded), key blocks of 2 pages."""
    q, kp, vp, tables, q_offset, kv_len = random_chunk(5, hq, seed=6)
    q, kp, vp = (x.astype(dtype) for x in (q, kp, vp))
    out = pallas_kernels.paged_flash_attention(
        q, kp, vp, tables, q_offset=q_offset, kv_len=kv_len, block_q=2, block_k=8
    )
    check_close(out, numpy_paged_chunk(q, kp, vp, tables, q_offset, kv_len), dtype)
    assert out.dtype == dtype and not np.asarray(out[0]).any()  # the empty sequence's queries: zeros


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.slow
def test_dispatch_reads_pages_for_a_prefill_chunk(impl, monkeypatch):
    """A chunk over pages: the paged flash kernel for "pallas", the XLA path (one key tile at a time) for
    "xla" (and on TPU, for "mosaic"); both give float64."""
    calls = []
    kernel = pallas_kernels.paged_flash_attention
    monkeypatch.setattr(pallas_kernels, "paged_flash_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    q, kp, vp, tables, q_offset, kv_len = random_chunk(5, 4, seed=7)
    positions = q_offset[:, None] + jnp.arange(5, dtype=jnp.int32)
    out = attention.attend(q, PagedKV(kp, tables), PagedKV(vp, tables), MaskSpec(positions, kv_len), impl=impl)
    np.testing.assert_allclose(
        np.asarray(out), numpy_paged_chunk(q, kp, vp, tables, q_offset, kv_len), rtol=0, atol=1e-5
    )
    assert len(calls) == (impl == "pallas")


# --- lowerings: the pool is read in place ------------------------------------------------------------------

LB, LH, LK, LE, LP, LM, LN = 2, 8, 2, 128, 16, 64, 80  # C = LM * LP = 1024 slots per sequence


def lowering_args(dtype=jnp.bfloat16, T=1):
    return (
        jax.ShapeDtypeStruct((LB, T, LH, LE), dtype),
        jax.ShapeDtypeStruct((LK, LN, LP, LE), dtype),
        jax.ShapeDtypeStruct((LK, LN, LP, LE), dtype),
        jax.ShapeDtypeStruct((LB, LM), jnp.int32),
        jax.ShapeDtypeStruct((LB,), jnp.int32),
    )


def paged_decode(impl):
    def fn(q, kp, vp, tables, lengths):
        spec = decode_spec(lengths)
        if q.shape[1] > 1:  # a chunk ending at each sequence's length
            spec = MaskSpec(lengths[:, None] - q.shape[1] + jnp.arange(q.shape[1], dtype=jnp.int32), lengths)
        return attention.attend(q, PagedKV(kp, tables), PagedKV(vp, tables), spec, impl=impl)

    return fn


def shapes(module: str) -> set[tuple[int, ...]]:
    """Every array shape in a StableHLO (tensor<2x8x64xbf16>) or HLO (bf16[2,8,64]) module."""
    mlir = {
        tuple(int(d) for d in m.split("x")) for m in re.findall(r"tensor<((?:\d+x)+)", module) for m in [m.rstrip("x")]
    }
    hlo = {tuple(int(d) for d in m.split(",")) for m in re.findall(r"[a-z]\d*\[([\d,]+)\]", module)}
    return mlir | hlo


def assert_no_gathered_cache(module: str):
    """No [B, C, K, E] (or head-major [K, B, C, E], or [B, M, P, K, E]) view of the sequences' pages."""
    C = LM * LP
    gathered = {(LB, C, LK, LE), (LK, LB, C, LE), (LB, LM, LP, LK, LE), (LK, LB, LM, LP, LE)}
    found = shapes(module)
    assert (LK, LN, LP, LE) in found  # the pool itself: the parse sees the module's shapes
    assert not gathered & found, f"a gathered copy of the pool {gathered & found} in the module"


@pytest.mark.parametrize(
    "T,name,grid_y",
    [(1, "paged_decode_attention_split", LK), (64, "paged_flash_attention_fwd", LH)],
    ids=["decode", "prefill"],
)
def test_gpu_lowering_reads_pages_in_one_triton_kernel(T, name, grid_y):
    """Decode and a prefill chunk over pages lowered for CUDA from this host: one Triton kernel (grid batch x
    KV heads x splits; batch x query heads x query blocks) whose operands are the pools themselves, and no
    gathered copy of the sequences' pages."""
    module = cuda_module(paged_decode("auto"), *lowering_args(T=T))
    calls = [line for line in module.splitlines() if f"custom_call @{TRITON}" in line]
    assert len(calls) == 1 and name in calls[0]
    assert re.search(rf"grid_x = {LB}\b", calls[0]) and re.search(rf"grid_y = {grid_y}\b", calls[0])
    assert f"tensor<{LK}x{LN}x{LP}x{LE}xbf16>" in calls[0]  # the pool, as it is
    assert_no_gathered_cache(module)


def test_tpu_lowering_reads_pages_in_one_mosaic_kernel():
    module, launches = _export(paged_decode("auto"), *lowering_args())
    assert module.count("stablehlo.custom_call @tpu_custom_call") == 1 and len(launches) == 1
    assert_no_gathered_cache(module)


def test_cpu_xla_path_reads_pages_one_tile_at_a_time():
    """On CPU (and for prefill everywhere) the blocked XLA path gathers key tiles of 512 slots through the
    tables: the compiled decode step holds no [B, C, K, E] view of the pool."""
    hlo = jax.jit(paged_decode("xla")).lower(*lowering_args(jnp.float32)).compile().as_text()
    assert_no_gathered_cache(hlo)
    assert {(LK, LB, 512, LE), (LB, 512, LK, LE)} & shapes(hlo)  # one tile of 512 slots, gathered


def test_bad_paged_inputs_are_named():
    """Shapes that do not fit, and a head dim JAX's TPU kernel cannot tile when compiled for TPU: clear errors."""
    from pallas_kernels import _backend

    q, kp, vp, tables, lengths = random_case(4, 2, jnp.bfloat16, lengths=[3, 5])
    with pytest.raises(ValueError, match="k_pages and v_pages"):
        pallas_kernels.paged_decode_attention(q, kp, vp[:, :, :2], tables, lengths)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        pallas_kernels.paged_decode_attention(q[:, :3], kp, vp, tables, lengths)
    with pytest.raises(ValueError, match="batch"):
        pallas_kernels.paged_flash_attention(q[:1, None], kp, vp, tables, q_offset=0, kv_len=lengths[:1])
    with _backend.lowering_for("tpu"), pytest.raises(ValueError, match="multiple of 128.*impl='xla'"):
        jax.eval_shape(tpu.paged_decode_attention, q, kp, vp, tables, lengths)

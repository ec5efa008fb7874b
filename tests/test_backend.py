"""pallas_kernels._backend, and the GPU path checked without a GPU: every kernel (forward and backward),
lowered for CUDA from this CPU host with `jax.export`, goes through Triton (`__gpu$xla.gpu.triton` custom
calls carrying the kernel's Triton IR) with the compiler params we pass, never through Mosaic GPU.
(Lowering is the part of compilation JAX does; PTX generation happens in XLA on a GPU host.)"""

import re

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from pallas_kernels import _backend

TRITON = "__gpu$xla.gpu.triton"


def cuda_module(fn, *args) -> str:
    """The StableHLO module of jit(fn) exported for CUDA, traced with the kernels set up for a GPU (Triton's and
    cuDNN's custom calls allowed)."""
    calls = (TRITON, "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    with _backend.lowering_for("gpu"):
        exported = jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c) for c in calls],
        )(*args)
    return exported.mlir_module()


def executed(module: str, op: str) -> int:
    """How many times `op` (e.g. "stablehlo.gather") runs in the module's public entry: its own occurrences plus,
    for every call site, the callee's count (JAX lowers some ops, `jnp.take` among them, into private functions
    that the module holds once however often they are called)."""
    bodies = {}
    for chunk in re.split(r"\n\s*func\.func ", "\n" + module)[1:]:
        name = re.match(r"(?:public |private )?@([\w.$-]+)", chunk).group(1)
        bodies[name] = chunk
    counts: dict[str, int] = {}

    def count(name: str) -> int:
        if name not in counts:
            body = bodies[name]
            callees = re.findall(r"(?<!custom_)call @([\w.$-]+)\(", body)
            own = len(re.findall(rf"(?<!#){re.escape(op)}(?!<)", body))  # not an attribute (#stablehlo.gather<...>)
            counts[name] = own + sum(count(callee) for callee in callees)
        return counts[name]

    return count("main")


def triton_kernels(module: str) -> list[dict]:
    """Each Triton custom call's kernel name, grid and compiler params."""
    calls = []
    for line in module.splitlines():
        if f"custom_call @{TRITON}" not in line:
            continue
        field = lambda name: re.search(rf"\b{name} = (\"?[\w.]+\"?)", line).group(1).strip('"')  # noqa: E731
        calls.append(
            dict(
                name=field("name"),
                num_warps=int(field("num_warps")),
                num_stages=int(field("num_stages")),
                grid=tuple(int(field(f"grid_{a}")) for a in "xyz"),
            )
        )
    return calls


def qkv(T, S, Hq, Hkv, D, dtype=jnp.bfloat16):
    return (
        jax.ShapeDtypeStruct((1, T, Hq, D), dtype),
        jax.ShapeDtypeStruct((1, S, Hkv, D), dtype),
        jax.ShapeDtypeStruct((1, S, Hkv, D), dtype),
    )


def loss_grads(attention):
    """q, k, v -> their gradients of sum(attention(q, k, v)^2): the forward and backward kernels."""
    return jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))


@pytest.mark.parametrize("head_dim, warps", [(64, 4), (128, 8)])
def test_flash_attention_lowers_to_triton(head_dim, warps):
    shapes = qkv(200, 200, 8, 2, head_dim)  # GQA 4:1, a length that is not a multiple of the blocks
    forward = triton_kernels(cuda_module(lambda q, k, v: pallas_kernels.flash_attention(q, k, v), *shapes))
    assert len(forward) == 1 and forward[0]["num_warps"] == warps and forward[0]["num_stages"] == 2
    assert forward[0]["grid"] == (1, 8, 2)  # batch, query heads, query tiles of 128
    both = triton_kernels(cuda_module(loss_grads(pallas_kernels.flash_attention), *shapes))
    assert [c["name"] for c in both] == [f"block_sparse_attention_{k}" for k in ("fwd", "dq", "dkv")]
    assert all(call["num_warps"] == warps for call in both)


def test_launch_parameters_reach_every_triton_kernel():
    """num_warps / num_stages (what `benchmarks/kernels.py --sweep` tunes) go to the forward and both backward
    kernels of flash and Λ attention."""
    shapes = qkv(256, 256, 8, 2, 128)
    for attn in (
        pallas_kernels.flash_attention,
        lambda *a, **kw: pallas_kernels.lambda_attention(*a, sink=16, recent=64, **kw),
    ):
        calls = triton_kernels(
            cuda_module(loss_grads(lambda q, k, v: attn(q, k, v, num_warps=4, num_stages=3)), *shapes)
        )
        assert len(calls) == 3 and all((c["num_warps"], c["num_stages"]) == (4, 3) for c in calls)


@pytest.mark.parametrize("dtype, tiles", [(jnp.bfloat16, 2), (jnp.float32, 4)])
def test_fp32_kernels_take_tiles_that_fit_shared_memory(dtype, tiles):
    # 128 x 128 fp32 tiles asked an H100 for 256-320 KiB of shared memory (it has 227): fp32 gets 64 x 64.
    shapes = qkv(256, 256, 8, 2, 128, dtype)
    forward = triton_kernels(cuda_module(lambda q, k, v: pallas_kernels.flash_attention(q, k, v), *shapes))
    assert forward[0]["grid"] == (1, 8, tiles)
    pages = jax.ShapeDtypeStruct((2, 32, 16, 128), dtype)
    paged = lambda q, kp, vp, t: pallas_kernels.paged_flash_attention(q, kp, vp, t, q_offset=0, kv_len=256)  # noqa: E731
    chunk = triton_kernels(cuda_module(paged, shapes[0], pages, pages, jax.ShapeDtypeStruct((1, 16), jnp.int32)))
    assert chunk[0]["grid"] == (1, 8, tiles)
    assert _backend.fit_tiles(128, 128, jnp.float32, interpret=True) == (128, 128)  # interpret mode: as asked


@pytest.mark.parametrize("T", [1, 512])
def test_keys_at_explicit_positions_lower_to_one_triton_kernel(T):
    """A streaming head's decode step (T = 1) and prefill chunk over its ring + chunk (keys at explicit
    positions) through the dispatch on "pallas": one Triton forward kernel, no XLA attention loop."""
    from duo_jax import attention
    from duo_jax.attention.masks import MaskSpec

    S = 320 + T
    q, k, v = qkv(T, S, 8, 2, 128)
    spec = lambda: MaskSpec(
        jnp.full((1, T), 4000, jnp.int32) + jnp.arange(T),
        jnp.full((1,), S, jnp.int32),  # noqa: E731
        jnp.zeros((1, S), jnp.int32),
    )
    module = cuda_module(lambda q, k, v: attention.attend(q, k, v, spec(), impl="pallas"), q, k, v)
    calls = triton_kernels(module)
    assert [c["name"] for c in calls] == ["block_sparse_attention_fwd"]
    assert calls[0]["grid"] == (1, 8, max(1, T // 128))
    assert "stablehlo.while" not in module and "stablehlo.case" not in module


@pytest.mark.parametrize("sink", [0, 64])
def test_lambda_attention_lowers_to_triton(sink):
    shapes = qkv(1000, 1000, 8, 2, 128)
    lam = lambda q, k, v: pallas_kernels.lambda_attention(q, k, v, sink=sink, recent=256)  # noqa: E731
    forward = triton_kernels(cuda_module(lam, *shapes))
    assert len(forward) == 1 and forward[0]["grid"] == (1, 8, 8)  # batch, query heads, 8 query tiles of 128
    both = triton_kernels(cuda_module(loss_grads(lam), *shapes))
    assert [c["name"] for c in both] == [f"block_sparse_attention_{k}" for k in ("fwd", "dq", "dkv")]


def test_decode_attention_lowers_to_triton():
    q = jax.ShapeDtypeStruct((2, 8, 128), jnp.bfloat16)
    k = v = jax.ShapeDtypeStruct((2, 3000, 2, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    calls = triton_kernels(cuda_module(lambda *a: pallas_kernels.decode_attention(*a, num_splits=16), q, k, v, lengths))
    assert len(calls) == 1 and calls[0]["name"] == "decode_attention_split"
    assert calls[0]["grid"][:2] == (2, 2)  # one program per sequence, KV head and split of the cache


@pytest.mark.parametrize("capacity", [2176, 4224])  # 17 and 33 blocks of 128: prime-ish, no divisor up to 16
def test_decode_gets_many_splits_at_any_capacity(capacity):
    """The engine's decode (through the dispatch) gives one sequence at least 8 programs per KV head, and
    does not pad the cache to whole splits (no copy of the cache per step)."""
    from duo_jax import attention

    q = jax.ShapeDtypeStruct((1, 32, 128), jnp.bfloat16)
    k = v = jax.ShapeDtypeStruct((1, capacity, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    module = cuda_module(lambda *a: attention.decode_attention(*a, impl="pallas"), q, k, v, lengths)
    calls = triton_kernels(module)
    assert len(calls) == 1 and calls[0]["grid"][:2] == (1, 8) and calls[0]["grid"][2] >= 8
    assert not [line for line in module.splitlines() if "stablehlo.pad" in line and f"x{capacity}x" in line]


@pytest.mark.parametrize("kv_heads, splits", [(8, 16), (2, 64), (1, 64)])
def test_decode_with_few_heads_gets_more_splits(kv_heads, splits):
    """About 128 programs whatever the heads (a DuoAttention layer's few retrieval heads filled only half an
    H100's SMs at 16 splits), capped by the cache's 64 blocks of 128."""
    from duo_jax import attention

    q = jax.ShapeDtypeStruct((1, 4 * kv_heads, 128), jnp.bfloat16)
    k = v = jax.ShapeDtypeStruct((1, 8192, kv_heads, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    calls = triton_kernels(cuda_module(lambda *a: attention.decode_attention(*a, impl="pallas"), q, k, v, lengths))
    assert calls[0]["grid"] == (1, kv_heads, splits)


def test_the_gpu_path_is_chosen_by_the_platform():
    """Traced for the local CPU the kernels run in interpret mode: plain HLO, no Triton call, no Mosaic."""
    shapes = qkv(128, 128, 4, 2, 64, jnp.float32)
    local = jax.jit(lambda q, k, v: pallas_kernels.flash_attention(q, k, v)).lower(*shapes).as_text()
    assert TRITON not in local and "mosaic" not in local.lower()
    gpu = cuda_module(lambda q, k, v: pallas_kernels.flash_attention(q, k, v), *shapes)
    assert TRITON in gpu and "mosaic" not in gpu.lower()
    assert _backend.backend() == "cpu"  # restored after the context
    with pytest.raises(ValueError, match="platform"):
        with _backend.lowering_for("cuda"):
            pass

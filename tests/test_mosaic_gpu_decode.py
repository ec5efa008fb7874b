"""DuoAttention's decode step in Pallas Mosaic GPU (`pallas_kernels.mosaic_gpu`): its values in Mosaic GPU's
interpreter against float64 numpy, and its lowering for CUDA (Mosaic GPU's own, run on this host)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mosaic_gpu import duo_decode_attention
from tests.conftest import rel_err
from tests.mosaic_gpu_interpret import installed
from tests.test_duo_decode import _inputs, _reference

CASES = {
    # name: (B, C, S, order, G, D, lengths, ring_lengths, block_k, num_splits, stages)
    # heads routed (retrieval 2 and 0, streaming 4, 1, 3), ragged lengths, an empty sequence, a ring of one tile
    # (fewer than the stages)
    "routed_ragged": (3, 256, 64, (2, 0, 4, 1, 3), 4, 64, (256, 23, 0), (64, 5, 0), 64, 2, 2),
    # more splits than a short sequence fills, tiles of 128, a ring of five 64-slot tiles, slots refilled
    "many_splits": (2, 512, 320, (1, 3, 0, 2), 2, 128, (70, 512), (320, 130), 128, 4, 2),
}


def _in_the_models_order(order, n, x, B, D):
    """[B, K_s, D] streaming-head rows (the caches' order) -> [B, K, D] in the model's order, NaN on the retrieval
    heads (which the kernel must not read)."""
    slot = np.argsort(order)
    rows = np.full((B, len(order), D), np.nan, np.float32)
    streaming = [m for m in range(len(order)) if slot[m] >= n]
    rows[:, streaming] = np.asarray(x, np.float32)[:, [slot[m] - n for m in streaming]]
    return jnp.asarray(rows, x.dtype)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_float64_in_the_interpreter(case):
    B, C, S, order, G, D, lengths, ring_lengths, block_k, num_splits, stages = case
    n = 2
    q, k, v, ring_k, ring_v, k_new, v_new = (
        x.astype(jnp.bfloat16) for x in _inputs(B, C, S, n, len(order) - n, G, D, seed=3)
    )
    lengths, ring_lengths = np.asarray(lengths, np.int32), np.asarray(ring_lengths, np.int32)
    expected = _reference(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_new, v_new)  # the caches' order
    rows = (np.argsort(order)[:, None] * G + np.arange(G)).reshape(-1)  # each model head's rows there
    with installed() as interpret:
        out = jax.jit(
            lambda *a: duo_decode_attention(
                *a, kv_order=order, block_k=block_k, num_splits=num_splits, stages=stages, interpret=interpret
            )
        )(
            q[:, rows],
            k,
            v,
            lengths,
            ring_k,
            ring_v,
            ring_lengths,
            *(_in_the_models_order(order, n, x, B, D) for x in (k_new, v_new)),
        )
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    assert rel_err(out.astype(jnp.float32), expected[:, rows]) <= 1e-2  # bf16 inputs and probabilities
    empty = np.repeat(np.argsort(order) < n, G)[None, :] & (lengths[:, None] == 0)  # model-order rows
    assert bool(jnp.all(jnp.where(empty[..., None], out == 0, True)))  # a retrieval head with no key: zeros


def _abstract(B, C, S, n, K, G, D, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    lengths = sds((B,), jnp.int32)
    return (
        sds((B, K * G, D), dtype),
        sds((B, C, n, D), dtype),
        sds((B, C, n, D), dtype),
        lengths,
        sds((B, S, K - n, D), dtype),
        sds((B, S, K - n, D), dtype),
        lengths,
        sds((B, K, D), dtype),
        sds((B, K, D), dtype),
    )


@pytest.mark.parametrize("block_k, stages", [(64, 4), (128, 2)])
def test_lowers_for_cuda_to_one_kernel(block_k, stages):
    """Llama-3-8B's layer shape with half its heads streaming (a 320-slot ring), and a small one (head dim 64, a
    64-slot ring): Mosaic GPU lowers the kernel (its register layouts, copies and wgmma shapes checked there) into
    one launch."""
    order = (0, 3, 5, 6, 1, 2, 4, 7)
    fn = jax.jit(lambda *a: duo_decode_attention(*a, kv_order=order, block_k=block_k, stages=stages))
    for shape in ((1, 8192, 320, 4, 8, 4, 128), (2, 256, 64, 3, 8, 1, 64)):
        module = jax.export.export(fn, platforms=["cuda"])(*_abstract(*shape)).mlir_module()
        assert re.findall(r"stablehlo\.custom_call @(\w+)", module) == ["mosaic_gpu_v2"]


def test_rejects_what_it_cannot_serve():
    order = (0, 1, 2, 3)
    good = _abstract(1, 256, 64, 2, 4, 2, 64)
    cases = {
        "bf16 or fp16": _abstract(1, 256, 64, 2, 4, 2, 64, jnp.float32),
        "head dim 32": _abstract(1, 256, 64, 2, 4, 2, 32),
        "ring of 48 slots": _abstract(1, 256, 48, 2, 4, 2, 64),
        "block_k": _abstract(1, 96, 64, 2, 4, 2, 64),
    }
    for message, args in cases.items():
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(lambda *a: duo_decode_attention(*a, kv_order=order), *args)
    with pytest.raises(ValueError, match="shared memory"):  # 4 stages of 128-key tiles at head dim 128: 304 KiB
        jax.eval_shape(
            lambda *a: duo_decode_attention(*a, kv_order=order, block_k=128), *_abstract(1, 256, 64, 2, 4, 2, 128)
        )
    with pytest.raises(ValueError, match="kv_order"):
        jax.eval_shape(lambda *a: duo_decode_attention(*a, kv_order=(0, 1, 2, 2)), *good)

"""The split cache's layout, byte count and streaming-slot bookkeeping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from duo_jax.cache import (
    CAPACITY_BLOCK,
    expected_cache_bytes,
    full_cache_bytes,
    init_cache,
    make_layout,
    round_capacity,
    streaming_slot_positions,
    streaming_write_slots,
)
from duo_jax.config import get_config
from duo_jax.errors import DuoJaxError
from duo_jax.methods import cache_nbytes
from duo_jax.pattern import Pattern
from tests.conftest import tiny_config


def simulate_ring(length, sink, recent):
    """Slot contents after writing positions 0..length-1 one at a time (-1: empty)."""
    slots = [-1] * (sink + recent)
    for p in range(length):
        slots[p if p < sink else sink + (p - sink) % recent] = p
    return slots


# A ring of `slots` slots (None: sink + recent, the window compiled in; else a wider ring with the window traced).
RINGS = [None, 16]


def _traced(function, slots):
    """`function(..., sink, recent)` as compiled: the window constants, or with a ring of `slots` traced values."""
    if slots is None:
        return function
    return lambda *args: jax.jit(lambda *a: function(*a[:-2], a[-2], a[-1], slots))(*args)


@pytest.mark.parametrize("slots", RINGS)
@pytest.mark.parametrize("sink, recent", [(0, 3), (2, 5), (4, 1), (3, 8)])
def test_slot_positions_match_a_simulated_ring(sink, recent, slots):
    lengths = np.arange(0, 25)
    got = np.asarray(_traced(streaming_slot_positions, slots)(jnp.asarray(lengths), sink, recent))
    wide = (slots or sink + recent) - sink - recent  # slots past the window: never written
    np.testing.assert_array_equal(got, [simulate_ring(n, sink, recent) + [-1] * wide for n in lengths])


@pytest.mark.parametrize("slots", RINGS)
@pytest.mark.parametrize("start, chunk", [(0, 9), (5, 4), (7, 20), (30, 1)])
def test_chunk_writes_match_one_at_a_time(start, chunk, slots):
    sink, recent, n_valid = 2, 5, chunk - 1  # the last token of the chunk is padding
    positions = jnp.asarray(start + np.arange(chunk))[None]
    valid = jnp.asarray(np.arange(chunk) < n_valid)[None]
    ring = slots or sink + recent
    written = np.asarray(
        _traced(streaming_write_slots, slots)(positions, valid, jnp.asarray([start + n_valid]), sink, recent)
    )[0]
    state = simulate_ring(start, sink, recent)
    for p, slot in zip(range(start, start + chunk), written):
        if slot < sink + recent:
            state[slot] = p
        else:  # dropped: out of the ring's range, whatever its size
            assert slot >= ring
    assert state == simulate_ring(start + n_valid, sink, recent)
    kept = written[written < sink + recent]
    assert len(set(kept.tolist())) == len(kept)  # no two tokens race for one slot


def test_cache_bytes_equal_the_formula():
    config = tiny_config(num_layers=3, num_kv_heads=4, num_heads=8)
    mask = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]], bool)
    layout = make_layout(config, mask, sink=3, recent=7, context=200)
    assert layout.capacity == round_capacity(200) == 2 * CAPACITY_BLOCK
    assert layout.num_retrieval == (2, 0, 3)
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = init_cache(layout, 2, dtype)
        size = jnp.dtype(dtype).itemsize
        assert [c.retrieval_k.shape[2] for c in cache] == [2, 0, 3]
        assert [c.streaming_k.shape[2] for c in cache] == [2, 4, 1]
        # batch * 2 * head_dim * bytes * sum_l(n_l * capacity + (K - n_l) * (sink + recent))
        assert cache_nbytes(cache) == 2 * 2 * 16 * size * ((2 + 0 + 3) * 256 + (2 + 4 + 1) * 10)
        assert cache_nbytes(cache) == expected_cache_bytes(layout, 2, size)
    full = init_cache(make_layout(config, None, sink=3, recent=7, context=200), 2, jnp.float32)
    assert cache_nbytes(full) == full_cache_bytes(config, 2, 200, 4)


def test_streaming_partition_does_not_grow_with_the_context():
    config = tiny_config()
    mask = np.array([[1, 0], [0, 0]], bool)
    shapes = [
        [
            c.streaming_k.shape
            for c in init_cache(make_layout(config, mask, sink=4, recent=8, context=n), 1, jnp.float32)
        ]
        for n in (10, 1000, 5000)
    ]
    assert shapes[0] == shapes[1] == shapes[2] == [(1, 12, 1, 16), (1, 12, 2, 16)]


def test_llama3_8b_cache_with_the_published_pattern_abstractly():
    config = get_config("llama3-8b")
    mask = Pattern.for_model("llama3-8b").retrieval_mask(0.5)
    assert mask.sum() == 128
    layout = make_layout(config, mask, sink=64, recent=256, context=131072)
    cache = jax.eval_shape(lambda: init_cache(layout, 1, jnp.bfloat16))  # shapes only, nothing allocated
    nbytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert nbytes == expected_cache_bytes(layout, 1, 2)
    full = full_cache_bytes(config, 1, 131072, 2)
    assert full == 16 * 2**30  # 128 KiB per token
    assert 0.50 < nbytes / full < 0.51  # half the heads keep 320 of 131072 tokens


def test_bad_windows_are_clear_errors():
    with pytest.raises(DuoJaxError, match="sink and recent must be >= 0"):
        make_layout(tiny_config(), None, sink=-1, recent=8, context=10)


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "as_on_a_gpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contiguous_write_matches_numpy(dtype, on_gpu, monkeypatch):
    """`write_run` (the in-place write of a contiguous cache) against a numpy write, token by token: ragged
    n_valid, a window clamped at the end of the cache, tokens past the capacity dropped, T > S, and decode steps
    (T = 1: a token, no token, a slot past the capacity), also as on a GPU, where a batched decode step is one
    scatter. (A quantized cache's codes and scales go through the same function: tests/test_quantized_cache.py.)"""
    from duo_jax.methods import base
    from duo_jax.methods.base import write_run

    monkeypatch.setattr(base, "on_gpu", lambda: on_gpu)
    rng = np.random.default_rng(0)
    cases = [(16, 8, [12, 3], [4, 8]), (16, 8, [14, 9], [8, 0]), (4, 8, [1, 0], [5, 3]), (16, 1, [5, 15], [1, 1])]
    for S, T, start, n_valid in cases + [(16, 1, [0, 16], [0, 1])]:
        cache = jnp.asarray(rng.standard_normal((2, S, 3, 8)), dtype)
        new_in = jnp.asarray(rng.standard_normal((2, T, 3, 8)), dtype)
        old, new = np.asarray(cache, np.float32), np.asarray(new_in, np.float32)
        expected = old.copy()
        for b in range(2):
            for t in range(n_valid[b]):
                if start[b] + t < S:
                    expected[b, start[b] + t] = new[b, t]
        write = jax.jit(lambda *a: write_run(*a))  # traced anew: `on_gpu` is read when tracing
        out = write(cache, jnp.asarray(start, jnp.int32), new_in, jnp.asarray(n_valid, jnp.int32))
        np.testing.assert_array_equal(np.asarray(out, np.float32), expected)


def test_batched_decode_write_lowered_for_cuda_is_one_scatter():
    """A decode step's write of 4 sequences' tokens, exported for CUDA: one scatter, not a dynamic-update-slice
    per sequence (each its own launch on a GPU); on CPU, 4 in-place windows."""
    from duo_jax.methods.base import write_run
    from tests.test_backend import cuda_module, executed

    args = (
        jax.ShapeDtypeStruct((4, 64, 2, 16), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((4, 1, 2, 16), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    module = cuda_module(lambda *a: write_run(*a), *args)
    assert [executed(module, op) for op in ("stablehlo.scatter", "stablehlo.dynamic_update_slice")] == [1, 0]
    cpu = jax.jit(lambda *a: write_run(*a)).lower(*args).as_text()
    assert [executed(cpu, op) for op in ("stablehlo.scatter", "stablehlo.dynamic_update_slice")] == [0, 4]


@pytest.mark.slow
def test_bf16_chunk_temp_memory_does_not_grow_per_layer():
    """XLA's memory analysis of one compiled bf16 prefill chunk (2 layers, full attention) at 1k and 16k slots:
    the growth is at most one layer's K + V (XLA:CPU computes the bf16 cache write in f32, so a layer's new
    cache is written out of place, then copied in; the old uint16 scatter kept several layers' copies alive:
    1.4x one layer's with 2 layers, 3.4x with 4)."""
    from duo_jax.engine import abstract_params, extend
    from duo_jax.methods import make_method

    config = tiny_config()

    def temp(capacity):
        method = make_method("full", config, context=capacity)
        i32 = jax.ShapeDtypeStruct((1,), jnp.int32)
        lowered = extend.lower(
            abstract_params(config, "bfloat16"),
            method.cache_spec(1, jnp.bfloat16),
            i32,
            jax.ShapeDtypeStruct((1, 64), jnp.int32),
            i32,
            config=config,
            method=method,
        )
        return lowered.compile().memory_analysis().temp_size_in_bytes

    one_layer = 2 * (16384 - 1024) * config.num_kv_heads * config.head_dim * 2  # K + V, bf16
    assert temp(16384) - temp(1024) <= 1.05 * one_layer

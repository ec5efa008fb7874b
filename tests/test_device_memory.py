"""Device memory: XLA's out-of-memory errors explained, and the checks before an allocation, in `generate` and the
server's scheduler (gate training's: tests/test_train_gates.py). The CPU reports no memory limit, so the checks run
here against devices that report one (`FakeDevice`); the out-of-memory error is XLA:CPU's own."""

from pathlib import Path

import jax
import numpy as np
import pytest

import duo_jax
from duo_jax import device_memory, generation, methods
from duo_jax.engine import Engine, cache_device_bytes
from duo_jax.errors import DeviceMemoryError, DuoJaxError
from duo_jax.methods.paged import paged
from duo_jax.serve import scheduler
from tests.conftest import FakeDevice, tiny_config

CONFIG = tiny_config(max_position_embeddings=2048)


@pytest.fixture(scope="module")
def model():
    return duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(1), scale=0.2), None, "random")


def oom(message: str) -> jax.errors.JaxRuntimeError:
    return jax.errors.JaxRuntimeError(message)


def test_out_of_memory_is_told_from_other_exhausted_resources():
    assert device_memory.is_out_of_memory(
        oom("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 80.00GiB with allocator GPU_0_bfc")
    )
    assert device_memory.is_out_of_memory(oom("RESOURCE_EXHAUSTED: Out of memory allocating 68719476736 bytes."))
    assert device_memory.is_out_of_memory(
        oom("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm.")
    )
    assert device_memory.is_out_of_memory(  # TPU's runtime
        oom("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 4.39G. That was not possible.")
    )
    # XLA:GPU's autotuner reports under the same status; it is not the device's memory
    assert not device_memory.is_out_of_memory(oom("RESOURCE_EXHAUSTED: Failed to get configs for: 5 out of 9"))
    assert not device_memory.is_out_of_memory(oom("INTERNAL: Out of memory somewhere"))
    assert not device_memory.is_out_of_memory(MemoryError("RESOURCE_EXHAUSTED: Out of memory"))


def test_explain_out_of_memory_rewords_only_out_of_memory():
    with pytest.raises(DeviceMemoryError, match=r"while doing X: shrink Y \(XLA: RESOURCE_EXHAUSTED: Out of") as e:
        with device_memory.explain_out_of_memory("doing X", "shrink Y"):
            raise oom("RESOURCE_EXHAUSTED: Out of memory allocating 12 bytes.\nmore lines")
    assert isinstance(e.value.__cause__, jax.errors.JaxRuntimeError)
    assert isinstance(e.value, DuoJaxError) and isinstance(e.value, MemoryError)
    other = oom("RESOURCE_EXHAUSTED: Failed to get configs")
    with pytest.raises(jax.errors.JaxRuntimeError) as e:
        with device_memory.explain_out_of_memory("doing X", "shrink Y"):
            raise other
    assert e.value is other


def test_free_bytes_is_the_least_free_device_and_none_without_a_limit():
    a, b = FakeDevice(100, 30), FakeDevice(100, 60)
    assert device_memory.free_bytes([a, b]) == (40, b, 100)
    assert device_memory.free_bytes([a, FakeDevice(100, 90, process_index=1)]) == (70, a, 100)  # another process's
    assert device_memory.free_bytes(jax.devices()[:1]) is None  # the CPU backend reports no limit
    assert device_memory.fits(10**18, jax.devices()[:1])
    assert device_memory.fits(40, [a, b]) and not device_memory.fits(41, [a, b])


def _lower_limits() -> bool:
    """Whether this host's kernel refuses a 64 GiB allocation outright (heuristic overcommit, RAM + swap well under
    it): then XLA:CPU reports it out of memory rather than the kernel killing the process as it fills the pages."""
    try:
        mode = int(Path("/proc/sys/vm/overcommit_memory").read_text())
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        total_kib = int(info["MemTotal"].split()[0]) + int(info["SwapTotal"].split()[0])
    except (OSError, KeyError, ValueError):
        return False
    return mode in (0, 2) and total_kib * 1024 < 32 * 2**30


@pytest.mark.skipif(
    jax.default_backend() != "cpu" or not _lower_limits(), reason="XLA:CPU's allocation, which this kernel may grant"
)
def test_generate_past_the_device_memory_says_what_and_how_to_shrink_it():
    config = tiny_config(max_position_embeddings=2**29)
    big = duo_jax.Model(config, duo_jax.init_params(config, jax.random.key(1), scale=0.2), None, "random")
    # 2 layers x (k, v) x 2^29 tokens x 2 heads x 16 x 4 bytes: 64 GiB per array, which XLA:CPU cannot allocate
    with pytest.raises(DeviceMemoryError) as e:
        duo_jax.generate(big, [[1, 2, 3]], context=2**29, max_new_tokens=2)
    message = str(e.value)
    assert "full KV cache of 536870912 tokens (256.00 GiB per device)" in message
    assert "kv_dtype='int8'" in message and "python -m duo_jax.plan" in message
    assert "RESOURCE_EXHAUSTED" in message
    # the process goes on: a request that fits runs
    assert len(duo_jax.generate(big, [[1, 2, 3]], context=128, max_new_tokens=2).tokens[0]) == 2


def test_generate_refuses_a_cache_larger_than_the_free_memory_before_compiling(model, monkeypatch):
    prompt = list(range(1, 101))
    need = cache_device_bytes(methods.make_method("full", CONFIG, context=128), 2, "float32")
    monkeypatch.setattr(generation, "devices_of", lambda params, mesh: [FakeDevice(need + 1000, 1000 + 1)])
    with pytest.raises(DeviceMemoryError) as e:
        generation.plan_generation(model, [prompt, prompt], max_new_tokens=8)
    message = str(e.value)
    assert "the full KV cache of 2 sequence(s) of 128 tokens needs" in message
    assert f"{need / 2**30:.2f} GiB per device" in message and "shorten the prompts" in message
    # one sequence's cache fits
    assert generation.plan_generation(model, [prompt], max_new_tokens=8).device_cache_bytes == need // 2


def test_generate_pads_no_rows_where_the_batch_buckets_cache_would_not_fit(model, monkeypatch):
    """Five prompts run as 6 rows; where 6 rows' cache does not fit and 5 rows' does, they run as 5."""
    prompt = list(range(1, 101))
    rows = lambda n: cache_device_bytes(methods.make_method("full", CONFIG, context=128), n, "float32")  # noqa: E731
    assert generation.plan_generation(model, [prompt] * 5, max_new_tokens=8).batch == 6
    monkeypatch.setattr(generation, "devices_of", lambda params, mesh: [FakeDevice(rows(5))])
    plan = generation.plan_generation(model, [prompt] * 5, max_new_tokens=8)
    assert (plan.batch, plan.device_cache_bytes) == (5, rows(5))
    monkeypatch.setattr(generation, "devices_of", lambda params, mesh: [FakeDevice(rows(5) - 1)])
    with pytest.raises(DeviceMemoryError, match="the full KV cache of 5 sequence\\(s\\) of 128 tokens needs"):
        generation.plan_generation(model, [prompt] * 5, max_new_tokens=8)


def test_generate_falls_back_from_the_capacity_bucket_to_the_request_when_only_that_fits(model, monkeypatch):
    prompt = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 600).tolist()  # + 8 new: 5 blocks, bucket 6
    at = lambda capacity: cache_device_bytes(methods.make_method("full", CONFIG, context=capacity), 1, "float32")
    assert at(640) < at(768)
    assert generation.plan_generation(model, [prompt], max_new_tokens=8).capacity == 768  # no limit: the bucket
    monkeypatch.setattr(generation, "devices_of", lambda params, mesh: [FakeDevice(at(640))])
    plan = generation.plan_generation(model, [prompt], max_new_tokens=8)
    assert (plan.capacity, plan.device_cache_bytes) == (640, at(640))
    out = duo_jax.generate(model, [prompt], max_new_tokens=8, stop_at_eos=False)
    assert out.tokens == duo_jax.generate(model, [prompt], max_new_tokens=8, stop_at_eos=False, context=640).tokens
    # with a kv_budget, duo fits its sparsity to the capacity: no fallback (the tokens would depend on free memory)
    budget = dict(pattern=duo_jax.Pattern(np.linspace(0.1, 0.9, 4).reshape(2, 2)), kv_budget=300, sink=4, recent=60)
    full_need = cache_device_bytes(
        generation.plan_generation(model, [prompt], max_new_tokens=8, **budget).method, 1, "float32"
    )
    monkeypatch.setattr(generation, "devices_of", lambda params, mesh: [FakeDevice(full_need - 1)])
    with pytest.raises(DeviceMemoryError, match="of 768 tokens needs"):
        generation.plan_generation(model, [prompt], max_new_tokens=8, **budget)
    # SnapKV keeps its budget at any capacity: it falls back as full attention does
    snap = lambda capacity: methods.make_method("snapkv", CONFIG, context=capacity, kv_budget=100)  # noqa: E731
    monkeypatch.setattr(
        generation, "devices_of", lambda params, mesh: [FakeDevice(cache_device_bytes(snap(640), 1, "float32"))]
    )
    assert generation.plan_generation(model, [prompt], max_new_tokens=8, method="snapkv", kv_budget=100).capacity == 640
    monkeypatch.setattr(generation, "devices_of", lambda params, mesh: [FakeDevice(at(640))])
    # an explicit context is what the user asked for: never shrunk, refused
    with pytest.raises(DeviceMemoryError, match="of 768 tokens needs"):
        generation.plan_generation(model, [prompt], max_new_tokens=8, context=768)
    monkeypatch.setattr(generation, "devices_of", lambda params, mesh: [FakeDevice(at(640) - 1)])
    with pytest.raises(DeviceMemoryError, match="of 640 tokens needs"):
        generation.plan_generation(model, [prompt], max_new_tokens=8)


def test_the_scheduler_refuses_a_page_pool_larger_than_the_free_memory(model, monkeypatch):
    method = paged(methods.make_method("full", CONFIG, context=256), page_size=16, num_pages=64)
    need = cache_device_bytes(method, 2, "float32")
    monkeypatch.setattr(scheduler, "devices_of", lambda params, mesh: [FakeDevice(need - 1)])
    with pytest.raises(DeviceMemoryError, match=r"64 pages of 16 tokens, 2 slots\) needs .*--kv-memory-mb"):
        scheduler.Scheduler(Engine.of(model), method, slots=2, chunk=16, impl="xla")
    monkeypatch.setattr(scheduler, "devices_of", lambda params, mesh: [FakeDevice(need)])
    assert scheduler.Scheduler(Engine.of(model), method, slots=2, chunk=16, impl="xla").cache is not None


def test_processes_refuse_together(monkeypatch):
    """With several processes (gate training on a pod), one whose devices lack the memory must not refuse alone:
    the others would wait for it in their first collective. Each refuses when any process is short."""
    from jax.experimental import multihost_utils

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([x, 1]))  # the other one is short
    with pytest.raises(DeviceMemoryError, match="more than another process's devices have free"):
        device_memory.check_fits(10, [FakeDevice(100)], "a step", "shrink it")
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([x, 0]))
    device_memory.check_fits(10, [FakeDevice(100)], "a step", "shrink it")  # no one is short
    with pytest.raises(DeviceMemoryError, match="has 0.00 GiB free"):
        device_memory.check_fits(1000, [FakeDevice(100)], "a step", "shrink it")  # this one is
    # a fallback decided on `fits` (a generation's capacity or batch bucket) is decided by all of them
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([x, 0]))  # the other's do not fit
    assert device_memory.fits(10, [FakeDevice(100)]) is False
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array([x, 1]))
    assert device_memory.fits(10, [FakeDevice(100)]) is True and device_memory.fits(1000, [FakeDevice(100)]) is False

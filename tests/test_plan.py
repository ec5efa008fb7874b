"""The memory planner (`duo_jax.plan`): its figures against arrays actually built, and its CLI."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax import plan
from duo_jax.cache import CAPACITY_BLOCK
from duo_jax.methods import cache_nbytes, make_method
from duo_jax.model import quantize_weights
from duo_jax.pattern import Pattern
from tests.conftest import tiny_config

CONFIG = tiny_config(num_layers=3)
PATTERN = Pattern(np.array([[0.9, 0.1], [0.2, 0.3], [0.05, 0.8]]))


@pytest.mark.parametrize("kv_dtype, weights", [(None, None), ("int4", "int8")])
@pytest.mark.slow
def test_planner_figures_equal_bytes_of_built_arrays(kv_dtype, weights):
    hbm = 3 * 2**20
    r = plan.plan(
        CONFIG,
        hbm_bytes=hbm,
        sparsity=0.5,
        kv_dtype=kv_dtype,
        weights=weights,
        dtype="float32",
        pattern=PATTERN,
        sink=4,
        recent=12,
        chunk=16,
        temp=False,
    )
    params = quantize_weights(duo_jax.init_params(CONFIG, jax.random.key(0)), weights)
    built_weights = sum(x.nbytes for x in jax.tree.leaves(params))
    assert r["weight_bytes"] == built_weights
    options = {
        "full": dict(kv_dtype=kv_dtype),
        "duo": dict(kv_dtype=kv_dtype, pattern=PATTERN, sparsity=0.5, sink=4, recent=12),
    }
    for name, opts in options.items():

        def built(capacity):
            return cache_nbytes(make_method(name, CONFIG, context=capacity, **opts).init_cache(1, jnp.float32))

        best = r[f"max_context_{name}"]
        assert best > 0 and best % CAPACITY_BLOCK == 0
        assert (
            built(3 * CAPACITY_BLOCK) - built(2 * CAPACITY_BLOCK) == r[f"{name}_cache_bytes_per_token"] * CAPACITY_BLOCK
        )
        assert built_weights + built(best) <= hbm < built_weights + built(best + CAPACITY_BLOCK)
    assert r["max_context_duo"] > r["max_context_full"]


@pytest.mark.parametrize("weights", [None, "int8"])
def test_planner_counts_the_fused_qkv_copy_a_gpu_engine_holds(weights):
    """Where the engine fuses q/k/v (a GPU's default), the copy lives beside the model's own weights: the planner
    counts its bytes, those of the arrays an Engine(fuse_qkv=True) builds, and the context shrinks to match."""
    from duo_jax.engine import Engine

    kwargs = dict(hbm_bytes=3 * 2**20, weights=weights, dtype="float32", pattern=PATTERN, sink=4, recent=12)
    separate = plan.plan(CONFIG, temp=False, fused_qkv=False, **kwargs)
    fused = plan.plan(CONFIG, temp=False, fused_qkv=True, **kwargs)
    params = quantize_weights(duo_jax.init_params(CONFIG, jax.random.key(0)), weights)
    engine = Engine(params, CONFIG, fuse_qkv=True)
    copy = sum(x.nbytes for layer in engine.params.layers for x in jax.tree.leaves(layer.wqkv))
    assert fused["weight_bytes"] == separate["weight_bytes"] + copy and fused["fused_qkv"]
    blocks = int(copy / separate["full_cache_bytes_per_token"]) // CAPACITY_BLOCK  # whole blocks the copy costs
    assert fused["max_context_full"] <= separate["max_context_full"] - blocks * CAPACITY_BLOCK
    assert plan.plan(CONFIG, temp=False, **kwargs)["fused_qkv"] is (jax.default_backend() == "gpu")


@pytest.mark.slow
def test_largest_context_fits_with_the_temp_of_the_step_compiled_at_that_context():
    """int4 cache and int8 weights: the steps dequantize tile by tile, so temp memory grows with the context by
    at most one layer's arrays (XLA:CPU copies a layer's bf16 scales when it scatters them); the answer holds
    once the step is compiled at it."""
    from duo_jax.engine import compiled_extend

    hbm = 3 * 2**20
    r = plan.plan(
        CONFIG,
        hbm_bytes=hbm,
        sparsity=0.5,
        kv_dtype="int4",
        weights="int8",
        dtype="float32",
        pattern=PATTERN,
        sink=4,
        recent=12,
        chunk=16,
    )
    method = make_method("full", CONFIG, context=r["max_context_full"], kv_dtype="int4")
    assert r["full_temp_bytes"] > 0
    assert r["full_temp_bytes_per_token"] <= r["full_cache_bytes_per_token"] / CONFIG.num_layers
    temp = max(
        compiled_extend(CONFIG, method, 1, t, "float32", weight_format="int8").memory_analysis().temp_size_in_bytes
        for t in (1, 16)
    )
    assert r["weight_bytes"] + cache_nbytes(method.init_cache(1, jnp.float32)) + temp <= hbm
    assert r["max_context_full"] < r["full_max_context_no_temp"]
    assert 0 < r["max_context_duo"] < r["duo_max_context_no_temp"]


def test_cli_json_llama3_8b_passes_4m_tokens_with_int4_kv_and_int8_weights(capsys):
    argv = [
        "--model",
        "llama3-8b",
        "--hbm-gib",
        "80",
        "--sparsity",
        "0.75",
        "--kv-dtype",
        "int4",
        "--weights",
        "int8",
        "--no-temp",
        "--json",
    ]
    assert plan.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    # By hand: int4 codes + a bf16 scale = 66 bytes per head vector; 32 layers x 8 KV heads x K and V.
    assert r["full_cache_bytes_per_token"] == 32 * 8 * 2 * 66
    assert r["duo_cache_bytes_per_token"] == 64 * 2 * 66  # 25% of the 256 KV heads keep every token
    assert r["max_context_duo"] >= 4_000_000 > r["max_context_full"]
    assert plan.main(argv[:-1]) == 0 and "largest context" in capsys.readouterr().out


def test_a_mesh_plans_one_devices_share_of_llama3_8b(capsys):
    """--mesh model=8: by hand, each device holds 1/8 of the cache (the retrieval slots split over model) and of
    every matmul weight; the capacity is a multiple of lcm(128, model)."""
    argv = ["--model", "llama3-8b", "--hbm-gib", "16", "--kv-dtype", "int4", "--weights", "int8", "--no-temp"]
    assert plan.main([*argv, "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert plan.main([*argv, "--mesh", "model=8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["mesh"] == "data=1,model=8"
    assert r["full_cache_bytes_per_token"] == 32 * 8 * 2 * 66 / 8 == one["full_cache_bytes_per_token"] / 8
    # Whole on every device: the norms (2 per layer and the final one) and the scales of wo and w_down (bf16, one
    # per output channel: the contracted axis is the split one).
    whole = (2 * 32 + 1) * 4096 * 2 + 32 * 2 * 4096 * 2
    assert r["weight_bytes"] == (one["weight_bytes"] - whole) // 8 + whole
    assert r["max_context_full"] > 6 * one["max_context_full"]
    assert plan.main(["--model", "smollm2-135m", "--hbm-gib", "1", "--no-temp", "--mesh", "model=3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_context_full"] % 384 == 0  # lcm(128, 3): whole slots per device
    assert plan.main([*argv, "--mesh", "model=3"]) == 2  # 32 heads: a clear error
    assert "model=3 must divide the query heads (32)" in capsys.readouterr().err
    assert plan.main([*argv[:-1], "--mesh", "data=2,model=8"]) == 2  # compiling for 16 devices on this host
    assert "needs 16 devices, this machine has" in capsys.readouterr().err


def test_edges_the_linear_fit_missed():
    """A budget a little above the weights and a window wider than the sampled capacities asserted (the linear fit
    extrapolated where a cache narrows its window); a sparsity of 1 divided by zero (nothing grows with the context:
    any length fits); the answer is checked against the layouts themselves."""
    options = dict(dtype="float32", pattern=PATTERN, chunk=16, temp=False)
    weights = plan.plan(CONFIG, hbm_bytes=2**30, **options)["weight_bytes"]

    def built(name, capacity, **opts):
        return cache_nbytes(make_method(name, CONFIG, context=capacity, **opts).init_cache(1, jnp.float32))

    for sink, recent in ((4, 12), (200, 2000)):
        duo = dict(pattern=PATTERN, sparsity=0.5, sink=sink, recent=recent)
        block = built("full", CAPACITY_BLOCK)  # a full cache of one block
        for extra in (block + 1, 5 * block, 40 * block):
            r = plan.plan(CONFIG, hbm_bytes=weights + extra, sink=sink, recent=recent, **options)
            for name, opts in (("full", {}), ("duo", duo)):
                best = r[f"max_context_{name}"]
                assert best == 0 or built(name, best, **opts) <= extra, (name, sink, recent, extra)
                assert built(name, best + CAPACITY_BLOCK, **opts) > extra, (name, sink, recent, extra)
            assert r["max_context_duo"] >= r["max_context_full"] > 0
    streaming = plan.plan(CONFIG, hbm_bytes=weights + 5 * block, sparsity=1.0, **options)
    assert streaming["max_context_duo"] is None and streaming["max_context_full"] > 0
    # a window of 10^8 tokens: the layouts below it are bisected, not built block by block (minutes before)
    start = time.perf_counter()
    wide = plan.plan(CONFIG, hbm_bytes=weights + 40 * block, sink=10**8, recent=256, **options)["max_context_duo"]
    assert time.perf_counter() - start < 60  # the block-by-block scan: 781,250 builds
    duo = dict(pattern=PATTERN, sparsity=0.5, sink=10**8, recent=256)
    assert 0 < wide and built("duo", wide, **duo) <= 40 * block < built("duo", wide + CAPACITY_BLOCK, **duo)


def test_cli_errors_and_a_model_without_a_pattern(capsys):
    assert plan.main(["--model", "smollm2-135m", "--no-temp", "--chunk", "0"]) == 2
    assert "chunk must be an integer >= 1" in capsys.readouterr().err
    for dtype in ("foo", "int8"):  # int8 is --weights' (the error named the Python argument weights='int8')
        with pytest.raises(SystemExit) as exit_info:
            plan.main(["--model", "smollm2-135m", "--no-temp", "--dtype", dtype])
        assert exit_info.value.code == 2 and f"invalid choice: '{dtype}'" in capsys.readouterr().err
    assert plan.main(["--model", "qwen2.5-7b-instruct", "--no-temp", "--hbm-gib", "40"]) == 0  # no shipped pattern
    out = capsys.readouterr().out
    assert "full: cache" in out and "duo : not planned" in out and "pass --pattern" in out
    assert plan.main(["--model", "smollm2-135m", "--no-temp", "--sparsity", "1"]) == 0
    assert "largest context any length" in capsys.readouterr().out

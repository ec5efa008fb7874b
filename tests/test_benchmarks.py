"""The benchmark scripts without the real model: result writers, ratios, the memory and roofline arithmetic,
--help of every script, and gpu_llama8b's CPU dry run (Llama-3-8B shapes traced, nothing allocated)."""

import importlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.cpu

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "common")  # every script, found

common = importlib.import_module("common")


def test_duo_decode_benchmark_counts_bytes_and_needs_a_gpu(capsys):
    bench = importlib.import_module("duo_decode")
    assert bench.bytes_read(2, 1000, 4, 320, duo=False) == 2 * 8 * 1000 * 128 * 2 * 2
    assert bench.bytes_read(2, 1000, 4, 320, duo=True) == 2 * (4 * 1000 + 4 * 320) * 128 * 2 * 2
    assert bench.main(["--contexts", "64"]) == 2 and "run it on a GPU" in capsys.readouterr().err


def test_ratio():
    assert common.ratio(3.0, 1.5) == 2.0
    assert np.isnan(common.ratio(None, 1.0)) and np.isnan(common.ratio(1.0, 0.0))
    assert np.isnan(common.ratio(float("nan"), 1.0))


def test_write_result(tmp_path, capsys):
    from duo_jax.eval import report

    rows = [[2048, 10.0, 5.0, 2.0], [4096, 20.0, float("nan"), None]]
    common.write_result(
        tmp_path / "out",
        "demo_bench",
        title="A title",
        headers=["context", "full ms", "duo ms", "speed-up"],
        rows=rows,
        data=dict(results={2048: {"full": 10.0}}),
        notes=["a note"],
        plot=lambda path: report.line_plot(
            path,
            [2048, 4096],
            {"full": [10.0, 20.0], "duo": [5.0, None]},
            xlabel="context",
            ylabel="ms",
            title="t",
            logx=True,
        ),
    )
    printed = capsys.readouterr().out
    assert "A title" in printed and "| context | full ms | duo ms | speed-up |" in printed and "a note" in printed
    assert "JAX" in printed  # the machine line
    saved = json.loads((tmp_path / "out" / "demo_bench.json").read_text())
    assert saved["table"]["headers"] == ["context", "full ms", "duo ms", "speed-up"]
    assert saved["table"]["rows"][1] == [4096, 20.0, None, None]  # NaN and None both as null
    assert saved["results"] == {"2048": {"full": 10.0}} and saved["notes"] == ["a note"]
    assert saved["machine"]["cpu_count"] >= 1 and "jax" in saved["machine"]
    assert saved["command"].startswith("python")
    assert (tmp_path / "out" / "demo_bench.png").stat().st_size > 1000
    assert saved["files"] == [str(tmp_path / "out" / "demo_bench.png"), str(tmp_path / "out" / "demo_bench.json")]


@pytest.mark.slow
def test_time_ours_is_generates_loop():
    """The step-by-step timing loop generates exactly what `duo_jax.generate` does, in every mode."""
    import jax

    import duo_jax
    from duo_jax.eval.modes import mode_settings
    from duo_jax.loading import Model
    from duo_jax.pattern import Pattern
    from tests.conftest import tiny_config

    config = tiny_config()
    model = Model(config, duo_jax.init_params(config, jax.random.key(0), scale=0.2), None, "tiny")
    pattern = Pattern(np.random.default_rng(0).random((config.num_layers, config.num_kv_heads)))
    ids = np.random.default_rng(1).integers(0, config.vocab_size, 40).tolist()
    for name in ("full", "duo", "streaming"):
        settings = mode_settings(name, config, pattern, sparsity=0.5, sink=4, recent=8, context=48)
        timed = common.time_ours(model, ids, settings, new_tokens=8, chunk_size=16)
        out = common.run_generate(model, ids, settings, new_tokens=8, chunk_size=16)
        assert timed["tokens"] == out.tokens[0]
        assert timed["cache_bytes"] == out.stats["cache_bytes"]
        assert timed["ttft_s"] > 0 and timed["decode_ms"] > 0 and timed["tokens_per_s"] > 0


def test_heatmaps(tmp_path):
    from duo_jax.eval import report

    scores = np.array([[1.0, 0.0], [0.5, np.nan]])
    assert (
        report.grid_heatmaps(tmp_path / "maps.png", {"full": scores, "duo": scores}, [1024, 2048], [0.0, 1.0])
        .stat()
        .st_size
        > 1000
    )
    wrapped = report.grid_heatmaps(
        tmp_path / "rows.png", {m: scores for m in "abcde"}, [1024, 2048], [0.0, 1.0], columns=2
    )  # 3 rows of 2, the last panel blank
    one_row = report.grid_heatmaps(tmp_path / "row.png", {m: scores for m in "abcde"}, [1024, 2048], [0.0, 1.0])
    import matplotlib.image

    assert matplotlib.image.imread(wrapped).shape[0] > 2 * matplotlib.image.imread(one_row).shape[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, capsys):
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--out" in text and module.__doc__.split("\n")[0][:40] in text


def test_an_out_below_a_file_stops_a_benchmark_as_it_parses(tmp_path, capsys):
    """A benchmark writes its JSON at its end: an --out it cannot write is argparse's error before the run."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module("decode").main(["--out", str(afile / "run")])
    assert exit_info.value.code == 2 and f"{afile} is a file, not a folder" in capsys.readouterr().err
    assert common.parser("doc", "x").parse_args(["--out", str(tmp_path / "new")]).out == tmp_path / "new"


def test_memory_arithmetic():
    memory = importlib.import_module("memory")
    assert memory.theoretical_ratio(0.5, 320, 1024) == pytest.approx(0.5 + 0.5 * 320 / 1024)
    assert memory.theoretical_ratio(1.0, 320, 4096) == 1.0
    rows, data = memory.llama_rows([8192, 131072], sparsity=0.5, sink=64, recent=256, hbm_gib=80.0)
    kv_per_token = 32 * 8 * 128 * 2 * 2  # layers * kv heads * head_dim * (K, V) * bf16 = 128 KiB
    for context in (8192, 131072):
        sizes = data["contexts"][context]
        assert sizes["full"] == context * kv_per_token
        assert sizes["duo"] / sizes["full"] == pytest.approx(sizes["theoretical_ratio"])
    # the planner's answer: whole capacity blocks of 128 tokens next to the weights
    assert data["largest_context"]["full"] == (80 * 2**30 - data["weight_bytes"]) // kv_per_token // 128 * 128
    assert 1.99 < data["largest_context"]["duo"] / data["largest_context"]["full"] < 2.0


def test_roofline_matches_hand_computed_figures():
    """Decode roofline of bf16 Llama-3-8B at the H100's measured 3.03 TB/s (weights + KV read per step), as
    computed by hand: (16.06 GB + 128 KiB * context) / 3.03 TB/s = 5.65 / 6.72 / 10.97 ms at 8k / 32k / 128k;
    50% retrieval heads (sink 64 + recent 256 for the rest) at 128k: 8.14 ms."""
    import duo_jax

    gpu = importlib.import_module("gpu_llama8b")
    config = duo_jax.get_config("llama3-8b")
    weight_bytes = 2 * 8_030_261_248  # Llama-3-8B's parameter count
    for context, full_ms in ((8192, 5.65), (32768, 6.72), (131072, 10.97)):
        roof = gpu.roofline(
            config, weight_bytes=weight_bytes, share=0.5, window=320, context=context, chunk=2048, bandwidth=3.03e12
        )
        assert roof["decode_ms"]["full"] == pytest.approx(full_ms, abs=0.01)
        assert roof["prefill_flops"]["full"] > roof["prefill_flops"]["duo"]
    assert roof["decode_ms"]["duo"] == pytest.approx(8.14, abs=0.01)


def test_op_kinds_sum_a_profile_by_fusion_kind():
    """A profile's ops grouped by kind (XLA's numeric suffixes dropped), per step, most launches first."""
    gpu = importlib.import_module("gpu_llama8b")
    totals = {
        "loop_add_fusion_62": 4e6,
        "loop_add_fusion_3": 2e6,
        "gemm_fusion_dot_485": 8e6,
        "duo_decode_attention": 1e6,
    }
    counts = {"loop_add_fusion_62": 6, "loop_add_fusion_3": 4, "gemm_fusion_dot_485": 2, "duo_decode_attention": 2}
    kinds = gpu.op_kinds(totals, counts, steps=2)
    assert list(kinds) == ["loop_add_fusion", "gemm_fusion_dot", "duo_decode_attention"]
    assert kinds["loop_add_fusion"] == {"ms_per_step": 3.0, "per_step": 5.0}
    assert kinds["gemm_fusion_dot"] == {"ms_per_step": 4.0, "per_step": 1.0}


@pytest.mark.slow
def test_gpu_run_mode_times_the_device_loop_and_the_host_steps(tmp_path):
    """run_mode on a tiny engine (on CPU here): prefill, host steps and the device loop run through the engine,
    the cache ends `4 * steps` + a few tokens short of the context, and a trace without a GPU plane is
    recorded as such instead of failing the run."""
    from conftest import tiny_config

    from duo_jax.engine import Engine
    from duo_jax.methods.registry import make_method
    from duo_jax.model import init_params

    gpu = importlib.import_module("gpu_llama8b")
    config = tiny_config()
    engine = Engine(init_params(config, jax.random.key(0)), config)
    out = gpu.run_mode(
        engine,
        make_method("full", config, context=256),
        256,
        chunk=64,
        steps=4,
        prefill=True,
        profile_dir=str(tmp_path / "trace"),
        prefill_repeats=3,
    )
    assert out["prefill_s"] > 0 and out["host_step_ms"] > 0 and out["decode_ms"] > 0
    assert len(out["prefill_runs_s"]) == 3 and out["prefill_s"] == sorted(out["prefill_runs_s"])[1]
    assert 0 < out["prefill_dispatch_s"] <= max(out["prefill_runs_s"])
    assert out["profile"] == {"error": "the trace has no GPU plane"}
    assert out["prefill_profile"] == {"error": "the trace has no GPU plane"}
    assert np.isfinite(out["decode_ms"])
    # the timed loop's tokens (what the `graphs` stage compares across XLA flags): one per step, in the vocabulary
    assert len(out["tokens"]) == 4 and all(0 <= t < config.vocab_size for t in out["tokens"])


def test_gpu_op_times_reads_busy_time_span_and_launches(tmp_path, monkeypatch):
    """The GPU plane's kernels per step: busy ms, the span from the first start to the last end (the GPU's idle
    between kernels is the difference), launches, and the costliest ops."""
    import types

    from jax import profiler

    gpu = importlib.import_module("gpu_llama8b")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.xplane.pb").write_bytes(b"")
    kernel = lambda name, start, end: types.SimpleNamespace(  # noqa: E731
        name=name, start_ns=start, end_ns=end, duration_ns=end - start
    )
    events = [
        kernel("gemm_fusion_dot_1", 0, 3e6),
        kernel("loop_add_fusion_2", 4e6, 5e6),
        kernel("gemm_fusion_dot_1", 8e6, 10e6),
    ]
    line = types.SimpleNamespace(name="XLA Ops", events=events)
    planes = [
        types.SimpleNamespace(name="/host:CPU", lines=[]),
        types.SimpleNamespace(name="/device:GPU:0", lines=[line]),
    ]
    monkeypatch.setattr(profiler.ProfileData, "from_file", lambda path: types.SimpleNamespace(planes=planes))
    out = gpu.gpu_op_times(str(tmp_path / "t"), steps=2)
    assert out["gpu_ms_per_step"] == 3.0 and out["span_ms_per_step"] == 5.0 and out["launches_per_step"] == 1.5
    # one kernel's two launches of 3 and 2 ms: its quartiles tell them apart
    assert out["top_ops"][0] == {
        "op": "gemm_fusion_dot_1",
        "ms_per_step": 2.5,
        "per_step": 1.0,
        "us_per_launch": {"min": 2000.0, "q1": 2250.0, "median": 2500.0, "q3": 2750.0, "max": 3000.0},
    }
    assert out["top_ops"][1]["us_per_launch"]["max"] == 1000.0


def test_fill_memory_runs_each_mode_at_its_largest_batch(monkeypatch):
    """--fill-memory: each mode's batch is the caches that fit the free memory less the margin (duo, holding
    fewer tokens per sequence, fits more), and an out-of-memory error backs the batch off by a tenth."""
    from conftest import tiny_config

    from duo_jax.methods.registry import make_method
    from duo_jax.pattern import Pattern

    gpu = importlib.import_module("gpu_llama8b")
    config = tiny_config()
    methods = {
        "full": make_method("full", config, context=512),
        "duo": make_method("duo", config, context=512, pattern=Pattern(np.eye(2)[:2]), sink=4, recent=12),
    }
    per_sequence = {
        m: gpu.tree_bytes(jax.eval_shape(lambda m=m: m.init_cache(1, jnp.bfloat16))) for m in methods.values()
    }
    full, duo = (per_sequence[methods[m]] for m in ("full", "duo"))
    assert gpu.largest_batch(methods["full"], 40 * full + 100, 100) == 40
    assert gpu.largest_batch(methods["duo"], 40 * full + 100, 100) == (40 * full) // duo > 40

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 30 * full + 1000, "bytes_in_use": 1000}

    monkeypatch.setattr(jax, "devices", lambda: [Device()])
    ran, failed = [], []

    def run_mode(engine, method, context, *, batch, **kwargs):
        if batch > 20 and not failed:  # the first try out of memory
            failed.append(batch)
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (test)")
        ran.append((method.name, batch))
        return {"decode_ms": 1.0}

    monkeypatch.setattr(gpu, "run_mode", run_mode)
    out = gpu.fill_memory(None, methods, 512, steps=2, margin_gib=0.0, impl="auto")
    assert out["full"]["batch"] == 30 - 3 and failed == [30]  # backed off by a tenth
    assert out["duo"]["batch"] == (30 * full) // duo and ran[-1] == ("duo", out["duo"]["batch"])


@pytest.mark.slow
def test_train_step_times_the_training_step(tmp_path, monkeypatch):
    """train_step on a tiny model's shapes (get_config patched): it compiles, times the steps, and writes the
    row with tokens per step and XLA's memory estimate (no peak on CPU, which reports no memory stats)."""
    from conftest import tiny_config

    from duo_jax import config as config_lib

    monkeypatch.setattr(config_lib, "get_config", lambda name: tiny_config())
    bench = importlib.import_module("train_step")
    assert bench.main(["--model", "tiny", "--seq-len", "100", "--steps", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "train_step_tiny.json").read_text())
    row = dict(zip(result["table"]["headers"], result["table"]["rows"][0]))
    assert row["tokens / step"] == 100 and row["step s"] > 0 and row["XLA estimate GiB / device"] is not None
    assert len(result["step_seconds"]) == 3


@pytest.mark.slow
def test_gpu_dry_run(tmp_path, capsys):
    gpu = importlib.import_module("gpu_llama8b")
    assert gpu.main(["--dry-run", "--contexts", "8192", "1048576", "--out", str(tmp_path)]) == 0
    assert "traced duo" in capsys.readouterr().out
    plan = json.loads((tmp_path / "gpu_llama8b_plan.json").read_text())
    assert plan["weight_bytes"] == 2 * 8_030_261_248
    small, large = plan["plan"]["8192"], plan["plan"]["1048576"]
    assert small["cache_bytes"]["full"] == 2**30 and small["cache_bytes"]["duo"] < 0.53 * 2**30
    assert large["fits"] == {"full": False, "duo": True}
    assert small["decode_ms"]["full"] == pytest.approx(5.65, abs=0.01)


@pytest.mark.slow
def test_gpu_dry_run_of_one_layer(tmp_path, capsys):
    """--num-layers 1: the first layer of Llama-3-8B, duo with 4 of its 8 KV heads keeping the full cache (the
    published pattern's first layer at sparsity 0.5); out of range, a one-line error."""
    gpu = importlib.import_module("gpu_llama8b")
    assert gpu.main(["--dry-run", "--num-layers", "1", "--contexts", "16384", "--out", str(tmp_path)]) == 0
    assert "first 1 of 32 layers" in capsys.readouterr().out
    plan = json.loads((tmp_path / "gpu_llama8b_plan.json").read_text())["plan"]["16384"]
    full_bytes = 2 * 16384 * 8 * 128 * 2  # k and v, one layer, bf16
    assert plan["cache_bytes"]["full"] == full_bytes
    assert plan["cache_bytes"]["duo"] == full_bytes // 2 + 2 * (64 + 256) * 4 * 128 * 2  # + 4 rings
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--num-layers", "33"])
    assert "--num-layers must be between 1 and 32" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_dry_run_quantized(tmp_path, capsys):
    """int4 KV + int8 weights: the cache is its codes + bf16 scales (66 B per head vector, so 33 KiB per token
    of Llama-3-8B), the roofline reads those bytes, and duo 75% reaches 4M tokens on 80 GiB where full does not."""
    gpu = importlib.import_module("gpu_llama8b")
    assert (
        gpu.main(
            [
                "--dry-run",
                "--kv-dtype",
                "int4",
                "--weights",
                "int8",
                "--sparsity",
                "0.75",
                "--contexts",
                "8192",
                "4194304",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "weights int8, KV int4" in capsys.readouterr().out
    plan = json.loads((tmp_path / "gpu_llama8b_plan.json").read_text())
    assert 8.03e9 < plan["weight_bytes"] < 0.51 * 2 * 8_030_261_248  # int8 codes + per-channel scales
    small, large = plan["plan"]["8192"], plan["plan"]["4194304"]
    per_token = 2 * 32 * 8 * (128 // 2 + 2)
    assert small["cache_bytes"]["full"] == 8192 * per_token
    assert small["decode_ms"]["full"] == pytest.approx(1e3 * (plan["weight_bytes"] + 8192 * per_token) / 3.03e12)
    assert large["fits"] == {"full": False, "duo": True}


@pytest.mark.slow
@pytest.mark.skipif(pallas_kernels.cpu._compiler() is None, reason="no C++ compiler: the CPU kernel cannot be built")
def test_cpu_attention_runs_end_to_end(tmp_path):
    """The CPU attention benchmark at a tiny length: kernel, XLA path and torch (in its own process) timed, the
    ratios in the table consistent with the medians."""
    bench = importlib.import_module("cpu_attention")
    assert bench.main(["--lengths", "64", "--chunks", "32", "--repeats", "2", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "cpu_attention.json").read_text())
    row = saved["table"]["rows"][0]
    assert row[:2] == [64, 32] and all(x > 0 for x in row[2:])
    assert row[7] == pytest.approx(row[4] / row[2]) and row[8] == pytest.approx(row[5] / row[2])


def test_kernel_sweep_writes_every_point_as_it_goes(tmp_path, monkeypatch):
    """`kernels.py --sweep` (GPU only) without a GPU: its timer replaced by one that traces each point's kernel on
    tiny shapes (so every point's arguments are ones the kernels take) and fails one point. Λ's points, in runs and
    in one loop, come before flash's; each point is in the JSON as soon as it is measured, a failure as an error."""
    bench = importlib.import_module("kernels")
    points = bench.sweep_points()
    assert {p[0] for p in points[: len(points) // 3 * 2]} == {"lambda"}
    assert {p[0] for p in points[len(points) // 3 * 2 :]} == {"flash"}
    assert [p[1]["one_loop"] for p in points[:2]] == [False, True]
    out = tmp_path / "sweep.json"
    args = bench.parse_args(
        [
            "--sweep",
            "--seq-lens",
            "64",
            "--num-heads",
            "2",
            "--num-kv-heads",
            "1",
            "--head-dim",
            "64",
            "--out",
            str(out),
        ]
    )
    seen = []

    def timer(fn, *arrays, reps):
        if seen:  # the kernels, traced; the first call is cuDNN's yardstick
            jax.eval_shape(fn, *arrays)
        seen.append(json.loads(out.read_text())["sweep"] if out.exists() else [])
        if len(seen) == 3:
            raise RuntimeError("out of shared memory\nmore detail")
        return 2.0

    monkeypatch.setattr(bench, "median_ms", timer)
    result = {}
    bench.sweep(args, result)
    rows = json.loads(out.read_text())["sweep"]
    assert rows == result["sweep"] and len(rows) == len(points)
    assert [len(s) for s in seen[1:]] == list(range(len(points)))  # written before the next point is timed
    assert rows[1] == dict(
        seq_len=64, kernel="lambda", **points[1][1], cudnn_ms=2.0, error="RuntimeError: out of shared memory"
    )
    assert rows[0]["ms"] == 2.0 and rows[0]["cudnn_over_this"] == 1.0


def _session_commands() -> list[tuple[str, list[str]]]:
    """(script, its arguments) of every Python command in benchmarks/gpu_session.sh, shell variables given
    stand-in values (a loop's chunk size and steps a number, anything else a path)."""
    import re
    import shlex

    text = (BENCHMARKS / "gpu_session.sh").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        for match in re.finditer(r"\$PY (\S+\.py|-m pytest)((?:\s+(?!2>&1|\||\)|;)\S+)*)", line):
            args = re.sub(r"\$\{?(\w+)\}?", lambda m: {"chunk": "8192", "steps": "10"}.get(m[1], "OUT"), match[2])
            helper = re.match(r"\s*(\w+)\(\)", line)  # a shell function's command: once per call, "$@" its arguments
            calls = re.findall(rf"^\s+{helper[1]} \S+(.*)$", text, re.MULTILINE) if helper else [""]
            commands += [(match[1], shlex.split(args.replace('"$@"', call))) for call in calls]
    return commands


def test_every_gpu_session_command_parses(monkeypatch):
    """A GPU call lasts minutes and comes by chance: every command of gpu_session.sh must be one its script
    accepts (an option renamed in a script, or a typo, would cost a part's whole turn), and every `pytest -k` must
    select GPU tests."""
    import argparse
    import re

    from _pytest.mark.expression import Expression

    commands = _session_commands()
    scripts = {script for script, _ in commands}
    assert {"benchmarks/gpu_llama8b.py", "benchmarks/kernels.py", "train_gates.py", "-m pytest"} <= scripts

    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    root = BENCHMARKS.parent
    gpu_tests = re.findall(r"^def (test_\w+)", (root / "tests/test_gpu.py").read_text(), re.MULTILINE)
    for script, args in commands:
        if script == "-m pytest":
            if "-k" in args:  # pytest's own -k matching: a name matches where it holds the word
                k = Expression.compile(args[args.index("-k") + 1])
                assert any(k.evaluate(lambda word, t=t: word.lower() in t.lower()) for t in gpu_tests), args
            continue
        path = root / script
        spec = importlib.util.spec_from_file_location(f"session_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with pytest.raises(Parsed):  # SystemExit (argparse's error) where the arguments are not the script's
            (module.parse_args if hasattr(module, "parse_args") else module.main)(args)


def test_the_next_gpu_stage_fits_one_device_call():
    """`gpu_session.sh next` is the first call of a GPU session (at most 600 s a call): its parts' time limits
    leave a minute for the machine's own start, the imports and the archive."""
    import re

    text = (BENCHMARKS / "gpu_session.sh").read_text()
    stage = text[text.index("\nnext)\n") : text.index(";;", text.index("\nnext)\n"))]
    limits = [int(n) for n in re.findall(r'part "\$\{\w+:-(\d+)\}"', stage)]
    assert len(limits) >= 5 and sum(limits) <= 540, limits


def test_cudnn_mask_calls_time_each_call_the_engine_makes(monkeypatch):
    """`kernels.py --cudnn-masks` without a GPU: the XLA stand-in for cuDNN's call (`cudnn.xla_part`, its contract)
    runs each call, a timer of 1 ms gives each row's FLOP rate by hand, and a chunk as long as T is an error."""
    from duo_jax.attention import cudnn

    bench = importlib.import_module("kernels")
    args = bench.parse_args(["--cudnn-masks", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16"])
    args.chunk, args.dtype = 16, "float32"
    ran = []

    def timer(fn, *operands, reps):
        out, lse = fn(*operands)
        ran.append((out.shape, lse.shape))
        return 1.0

    monkeypatch.setattr(bench, "median_ms", timer)
    row = bench.cudnn_mask_calls(args, 64, attend=cudnn.xla_part)
    pairs = {"causal_whole": 64 * 64 / 2, "prefix_padded": 16 * 48, "prefix_exact": 16 * 48, "own_causal": 16 * 16 / 2}
    assert {name: r["tflops"] for name, r in row.items()} == {n: 4 * p * 4 * 16 / 1e-3 / 1e12 for n, p in pairs.items()}
    assert ran == [((1, 64, 4, 16), (1, 64, 4))] + [((1, 16, 4, 16), (1, 16, 4))] * 3
    with pytest.raises(SystemExit, match="--chunk < T"):
        bench.cudnn_mask_calls(args, 16, attend=cudnn.xla_part)

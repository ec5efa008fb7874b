"""duo_jax.attention.dispatch: "pallas", "mosaic", "cpu", "xla" and "reference" agree and validate alike."""

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels.cpu
from duo_jax import attention
from tests.conftest import random_attention_inputs, rel_err

# "cpu" where the C++ kernel can be built here (without a compiler it is an error: tests/test_cpu_kernels.py)
IMPLS = ("pallas", "mosaic", "xla", "reference") + (("cpu",) if pallas_kernels.cpu.available() else ())


def test_auto_is_the_cpu_kernel_on_cpu():
    if jax.default_backend() == "cpu" and pallas_kernels.cpu.available():
        assert attention.resolve_impl("auto") == "cpu"  # (tests/test_cpu_kernels.py: "xla" where it cannot be built)
    assert attention.resolve_impl("pallas") == "pallas"
    with pytest.raises(ValueError, match="impl"):
        attention.resolve_impl("triton")


@pytest.mark.slow
def test_lambda_implementations_agree():
    q, k, v, _ = random_attention_inputs(1, 40, 40, 4, 2, 64)
    outs = [attention.lambda_attention(q, k, v, sink=4, recent=8, impl=impl) for impl in IMPLS]
    assert rel_err(outs[0], outs[2]) <= 1e-5 and rel_err(outs[1], outs[2]) <= 1e-5


@pytest.mark.slow
def test_flash_implementations_agree():
    q, k, v, _ = random_attention_inputs(2, 16, 48, 4, 2, 64)
    outs = [
        attention.flash_attention(q, k, v, q_offset=jnp.array([24, 3]), kv_len=jnp.array([40, 19]), impl=impl)
        for impl in IMPLS
    ]
    assert rel_err(outs[0], outs[2]) <= 1e-5 and rel_err(outs[1], outs[2]) <= 1e-5


@pytest.mark.slow
def test_decode_implementations_agree():
    q, k, v, _ = random_attention_inputs(3, 1, 256, 4, 2, 64)
    lengths = jnp.array([256, 37, 0], jnp.int32)
    outs = [attention.decode_attention(q[:, 0], k, v, lengths, impl=impl) for impl in IMPLS]
    assert rel_err(outs[0], outs[2]) <= 1e-5 and rel_err(outs[1], outs[2]) <= 1e-5
    assert float(jnp.max(jnp.abs(outs[1][2]))) == 0.0  # an empty cache attends to nothing


@pytest.mark.slow
def test_specs_without_a_kernel_fall_back_to_xla():
    """Sliding windows have no Pallas kernel: "pallas" still gives the right answer."""
    q, k, v, _ = random_attention_inputs(2, 8, 64, 4, 2, 32)
    spec = attention.prefix_spec(2, 8, q_offset=jnp.array([40, 9]), kv_len=jnp.array([48, 17]), num_keys=64, window=6)
    assert (
        rel_err(attention.attend(q, k, v, spec, impl="pallas"), attention.attend(q, k, v, spec, impl="reference"))
        <= 1e-5
    )


def test_lambda_over_a_partly_filled_cache_is_not_given_to_the_kernels(monkeypatch):
    """The Λ kernels and cuDNN's Λ calls see every key slot: a Λ spec with kv_len below the slots (a cache) went to
    them under "pallas" / "mosaic" and attended to the empty slots (errors of 2 against the reference)."""
    from duo_jax.attention import cudnn, dispatch

    q, k, v, _ = random_attention_inputs(1, 16, 32, 2, 1, 16)
    partly = attention.prefix_spec(1, 16, q_offset=16, kv_len=20, num_keys=32, sink=2, recent=4)
    whole = attention.prefix_spec(1, 16, q_offset=16, num_keys=32, sink=2, recent=4)
    assert not partly.every_key and whole.every_key
    for impl in ("pallas", "mosaic"):
        want = attention.attend(q, k, v, partly, impl="reference")
        assert rel_err(attention.attend(q, k, v, partly, impl=impl), want) <= 1e-5, impl
    assert dispatch._kernels_serve(whole, k, v, "pallas") and not dispatch._kernels_serve(partly, k, v, "pallas")
    monkeypatch.setattr(cudnn, "takes", lambda *a: True)  # what a GPU would say of these arrays
    assert cudnn.serves(q, k, v, whole) and not cudnn.serves(q, k, v, partly)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise_value_error(impl):
    q, k, v, _ = random_attention_inputs(1, 16, 16, 4, 2, 64)
    for kwargs, message in [(dict(sink=-1, recent=8), "sink must be"), (dict(sink=4, recent=0), "recent must be")]:
        with pytest.raises(ValueError, match=message):
            attention.lambda_attention(q, k, v, impl=impl, **kwargs)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        attention.flash_attention(q[:, :, :3], k, v, impl=impl)
    with pytest.raises(ValueError, match="sliding window"):
        attention.prefix_spec(1, 16, num_keys=16, window=0)


@pytest.mark.slow
def test_engine_with_mosaic_kernels_matches_xla():
    """The TPU kernels (interpreted on CPU) through the engine: the same greedy tokens as the XLA path, full and
    duo, chunked prefill + decode."""
    import numpy as np

    from duo_jax.methods import make_method
    from duo_jax.pattern import Pattern
    from tests.conftest import run_method, tiny_config

    config = tiny_config(num_layers=2)
    params = __import__("duo_jax").init_params(config, jax.random.key(0), scale=0.2)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, 20).tolist()
    gates = np.array([[0.9, 0.1], [0.2, 0.8]])
    for method in (
        make_method("full", config, context=128),
        make_method("duo", config, context=128, pattern=Pattern(gates), sparsity=0.5, sink=2, recent=6),
    ):
        ours, logits, _, _ = run_method(params, config, method, prompt, chunk=8, decode_steps=4, impl="mosaic")
        ref, ref_logits, _, _ = run_method(params, config, method, prompt, chunk=8, decode_steps=4, impl="xla")
        assert ours == ref
        assert rel_err(jnp.asarray(logits), jnp.asarray(ref_logits)) <= 1e-5


@pytest.mark.parametrize("method_name", ["full", "duo"])
@pytest.mark.parametrize("chunk", [128, 1], ids=["prefill-chunk", "decode-step"])
def test_extend_exported_for_tpu_attends_through_mosaic(chunk, method_name):
    """`extend` lowered for TPU from this CPU host with impl="auto": every layer's attention is a Mosaic
    kernel (one tpu_custom_call per layer; with duo two: the retrieval heads over the contiguous cache and the
    streaming heads over their ring + chunk, keys at explicit positions) and no XLA attention loop is left in
    the module."""
    import functools
    import re

    from jax import export

    from duo_jax.engine import extend
    from duo_jax.methods import make_method
    from duo_jax.model import init_params, unstack_layers
    from duo_jax.pattern import Pattern
    from pallas_kernels._backend import lowering_for
    from tests.conftest import tiny_config

    config = tiny_config(num_layers=2, head_dim=128)
    if method_name == "duo":  # one retrieval and one streaming KV head per layer
        method = make_method(
            "duo", config, context=256, pattern=Pattern([[0.9, 0.1], [0.2, 0.8]]), sparsity=0.5, sink=4, recent=60
        )
    else:
        method = make_method("full", config, context=256)
    params = jax.eval_shape(lambda: unstack_layers(init_params(config, jax.random.key(0))))
    ints = jax.ShapeDtypeStruct((1,), jnp.int32)
    step = jax.jit(functools.partial(extend, config=config, method=method))
    with lowering_for("tpu"):
        exported = export.export(step, platforms=["tpu"])(
            params, method.cache_spec(1, jnp.float32), ints, jax.ShapeDtypeStruct((1, chunk), jnp.int32), ints
        )
    module = exported.mlir_module()
    kernels = re.findall(r'kernel_name = "([^"]+)"', module)
    per_layer = 2 if method_name == "duo" else 1
    assert module.count("tpu_custom_call") == len(kernels) == per_layer * config.num_layers
    if method_name == "duo":  # the streaming heads' ring + chunk (a decode step too) through the own kernel
        own = kernels.count("tpu_block_sparse_attention_fwd")
        assert own == (2 if chunk > 1 else 1) * config.num_layers, kernels
    assert "stablehlo.while" not in module


def test_auto_falls_back_to_xla_on_a_gpu_without_triton(monkeypatch):
    """JAX 0.11 deprecates Pallas's Triton backend: on a GPU where the probe kernel fails, "auto" takes the
    XLA path with a warning and a forced "pallas" is a clear error (the GPU is simulated: the probe's answer
    and the backend are patched; tests/test_gpu.py runs the real probe on a GPU)."""
    from duo_jax.attention import dispatch
    from duo_jax.errors import BackendError
    from pallas_kernels import _backend

    monkeypatch.setattr(dispatch, "pallas_backend", lambda: "gpu")
    monkeypatch.setattr(_backend, "triton_unavailable", lambda: None)
    assert attention.resolve_impl("auto") == "pallas"
    reason = "ImportError: cannot import name 'CompilerParams' (test)"
    monkeypatch.setattr(_backend, "triton_unavailable", lambda: reason)
    dispatch._triton_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="XLA path.*|CompilerParams"):
        assert attention.resolve_impl("auto") == "xla"
    with pytest.raises(BackendError, match="impl='xla'"):
        attention.resolve_impl("pallas")
    assert attention.resolve_impl("reference") == "reference"
    with _backend.lowering_for("gpu"):  # exporting for a GPU from this host: nothing to probe
        assert attention.resolve_impl("auto") == "pallas"
    dispatch._triton_fallback.cache_clear()


def test_mosaic_on_a_gpu_needs_hopper(monkeypatch):
    """impl="mosaic" on a GPU (simulated) is "cudnn" but for DuoAttention's decode step, which runs a Mosaic GPU
    kernel for Hopper: a device without compute capability 9.x (this CPU device has none, an A100 has 8.0, a B200
    10.0) is a clear error; exported for a GPU, nothing is checked."""
    from duo_jax.attention import cudnn, dispatch
    from duo_jax.errors import BackendError
    from pallas_kernels import _backend

    monkeypatch.setattr(dispatch, "pallas_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn, "unavailable", lambda: None)
    with pytest.raises(BackendError, match="not Hopper's 9.x"):
        attention.resolve_impl("mosaic")
    for capability, hopper in (("8.0", False), ("9.0", True), ("10.0", False)):
        device = type("Device", (), dict(compute_capability=capability, device_kind="GPU"))()
        monkeypatch.setattr(jax, "devices", lambda: [device])
        assert (dispatch._not_hopper() is None) == hopper
    monkeypatch.setattr(dispatch, "_not_hopper", lambda: None)
    assert attention.resolve_impl("mosaic") == "cudnn"
    monkeypatch.undo()
    with _backend.lowering_for("gpu"):
        assert attention.resolve_impl("mosaic") == "cudnn"


def test_auto_falls_back_to_cudnn_where_it_runs_and_triton_does_not(monkeypatch):
    """Without Triton but with cuDNN attention (both simulated), "auto" takes "cudnn": prefill chunks and decode
    steps of 16-bit values through cuDNN, the rest (here a ring's keys at explicit positions) on the XLA path, and
    says so once."""
    from duo_jax.attention import cudnn, dispatch
    from pallas_kernels import _backend

    monkeypatch.setattr(dispatch, "pallas_backend", lambda: "gpu")
    monkeypatch.setattr(_backend, "triton_unavailable", lambda: "ImportError: Triton removed (test)")
    monkeypatch.setattr(cudnn, "unavailable", lambda: None)
    monkeypatch.setattr(cudnn, "gradient_unavailable", lambda: None)
    calls = []
    monkeypatch.setattr(cudnn, "attention", lambda *a, **kw: calls.append(a) or a[0])
    dispatch._triton_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="through cuDNN for prefill chunks"):
        assert attention.resolve_impl("auto") == "cudnn"
    q, k, v = (jnp.ones((1, 8, 2, 16), jnp.bfloat16) for _ in range(3))
    chunk = attention.attend(q, k, v, attention.prefix_spec(1, 8, q_offset=jnp.asarray([0]), num_keys=8))
    assert len(calls) == 1 and chunk is q
    attention.decode_attention(q[:, 0], k, v, jnp.asarray([5]), impl="auto")
    assert len(calls) == 2
    ring = attention.MaskSpec(q[:, :, 0, 0].astype(jnp.int32), jnp.asarray([8]), jnp.zeros((1, 8), jnp.int32))
    assert attention.attend(q, k, v, ring).shape == q.shape and len(calls) == 2  # not cuDNN's: XLA
    dispatch._triton_fallback.cache_clear()


def test_the_environment_disables_triton(monkeypatch):
    """DUO_JAX_DISABLE_TRITON makes the probe fail with its name, so that "auto" on a GPU takes the route of a GPU
    without Triton (cuDNN, else XLA); unset, empty or "0", the probe runs."""
    from pallas_kernels import _backend

    for value, disabled in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(_backend.DISABLE_TRITON, value)
        _backend.triton_unavailable.cache_clear()
        reason = _backend.triton_unavailable()
        assert (reason == f"disabled by the environment (DUO_JAX_DISABLE_TRITON={value})") == disabled
    _backend.triton_unavailable.cache_clear()


def test_the_triton_probe_names_why_it_cannot_run_here():
    from pallas_kernels import _backend

    reason = _backend.triton_unavailable()
    if jax.default_backend() == "cpu":
        assert isinstance(reason, str) and reason  # no GPU: Triton cannot compile for this host


@pytest.mark.slow
@pytest.mark.parametrize("seq", [1, 2, 4], ids=["one-device", "ulysses", "all-gather"])
def test_gate_training_step_exported_for_tpu_attends_through_mosaic(seq):
    """The whole gate-training step (`make_train_step`: shard_map over the mesh, the scanned remat layer, the
    optimiser) lowered for TPU from this CPU host with impl="auto", on an abstract ("data", "fsdp", "seq") mesh:
    every attention is a Mosaic kernel (teacher causal forward, student Λ forward, its remat recomputation, dq,
    dk/dv: 5 in the scanned layer body) and the only loops left are the layer scans (the XLA path would add
    its key-block loops). Splash where the query offset is static (one device, Ulysses: each device holds whole
    sequences), the own kernel where it is traced (all-gather K/V: each device's queries at its offset)."""
    import dataclasses
    import re

    from jax import export
    from jax.sharding import AbstractMesh, AxisType

    from duo_jax import gates, sharding, training
    from duo_jax.model import init_params
    from pallas_kernels._backend import lowering_for
    from tests.conftest import tiny_config

    config = tiny_config(num_layers=2, head_dim=128)  # 2 KV heads: Ulysses on seq=2, all-gather on seq=4
    # Auto axes, as `sharding.make_mesh` builds (an AbstractMesh's default is Explicit since JAX 0.12)
    mesh = AbstractMesh((1, 1, seq), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    expected = {1: "none", 2: "ulysses", 4: "all-gather"}[seq]
    assert training.sequence_parallelism(config, mesh) == expected
    params = jax.eval_shape(lambda: dataclasses.replace(init_params(config, jax.random.key(0)), lm_head=None))
    gate_shape = jax.ShapeDtypeStruct((config.num_layers, config.num_kv_heads), jnp.float32)
    tokens = jax.ShapeDtypeStruct((1, 256 * seq), jnp.int32)
    batch = training.Batch(tokens, tokens, jax.ShapeDtypeStruct(tokens.shape, jnp.bool_))

    def lowered(impl):
        objective = gates.Objective(sink=16, recent=64, impl=impl)
        optimizer, _ = training.make_optimizer(training.TrainConfig(objective=objective))
        step = training.make_train_step(config, objective, optimizer, mesh, sharding.weight_specs(params, mesh))
        with lowering_for("tpu"):
            return export.export(step, platforms=["tpu"])(
                gate_shape, jax.eval_shape(optimizer.init, gate_shape), params, batch
            ).mlir_module()

    module = lowered("auto")
    kernels = re.findall(r'kernel_name = "([^"]+)"', module)
    assert module.count("stablehlo.custom_call @tpu_custom_call") == len(kernels) == 5
    own = expected == "all-gather"
    assert all(name.startswith("tpu_block_sparse_" if own else "splash_") for name in kernels), kernels
    assert module.count("stablehlo.while") == 2  # the layer scan, forward and backward
    if seq == 1:  # the check bites: the XLA path's key-block loops
        assert lowered("xla").count("stablehlo.while") > 2


@pytest.mark.parametrize("seq", [1, 4], ids=["one-device", "all-gather"])
def test_gate_training_step_exported_for_cuda_without_triton_attends_through_cudnn(monkeypatch, seq):
    """The whole gate-training step (shard_map, the scanned remat layer, the optimiser) in bf16, lowered for an NVIDIA
    GPU from this CPU host as a GPU without Triton runs it (impl="cudnn", everything else on the XLA path; the
    cuDNN version check bypassed, the probes taken as passed): every attention is a cuDNN call. Forward: the
    teacher's causal call, the student's Λ as its sliding window and its sinks call, and their recomputation
    (remat); backward: the Λ calls' cuDNN backward. With all-gather sequence parallelism (seq=4 over 2 KV heads)
    each device's queries sit at a traced offset: the teacher is two calls (its own keys, the prefix) and Λ four
    (its own keys' window, the window's keys before them, two over the sinks). The only loops left are the layer
    scans (the XLA path would add its key-block loops)."""
    import dataclasses
    import re

    from jax import export
    from jax._src.cudnn import fused_attention_stablehlo as binding
    from jax.sharding import AbstractMesh, AxisType

    from duo_jax import gates, sharding, training
    from duo_jax.attention import cudnn, dispatch
    from duo_jax.model import init_params
    from pallas_kernels._backend import lowering_for
    from tests.conftest import tiny_config

    monkeypatch.setattr(binding, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")  # no Triton
    monkeypatch.setattr(cudnn, "lambda_unavailable", lambda at_offset=False: None)
    config = tiny_config(num_layers=2, head_dim=128)
    mesh = AbstractMesh((1, 1, seq), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    assert training.sequence_parallelism(config, mesh) == {1: "none", 4: "all-gather"}[seq]
    params = jax.eval_shape(
        lambda: dataclasses.replace(init_params(config, jax.random.key(0), jnp.bfloat16), lm_head=None)
    )
    gate_shape = jax.ShapeDtypeStruct((config.num_layers, config.num_kv_heads), jnp.float32)
    tokens = jax.ShapeDtypeStruct((1, 256 * seq), jnp.int32)
    batch = training.Batch(tokens, tokens, jax.ShapeDtypeStruct(tokens.shape, jnp.bool_))
    checks = [export.DisabledSafetyCheck.custom_call(f"__cudnn$fmhaSoftmax{b}") for b in ("", "Backward")]

    def lowered(impl):
        objective = gates.Objective(sink=16, recent=64, impl=impl)
        optimizer, _ = training.make_optimizer(training.TrainConfig(objective=objective))
        step = training.make_train_step(config, objective, optimizer, mesh, sharding.weight_specs(params, mesh))
        with lowering_for("gpu"):
            return export.export(step, platforms=["cuda"], disabled_checks=checks)(
                gate_shape, jax.eval_shape(optimizer.init, gate_shape), params, batch
            ).mlir_module()

    module = lowered("cudnn")
    calls = [line for line in module.splitlines() if "stablehlo.custom_call @__cudnn" in line]
    window = lambda c: int(re.findall(r"sliding_window_length\\22: (\d+)", c)[0])  # noqa: E731 - 0: none
    forward = [window(c) for c in calls if "fmhaSoftmax(" in c]
    backward = [window(c) for c in calls if "fmhaSoftmaxBackward(" in c]
    if seq == 1:
        assert sorted(forward) == [0, 0, 0, 64, 64] and sorted(backward) == [0, 64]
    else:
        assert sorted(forward) == [0] * 8 + [64, 64] and sorted(backward) == [0, 0, 0, 64]
    assert module.count("stablehlo.while") == 2  # the layer scan, forward and backward
    assert lowered("xla").count("stablehlo.while") > 2  # the check bites: the XLA path's key-block loops


@pytest.mark.slow
def test_gate_loss_and_gradients_with_mosaic_kernels_match_xla():
    """The gate-training objective (scanned, rematerialised layers) with the TPU kernels, interpreted on CPU:
    splash for the teacher's causal and the student's Λ attention (static offsets); loss and gate gradients as
    the XLA path's."""
    import numpy as np

    from duo_jax import gates, init_params
    from pallas_kernels.tpu.launches import pallas_launches
    from tests.conftest import tiny_config

    config = tiny_config(num_layers=1)
    params = init_params(config, jax.random.key(0), scale=0.2)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, 24)), jnp.int32)
    positions = jnp.arange(24, dtype=jnp.int32)[None]
    supervise = jnp.asarray(rng.random((1, 24)) < 0.5)
    alpha = jnp.asarray(rng.uniform(0.1, 0.9, (config.num_layers, config.num_kv_heads)), jnp.float32)

    def loss_and_grad(impl):
        objective = gates.Objective(sink=2, recent=8, impl=impl)
        fn = lambda a: jax.value_and_grad(gates.loss, has_aux=True)(  # noqa: E731
            a, params, config, tokens, positions, supervise, objective
        )
        return fn, jax.jit(fn)(alpha)

    fn, ((_, ours), grad) = loss_and_grad("mosaic")
    assert {launch["name"].split("_")[0] for launch in pallas_launches(fn, alpha)} == {"splash"}
    _, ((_, ref), ref_grad) = loss_and_grad("xla")
    assert float(jnp.max(jnp.abs(ref_grad))) > 1e-4
    assert abs(float(ours.loss) - float(ref.loss)) <= 1e-5 * abs(float(ref.loss))
    assert rel_err(grad, ref_grad) <= 1e-4


@pytest.mark.parametrize("capacity, loops", [(32768, 0), (131072, 1)], ids=["one_tile", "four_tiles"])
def test_xla_decode_on_a_gpu_scores_long_tiles(capacity, loops):
    """A decode step on the XLA path (an int4 cache on a GPU without Triton), lowered for an NVIDIA GPU: up to
    XLA_GPU_DECODE_TILE slots it is one tile with no loop over tiles (no predicate read back per tile), past it a
    loop over tiles of that size; off a GPU the default 512-slot tiles. (One more loop in each: the query blocks'
    `lax.map`, of one block.) On a GPU no tile branches on whether it needs the mask, whose predicate XLA:GPU
    would read back every trip; on a CPU they do. On a GPU no matmul either: sums of products."""
    from jax import export

    from duo_jax.attention import dispatch
    from duo_jax.attention.masks import prefix_spec
    from duo_jax.quant import quantize_kv
    from pallas_kernels._backend import lowering_for

    q = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.bfloat16)
    k = jax.eval_shape(lambda: quantize_kv(jnp.zeros((1, capacity, 8, 128), jnp.bfloat16), "int4"))
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)

    def lowered(platform):
        def step(q, k, v, lengths):  # a function per platform: jit's trace cache does not key on it
            spec = prefix_spec(1, 1, q_offset=lengths - 1, kv_len=lengths, num_keys=capacity)
            return dispatch.attend(q, k, v, spec, impl="xla")

        return export.export(jax.jit(step), platforms=[platform])(q, k, k, lengths).mlir_module()

    with lowering_for("gpu"):
        module = lowered("cuda")
    assert module.count("stablehlo.while") == 1 + loops
    if loops:
        assert "tensor<1x32768x8x64xi8>" in module  # a tile's codes, sliced from the cache
    default = lowered("cpu")
    assert "tensor<1x512x8x64xi8>" in default and default.count("stablehlo.while") == 2
    assert "stablehlo.case" not in module and "stablehlo.case" in default
    # On a GPU the tiles are scored and weighed by multiply + reduce (no matmul to take a dequantized operand).
    assert "stablehlo.dot_general" not in module and "stablehlo.dot_general" in default


def test_xla_decode_on_a_gpu_matches_the_default_tiles(monkeypatch):
    """The long decode tiles change how the XLA path walks the cache, not what it computes: int8 codes, ragged
    lengths, one tile and two, against the default tiles."""
    import numpy as np

    from duo_jax.attention import dispatch, xla
    from duo_jax.attention.masks import prefix_spec
    from duo_jax.quant import quantize_kv
    from pallas_kernels import _backend
    from tests.conftest import rel_err

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.float32)
    lengths = jnp.asarray([64, 23])
    spec = prefix_spec(2, 1, q_offset=lengths - 1, kv_len=lengths, num_keys=64)
    for kind in ("int8", "int4"):
        cache = [quantize_kv(jnp.asarray(rng.standard_normal((2, 64, 2, 16)), jnp.float32), kind) for _ in range(2)]
        want = xla.attention(q, *cache, spec, block_k=16)  # matmuls over 16-slot tiles
        with monkeypatch.context() as patch:  # the tiles; tiles scored by sums of products, without their branch
            patch.setattr(_backend, "backend", lambda: "gpu")
            patch.setattr(dispatch, "resolve_impl", lambda impl: "xla")
            for tile in (64, 32):
                patch.setattr(dispatch, "XLA_GPU_DECODE_TILE", tile)
                assert dispatch._xla_tiles(q, cache[0], spec) == {"block_k": tile}
                assert rel_err(dispatch.attend(q, *cache, spec), want) < 1e-5


def test_duo_decode_without_slots_through_triton_attends_a_cache_already_written():
    """`duo_decode` without slots on the Triton kernel (interpreted on CPU): the retrieval cache already holds the new
    token (keys j < lengths), the ring gets it from k_new / v_new, nothing is written, and the output is [B, 1, H,
    E] in the model's head order, against float64."""
    import numpy as np

    from duo_jax import attention
    from tests.conftest import rel_err
    from tests.test_duo_decode import _inputs, _reference

    B, C, S, n, K_s, G, D = 2, 128, 64, 2, 3, 2, 32
    order = (2, 0, 4, 1, 3)  # the model's KV heads in the caches' order
    q, k, v, ring_k, ring_v, _, _ = _inputs(B, C, S, n, K_s, G, D, seed=3)
    k_all, v_all = (jax.random.normal(jax.random.key(s), (B, n + K_s, D), jnp.float32) for s in (8, 9))
    lengths, ring_lengths = jnp.asarray([77, 1], jnp.int32), jnp.asarray([64, 9], jnp.int32)
    rows = (np.argsort(order)[:, None] * G + np.arange(G)).reshape(-1)  # each model head's caches'-order row
    ring_heads = list(order[n:])
    expected = _reference(q, k, v, lengths, ring_k, ring_v, ring_lengths, k_all[:, ring_heads], v_all[:, ring_heads])
    out, *caches = attention.duo_decode(
        q[:, rows][:, None],
        k,
        v,
        lengths,
        ring_k,
        ring_v,
        ring_lengths,
        k_all[:, None],
        v_all[:, None],
        kv_order=order,
        impl="pallas",
    )
    assert out.shape == (B, 1, (n + K_s) * G, D) and rel_err(out[:, 0], expected[:, rows]) <= 1e-5
    assert all(new is old for new, old in zip(caches, (ring_k, ring_v, k, v)))

"""Generation on a ("data", "model") mesh of 8 host CPU devices: the single-device greedy tokens and logits for
full attention and DuoAttention with retrieval heads uneven across layers, weights 1/model per device, and no
compiled step that all-gathers a whole weight or cache array."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from duo_jax import sharding
from tests.conftest import xla_flags

REPO = Path(__file__).resolve().parent.parent

_SCRIPT = r"""
import dataclasses, functools, json, re, sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
import duo_jax
from duo_jax import plan, sharding
from duo_jax.engine import Engine, compiled_decode, compiled_extend
from duo_jax.generation import build_method
from duo_jax.model import quantize_weights, weight_format
from duo_jax.pattern import Pattern
from tests.conftest import tiny_config

assert jax.device_count() == 8
config = tiny_config(num_layers=3, num_heads=8, num_kv_heads=4, head_dim=8)
model = duo_jax.Model(config, duo_jax.init_params(config, jax.random.key(0), scale=0.1), None, "random")
gates = np.full((3, 4), 0.1)
gates[0, [0, 2, 3]] = 0.9  # layer retrieval counts 3, 0, 1 of 4 KV heads, not the first heads
gates[2, 1] = 0.9
pattern, sparsity = Pattern(gates), 2 / 3
rng = np.random.default_rng(0)
lengths = (37, 50, 21, 45)  # ragged; chunks of 16; 50 + 12 tokens span two of model=4's 32-slot slices
prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
padded = np.zeros((4, 50), np.int32)
for b, p in enumerate(prompts):
    padded[b, :len(p)] = p
options = dict(max_new_tokens=12, chunk_size=16, sink=4, recent=8, stop_at_eos=False)
meshes = {"data=2,model=2": dict(data=2, model=2), "data=1,model=4": dict(data=1, model=4)}
result = {"mask": pattern.retrieval_mask(sparsity).sum(axis=1).tolist()}


def all_gathers(model, kv, mesh):  # what the compiled steps all-gather; none may make a whole weight or cache array
    weights = weight_format(model.params)
    steps = [compiled_extend(config, kv, 4, 16, "float32", "auto", False, mesh, weight_format=weights),
             compiled_decode(config, kv, 4, "float32", "auto", True, 16, (), mesh, weight_format=weights)]
    gathered = set()
    for step in steps:
        gathered |= set(re.findall(r"= [a-z0-9]+\[([0-9,]*)\]\S* all-gather(?:-start)?\(", step.as_text()))
    arrays = (Engine.of(model, mesh).params, kv.cache_spec(4, "float32"))
    whole = {",".join(map(str, x.shape)) for x in jax.tree.leaves(arrays)}
    return dict(gathered=sorted(gathered), whole_gathered=sorted(gathered & whole))


def prefill_logits(method, mesh):
    duo = method == "duo"
    kv = build_method(config, method, context=128, pattern=pattern if duo else None, sparsity=sparsity if duo else None,
                      sink=4, recent=8)
    logits, _, _ = Engine.of(model, mesh).prefill(kv, padded, np.asarray(lengths), chunk=16)
    return np.asarray(logits), kv


for method in ("full", "duo"):
    extra = dict(pattern=pattern, sparsity=sparsity) if method == "duo" else {}
    single = duo_jax.generate(model, prompts, method=method, **options, **extra)
    logits, kv = prefill_logits(method, None)
    runs = result[method] = {"single": single.tokens}
    for name, sizes in meshes.items():
        mesh = sharding.make_generation_mesh(**sizes, devices=jax.devices()[:4])
        out = duo_jax.generate(model, prompts, method=method, mesh=mesh, **options, **extra)
        sharded_logits, _ = prefill_logits(method, mesh)
        err = float(np.abs(sharded_logits - logits).max() / np.abs(logits).max())
        runs[name] = dict(tokens=out.tokens, logits_err=err,
                          device_cache=out.stats["device_cache_bytes"], cache=out.stats["cache_bytes"])

    mesh = sharding.make_generation_mesh(**meshes["data=2,model=2"], devices=jax.devices()[:4])
    runs.update(all_gathers(model, kv, mesh))

# int8 weights with a quantized KV cache: each mesh's tokens and prefill logits against one device's, and no
# compiled step gathering whole weight codes or a whole cache array.
int8 = dataclasses.replace(model, params=quantize_weights(model.params, "int8"))
for method, kv_dtype, sizes in (("full", "int8", meshes["data=2,model=2"]), ("duo", "int4", meshes["data=1,model=4"])):
    extra = dict(pattern=pattern, sparsity=sparsity) if method == "duo" else {}
    kv = build_method(config, method, context=128, sink=4, recent=8, kv_dtype=kv_dtype, **extra)
    single = duo_jax.generate(int8, prompts, method=method, kv_dtype=kv_dtype, **options, **extra)
    mesh = sharding.make_generation_mesh(**sizes, devices=jax.devices()[:4])
    out = duo_jax.generate(int8, prompts, method=method, kv_dtype=kv_dtype, mesh=mesh, **options, **extra)
    one, sharded = (np.asarray(Engine.of(int8, m).prefill(kv, padded, np.asarray(lengths), chunk=16)[0])
                    for m in (None, mesh))
    params = Engine.of(int8, mesh).params
    result[f"int8 weights, {kv_dtype} {method}"] = dict(
        single=single.tokens, tokens=out.tokens, unquantized=result[method]["single"],
        logits_err=float(np.abs(sharded - one).max() / np.abs(one).max()), **all_gathers(int8, kv, mesh),
        device_cache=out.stats["device_cache_bytes"], cache=out.stats["cache_bytes"],
        device_weights=sharding.device_bytes(params), weights=sharding.total_bytes(params))

# Weights loaded straight into the tensor-parallel layout (a transformers checkpoint, plain and int8): the engine on
# that mesh runs the loaded arrays themselves, and the tokens are one device's of the same weights.
mesh = sharding.make_generation_mesh(**meshes["data=2,model=2"], devices=jax.devices()[:4])
for weights in (None, "int8"):
    one = duo_jax.load(sys.argv[1], np.float32, weights=weights)
    loaded = duo_jax.load(sys.argv[1], np.float32, weights=weights,
                          shardings=functools.partial(sharding.tensor_parallel_shardings, mesh=mesh))
    engine = Engine.of(loaded, mesh)
    result[f"loaded {weights}"] = dict(
        copied=engine.copied,
        kept=[a is b for a, b in zip(jax.tree.leaves(engine.params), jax.tree.leaves(loaded.params))],
        split=sum("model" in str(x.sharding.spec) for x in jax.tree.leaves(loaded.params)),
        equal=all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(one.params))),
        tokens=duo_jax.generate(loaded, prompts, mesh=mesh, **options).tokens,
        single=duo_jax.generate(one, prompts, **options).tokens)

# The memory planner on (data=2, model=2): its per-device weights and cache against the arrays built on that mesh.
mesh = sharding.make_generation_mesh(**meshes["data=2,model=2"], devices=jax.devices()[:4])
planned = plan.plan(config, hbm_bytes=2**21, mesh="data=2,model=2", pattern=pattern, sparsity=sparsity, sink=4,
                    recent=8, chunk=16, dtype="float32")
engine = Engine.of(model, mesh)
context = planned["duo_max_context"]
duo_at = build_method(config, "duo", context=context, pattern=pattern, sparsity=sparsity, sink=4, recent=8)
result["plan"] = dict(planned, built_weights=sharding.device_bytes(engine.params),
                      built_cache=sharding.device_bytes(engine.init_cache(duo_at, 2)))

# duo's streaming heads in chunks of 8 within chunks of 16 on (data=2, model=2): the tokens of chunks of 8 on one device
duo = dict(method="duo", pattern=pattern, sparsity=sparsity)
mesh = sharding.make_generation_mesh(**meshes["data=2,model=2"], devices=jax.devices()[:4])
result["streaming_chunk"] = dict(
    eights=duo_jax.generate(model, prompts, **duo, **dict(options, chunk_size=8)).tokens,
    sharded=duo_jax.generate(model, prompts, **duo, **options, mesh=mesh, streaming_chunk=8).tokens,
    sixteens=result["duo"]["single"],
)

# Three prompts on data=2: padded to 4 rows (their bucket, 3, rounded up to a multiple of data), their own tokens.
three = duo_jax.generate(model, prompts[:3], mesh=mesh, **options)
result["three"] = dict(tokens=three.tokens, rows=three.stats["batch_rows"], single=result["full"]["single"][:3])

# Weight bytes on model=4, from the arrays' own shards.
mesh = sharding.make_generation_mesh(data=2, model=4)
params = Engine.of(model, mesh).params
leaves = jax.tree_util.tree_leaves_with_path(params)
result["weights"] = [dict(name=jax.tree_util.keystr(path), nbytes=x.nbytes, sharded="model" in str(x.sharding.spec),
                          shards=sorted({s.data.nbytes for s in x.addressable_shards}),
                          devices=len(x.addressable_shards))
                     for path, x in leaves]
per_device = {}
for _, x in leaves:
    for s in x.addressable_shards:
        per_device[str(s.device)] = per_device.get(str(s.device), 0) + s.data.nbytes
result["per_device"], result["helper"] = sorted(per_device.values()), sharding.device_bytes(params)

errors = {}
def error(name, f):
    try:
        f()
    except duo_jax.DuoJaxError as e:
        errors[name] = str(e)
error("method", lambda: duo_jax.generate(model, prompts, method="h2o", kv_budget=32, mesh=mesh, chunk_size=16))
error("heads", lambda: Engine(model.params, config, sharding.make_generation_mesh(model=3, devices=jax.devices()[:3])))
train_mesh = sharding.make_mesh(data=2, fsdp=1, seq=2, devices=jax.devices()[:4])
error("axes", lambda: duo_jax.generate(model, prompts, mesh=train_mesh, **options))  # a bare KeyError: 'model'
error("kv_dtype", lambda: duo_jax.generate(model, prompts, mesh=mesh, kv_dtype="fp8", **options))
error("spread", lambda: duo_jax.generate(loaded, prompts, **options))  # loaded for a mesh: a list of JAX mismatches
result["errors"] = errors
print(json.dumps(result))
"""


def on_8_devices(script: str, *args: str) -> dict:
    """The JSON that `script` prints last, run with `args` in a process with 8 host CPU devices."""
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
    )
    run = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    import transformers

    from tests.test_model import write_random_hf_model

    checkpoint = tmp_path_factory.mktemp("checkpoint")
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8)
    write_random_hf_model(checkpoint, transformers.LlamaConfig, dict(fields, num_key_value_heads=4))
    return on_8_devices(_SCRIPT, str(checkpoint))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "duo"])
def test_sharded_generate_gives_the_single_device_greedy_tokens(sharded, method):
    """(data=2, model=2) and (model=4): the tokens of one device, and its prefill logits to fp32 rounding."""
    assert sharded["mask"] == [3, 0, 1]  # uneven: no mesh size splits these heads evenly
    runs = sharded[method]
    single = runs.pop("single")
    assert len({tuple(t) for t in single}) == 4 and all(len(t) == 12 for t in single)
    gathered, whole = runs.pop("gathered"), runs.pop("whole_gathered")
    assert gathered and not whole, f"a step all-gathers a whole weight or cache array: {whole}"
    for mesh, run in runs.items():
        assert run["tokens"] == single, mesh
        assert run["logits_err"] < 1e-4, (mesh, run["logits_err"])
    # The retrieval slots split over model, the streaming partition replicated over it, the batch over data.
    assert runs["data=2,model=2"]["device_cache"] < runs["data=2,model=2"]["cache"] / 2
    if method == "full":  # every head a retrieval head: the whole cache splits data x model ways
        assert runs["data=2,model=2"]["device_cache"] == runs["data=2,model=2"]["cache"] // 4
        assert runs["data=1,model=4"]["device_cache"] == runs["data=1,model=4"]["cache"] // 4


@pytest.mark.slow
@pytest.mark.parametrize("run", ["int8 weights, int8 full", "int8 weights, int4 duo"])
def test_int8_weights_and_a_quantized_cache_on_a_mesh_give_the_single_device_tokens(sharded, run):
    """int8 weights (codes split with their weights, per-channel scales along the output axes) and an int8 / int4
    KV cache (codes and scales split as the cache is) on (data=2, model=2) and (model=4): one device's tokens of
    the same quantized model, its prefill logits to the rounding of a code, and no step gathering a whole array."""
    r = sharded[run]
    assert r["tokens"] == r["single"] != r["unquantized"]  # quantization changed the tokens; the mesh did not
    assert r["logits_err"] < 2e-3, r["logits_err"]  # a code rounded the other way; a wrong scale would be O(1)
    assert r["gathered"] and not r["whole_gathered"], r["whole_gathered"]
    assert r["device_weights"] < 0.6 * r["weights"]  # the codes and the output scales split over model
    assert r["device_cache"] <= r["cache"] // 2


@pytest.mark.slow
@pytest.mark.parametrize("weights", [None, "int8"])
def test_weights_loaded_into_the_mesh_layout_are_run_without_a_copy(sharded, weights):
    """`load(shardings=tensor_parallel_shardings)`: each device's slices read straight into place; the engine on
    that mesh holds the loaded arrays themselves (one copy of the weights), and generates one device's tokens."""
    r = sharded[f"loaded {weights}"]
    assert not r["copied"] and all(r["kept"]) and len(r["kept"]) == (21 if weights is None else 37)
    assert r["split"] >= 2 * 7  # every matmul weight of both layers (int8: codes, and the output scales)
    assert r["equal"]  # the values of a load onto one device
    assert r["tokens"] == r["single"]


@pytest.mark.slow
def test_the_planner_on_a_mesh_counts_one_devices_arrays(sharded):
    """`plan(mesh="data=2,model=2")`: the weights and the duo cache (one sequence per data slot) at its largest
    context are the bytes one device holds of the arrays built on that mesh, and with the temp memory of the steps
    compiled there they fit its budget."""
    r = sharded["plan"]
    context = r["duo_max_context"]
    assert context and context % 128 == 0 and r["duo_temp_bytes"] > 0
    assert r["weight_bytes"] == r["built_weights"]
    assert r["duo_cache_fixed_bytes"] + r["duo_cache_bytes_per_token"] * context == r["built_cache"]
    temp = r["duo_temp_bytes"] + r["duo_temp_bytes_per_token"] * (context - 1024)  # measured from 1024 tokens up
    assert r["weight_bytes"] + r["built_cache"] + temp <= r["hbm_bytes"]


@pytest.mark.slow
def test_a_streaming_chunk_on_a_mesh_gives_its_chunks_tokens(sharded):
    """duo with streaming_chunk=8 in chunks of 16 on (data=2, model=2): one device's tokens in chunks of 8."""
    runs = sharded["streaming_chunk"]
    assert runs["sharded"] == runs["eights"] != runs["sixteens"]


@pytest.mark.slow
def test_weights_are_split_over_the_model_axis(sharded):
    """Per device: 1/model of every tensor-parallel weight (from the arrays' shards), norms whole."""
    weights = sharded["weights"]
    split = {w["name"] for w in weights if w["sharded"]}
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert sum(f".{name}" in n for n in split) == 3, name  # in each of the 3 layers
    assert ".embed" in split and not any("norm" in n for n in split)
    for w in weights:
        assert w["devices"] == 8
        assert w["shards"] == [w["nbytes"] // 4 if w["sharded"] else w["nbytes"]], w
    replicated = sum(w["nbytes"] for w in weights if not w["sharded"])
    total = sum(w["nbytes"] for w in weights)
    assert sharded["per_device"] == [(total - replicated) // 4 + replicated] * 8
    assert sharded["helper"] == sharded["per_device"][0]


@pytest.mark.slow
def test_a_batch_that_does_not_split_over_data_is_padded(sharded):
    """Three prompts on data=2 (an error before): run as 4 rows, each prompt's tokens as in a batch of its own."""
    three = sharded["three"]
    assert three["tokens"] == three["single"] and three["rows"] == 4


def test_mesh_errors_name_the_problem(sharded):
    errors = sharded["errors"]
    assert "'h2o' does not run on a device mesh" in errors["method"]
    assert "model=3 must divide the query heads (8)" in errors["heads"]
    assert "generation needs a mesh with axes ('data', 'model')" in errors["axes"]
    assert "kv_dtype must be None (the model's dtype), 'int8' or 'int4', got 'fp8'" in errors["kv_dtype"]
    assert "the weights are laid out over 4 devices, as loaded for a mesh: generate on that mesh" in errors["spread"]


def test_parse_generation_mesh():
    assert sharding.parse_mesh("data=2,model=4", sharding.GENERATION_AXES) == {"data": 2, "model": 4}
    assert sharding.parse_mesh("model=8", sharding.GENERATION_AXES) == {"data": 1, "model": 8}
    for bad in ("fsdp=2", "model=0", "model=2,model=2"):
        with pytest.raises(sharding.MeshError, match="data=2,model=2"):
            sharding.parse_mesh(bad, sharding.GENERATION_AXES)
    with pytest.raises(sharding.MeshError, match="needs 8 devices"):
        sharding.make_generation_mesh(data=2, model=4, devices=[object()])


def test_infer_mesh_error_is_one_line():
    run = subprocess.run(
        [sys.executable, str(REPO / "infer.py"), "--mesh", "data=2,model=4", "--prompt", "hi"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags()),
    )
    assert run.returncode == 2 and run.stderr.startswith("error: mesh data=2,model=4 needs 8 devices"), run.stderr


_MAKE_MESH_SCRIPT = r"""
import json
import jax
from jax.sharding import AxisType
import duo_jax
from duo_jax import sharding
from tests.conftest import tiny_config

config = tiny_config(num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8)
model = duo_jax.Model(config, duo_jax.init_params(config, jax.random.key(0), scale=0.1), None, "random")
prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10], [11, 12, 13, 14]]
options = dict(max_new_tokens=4, chunk_size=8, stop_at_eos=False)
result = {"project": duo_jax.generate(model, prompts, mesh=sharding.make_generation_mesh(data=2, model=4),
                                      **options).tokens}
for kind in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
    result[kind.name] = duo_jax.generate(model, prompts, mesh=mesh, **options).tokens
print(json.dumps(result))
"""


@pytest.mark.slow
def test_a_mesh_from_jax_make_mesh_works_with_explicit_or_auto_axes():
    """jax.make_mesh's default (Explicit) axes and Auto ones give the tokens of make_generation_mesh's mesh."""
    result = on_8_devices(_MAKE_MESH_SCRIPT)
    assert result["Explicit"] == result["Auto"] == result["project"]


def test_a_mesh_with_manual_axes_is_refused_by_name():
    import jax
    from jax.sharding import AxisType, Mesh

    mesh = Mesh(
        np.asarray(jax.devices()[:1]).reshape(1, 1),
        sharding.GENERATION_AXES,
        axis_types=(AxisType.Manual, AxisType.Auto),
    )
    with pytest.raises(sharding.MeshError, match="Manual axes"):
        sharding.auto_axes(mesh)

"""Loader paths and loader errors: every failure names the problem and the fix."""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import duo_jax
from duo_jax.errors import ConfigError, DuoJaxError, LoadError, WeightsNotFoundError
from duo_jax.loading import find_weights, safetensors_tensors
from tests.test_model import HF_CASES, write_random_hf_model

CASE = HF_CASES["llama-gqa-llama3-rope-untied"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    write_random_hf_model(directory, *CASE)
    return directory


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded")
    write_random_hf_model(directory, *CASE, max_shard_size="40KB")
    return directory


@pytest.mark.parametrize(
    "dtype, message",
    [
        (jnp.int8, "dtype must be one of .* for int8 weights pass weights='int8'"),  # cast the weights to int8 before
        ("bf17", "dtype must be one of bfloat16, float16, float32, float64, got 'bf17'"),
        (np.float64, "jax_enable_x64"),  # loaded as float32 before
    ],
)
def test_a_dtype_that_is_not_a_float_jax_computes_in_is_refused(hf_dir, dtype, message):
    with pytest.raises(DuoJaxError, match=message):
        duo_jax.load(hf_dir, dtype=dtype)


def test_missing_directory():
    with pytest.raises(WeightsNotFoundError, match="no such file or directory"):
        duo_jax.load("/nonexistent/model-dir")


def test_directory_without_config(tmp_path):
    with pytest.raises(WeightsNotFoundError, match="no config.json"):
        duo_jax.load(tmp_path)


def test_directory_without_weights(tmp_path, hf_dir):
    shutil.copy(hf_dir / "config.json", tmp_path)
    with pytest.raises(WeightsNotFoundError, match="model.safetensors"):
        duo_jax.load(tmp_path)


def test_missing_shard(tmp_path, sharded_dir):
    shutil.copytree(sharded_dir, tmp_path / "m")
    shard = sorted((tmp_path / "m").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(LoadError, match=f"shard {shard.name} .* is missing"):
        duo_jax.load(tmp_path / "m")


def test_config_weights_shape_mismatch(tmp_path, hf_dir):
    shutil.copytree(hf_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["intermediate_size"] = 96  # the checkpoint was written with 112
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"mlp\.(gate|up|down)_proj.*has shape .* but the config expects"):
        duo_jax.load(tmp_path / "m")


def test_config_with_fewer_layers_than_weights(tmp_path, hf_dir):
    shutil.copytree(hf_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="beyond the config's 1 layers"):
        duo_jax.load(tmp_path / "m")


def test_missing_tensor_is_named(tmp_path, hf_dir):
    from safetensors.numpy import save_file

    shutil.copy(hf_dir / "config.json", tmp_path)
    tensors = {
        n: np.array(w)
        for n, w in safetensors_tensors(hf_dir / "model.safetensors")
        if n != "model.layers.1.mlp.up_proj.weight"
    }
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(LoadError, match=r"missing, e\.g\. model\.layers\.1\.mlp\.up_proj\.weight"):
        duo_jax.load(tmp_path)


def test_missing_lm_head_of_an_untied_config_hints_at_tying(tmp_path, hf_dir):
    """A checkpoint that ties its embeddings under a config that says it does not: the error names the fix."""
    from safetensors.numpy import save_file

    shutil.copy(hf_dir / "config.json", tmp_path)
    tensors = {n: np.array(w) for n, w in safetensors_tensors(hf_dir / "model.safetensors") if n != "lm_head.weight"}
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(LoadError, match=r"e\.g\. lm_head\.weight; .*set tie_word_embeddings to true in config\.json"):
        duo_jax.load(tmp_path)


def test_unknown_name():
    with pytest.raises(ConfigError, match="unknown model name 'llama-9000'.*smollm2-135m"):
        duo_jax.load("llama-9000")
    with pytest.raises(duo_jax.DuoJaxError, match="no model given"):  # was "`.` has no config.json"
        duo_jax.load("")


def test_named_model_without_weights_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("DUO_JAX_MODELS", str(tmp_path / "models"))
    with pytest.raises(WeightsNotFoundError) as err:
        duo_jax.load("llama3-8b")
    message = str(err.value)
    assert "meta-llama/Meta-Llama-3-8B-Instruct" in message
    assert str(tmp_path / "models" / "llama3-8b") in message
    assert "models--meta-llama--Meta-Llama-3-8B-Instruct" in message
    assert "DUO_JAX_MODELS" in message


def test_named_model_from_env_dir(tmp_path, monkeypatch, hf_dir):
    shutil.copytree(hf_dir, tmp_path / "models" / "llama3-8b")
    monkeypatch.setenv("DUO_JAX_MODELS", str(tmp_path / "models"))
    assert find_weights("llama3-8b") == tmp_path / "models" / "llama3-8b"


def _tiny_named(monkeypatch, tmp_path, hf_dir, name: str, repo: str) -> None:
    """A named config `name` of the tiny model `hf_dir` (its config.json), from the Hub repo `repo`."""
    import duo_jax.config

    folder = tmp_path / "configs"
    folder.mkdir()
    entry = dict(hf_repo=repo, config=json.loads((hf_dir / "config.json").read_text()))
    (folder / f"{name}.json").write_text(json.dumps(entry))
    monkeypatch.setattr(duo_jax.config, "CONFIGS_DIR", folder)


def test_named_model_from_hf_cache(tmp_path, monkeypatch, hf_dir):
    _tiny_named(monkeypatch, tmp_path, hf_dir, "tiny-llama", "meta-llama/Meta-Llama-3-8B-Instruct")
    repo = tmp_path / "hub" / "models--meta-llama--Meta-Llama-3-8B-Instruct"
    shutil.copytree(hf_dir, repo / "snapshots" / "abc123")
    (repo / "snapshots" / "old000").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.delenv("DUO_JAX_MODELS", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = duo_jax.load("tiny-llama", dtype=jnp.float32)
    assert model.source == str(repo / "snapshots" / "abc123")
    assert model.config.name == "tiny-llama" and model.config.num_layers == 2


def test_explicit_path_for_a_named_model(tmp_path, monkeypatch, hf_dir):
    _tiny_named(monkeypatch, tmp_path, hf_dir, "tiny-llama", "me/tiny")
    model = duo_jax.load("tiny-llama", dtype=jnp.float32, path=hf_dir)
    assert model.config.name == "tiny-llama" and model.config.hidden_size == 64


def test_weights_of_another_model_under_a_name_are_refused(tmp_path, hf_dir):
    """Loaded as "llama3.1-8b", the tiny model ran under that name, with its shipped pattern where the shapes fit
    (Llama 3.1 weights under "llama3-8b" would have: same shapes, other context and RoPE)."""
    with pytest.raises(LoadError, match="as 'llama3.1-8b' but holds another model: vocab_size 128 .*hidden_size 64"):
        duo_jax.load("llama3.1-8b", dtype=jnp.float32, path=hf_dir)
    folder = tmp_path / "llama3-8b"
    shutil.copytree(hf_dir, folder)
    real = json.loads((duo_jax.config.CONFIGS_DIR / "llama3.1-8b.json").read_text())["config"]
    (folder / "config.json").write_text(json.dumps(real))  # Llama 3.1's config (its weights not read: refused first)
    with pytest.raises(LoadError, match="as 'llama3-8b' but holds another model: rope_scaling .*max_position_emb"):
        duo_jax.load("llama3-8b", path=folder)


def test_tokenizer_json_is_loaded_and_missing_tokenizer_is_none(tmp_path, hf_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert duo_jax.load(hf_dir, dtype=jnp.float32).tokenizer is None
    shutil.copytree(hf_dir, tmp_path / "m")
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "world": 6}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "m" / "tokenizer.json"))
    tokenizer = duo_jax.load(tmp_path / "m", dtype=jnp.float32).tokenizer
    assert tokenizer.encode("hello world") == [5, 6]


def test_text_api_without_tokenizer_is_a_clear_error():
    from duo_jax.tokenizer import require

    with pytest.raises(LoadError, match="needs a tokenizer.*pass token ids"):
        require(None, "generating from text")


def test_non_llama_checkpoint_is_rejected(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        duo_jax.load(tmp_path)


def test_a_block_reads_only_the_bytes_that_hold_it(tmp_path, monkeypatch):
    """`load(..., shardings=)` builds each device's block with `_ParamsBuilder._block`: for every weight of a
    model with biases and any mesh-like split (one axis halved) or random box, the plain load's values, read
    from the file by safetensors slices of exactly the block's bytes (the whole heads touched, when the split
    cuts a head's inner dimension)."""
    from duo_jax import loading

    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        max_position_embeddings=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    write_random_hf_model(tmp_path, transformers.Qwen2Config, fields)  # q / k / v biases
    model = duo_jax.load(
        tmp_path, dtype=jnp.float32, layout="stacked"
    )  # equal to transformers' (test_model, test_qwen_gguf)
    builder = loading._ParamsBuilder(model.config, np.float32, str(tmp_path))
    for name, tensor in safetensors_tensors(tmp_path / "model.safetensors"):
        builder.put(name, tensor)
    reads = []
    read = loading._SafetensorsTensor.__getitem__
    monkeypatch.setattr(
        loading._SafetensorsTensor, "__getitem__", lambda self, index: reads.append(read(self, index)) or reads[-1]
    )
    head_inner_axis = dict(wq=3, wk=3, wv=3, wo=2, bq=2, bk=2, bv=2)  # E, of [L, D, H, E], [L, H, E, D], [L, H, E]
    rng = np.random.default_rng(0)
    assert {"bq", "lm_head"} <= set(builder.shapes)
    for field, shape in builder.shapes.items():
        layers = model.params if field in ("embed", "final_norm", "lm_head") else model.params.layers
        whole = np.asarray(getattr(layers, field))
        for axis in range(len(shape)):
            index = tuple(slice(d // 2, d) if a == axis else slice(None) for a, d in enumerate(shape))
            reads.clear()
            block = builder._block(field, index)
            np.testing.assert_array_equal(block, whole[index], err_msg=f"{field} axis {axis}")
            exact = head_inner_axis.get(field) != axis
            assert sum(r.nbytes for r in reads) == (block.nbytes if exact else whole.nbytes), (field, axis)
        for _ in range(3):
            starts = [int(rng.integers(0, d)) for d in shape]
            index = tuple(slice(s, int(rng.integers(s + 1, d + 1))) for s, d in zip(starts, shape))
            np.testing.assert_array_equal(builder._block(field, index), whole[index], err_msg=f"{field} {index}")


def test_layouts_hold_the_same_weights_and_compute_the_same(hf_dir):
    """layout="per_layer" (the default) and "stacked" load the same numbers; forward (a Python loop over the
    layers, or a scan) and int8 quantization agree across them; the conversions are each other's inverse."""
    import jax

    from duo_jax.model import quantize_weights, stack_layers, unstack_layers

    per_layer = duo_jax.load(hf_dir, dtype=jnp.float32)
    stacked = duo_jax.load(hf_dir, dtype=jnp.float32, layout="stacked")
    assert isinstance(per_layer.params.layers, tuple) and len(per_layer.params.layers) == per_layer.config.num_layers
    jax.tree.map(np.testing.assert_array_equal, stack_layers(per_layer.params), stacked.params)
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(stacked.params), per_layer.params)
    assert unstack_layers(per_layer.params) is per_layer.params and stack_layers(stacked.params) is stacked.params
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, per_layer.config.vocab_size, (2, 24)), jnp.int32)
    ref = duo_jax.forward(stacked.params, stacked.config, tokens)
    assert np.abs(np.asarray(ref)).max() > 0.1
    np.testing.assert_allclose(duo_jax.forward(per_layer.params, per_layer.config, tokens), ref, rtol=1e-5, atol=1e-5)
    # int8 per layer keeps a scale per output channel as stacked int8 does (the shapes say which axes were
    # reduced; `tests/test_int8_weights.py` checks the numbers)
    assert jax.eval_shape(quantize_weights, per_layer.params) == jax.eval_shape(
        lambda p: unstack_layers(quantize_weights(p)), stacked.params
    )
    with pytest.raises(duo_jax.DuoJaxError, match="layout must be one of"):
        duo_jax.load(hf_dir, layout="scanned")
    with pytest.raises(LoadError, match=r"must return a Params of shardings .*\(layout='per_layer'\), got NoneType"):
        duo_jax.load(hf_dir, shardings=lambda shapes: None)  # an AttributeError
    with pytest.raises(LoadError, match=r"laid out as the shapes it is given \(layout='per_layer'\), got Params"):
        duo_jax.load(
            hf_dir, shardings=lambda shapes: jax.eval_shape(stack_layers, shapes)
        )  # stacked shardings for per-layer shapes
    from functools import partial

    from duo_jax import sharding

    mesh = sharding.make_generation_mesh(devices=jax.devices()[:1])
    tensor_parallel = partial(sharding.tensor_parallel_shardings, mesh=mesh)
    with pytest.raises(LoadError, match=r"got Params of 1 layers \(the model has 2\)"):  # an IndexError
        duo_jax.load(
            hf_dir, shardings=lambda shapes: dataclasses.replace(p := tensor_parallel(shapes), layers=p.layers[:1])
        )
    with pytest.raises(LoadError, match="Params of jax.sharding.Sharding .*got a (P|PartitionSpec) for"):  # a TypeError
        duo_jax.load(hf_dir, shardings=partial(sharding.tensor_parallel_specs, mesh=mesh))
    with pytest.raises(LoadError, match="got a ShapeDtypeStruct for"):  # the shapes themselves: a TypeError
        duo_jax.load(hf_dir, shardings=lambda shapes: shapes)
    with pytest.raises(sharding.MeshError, match="lays out per-layer weights"):  # 'LayerParams' is not iterable
        duo_jax.load(hf_dir, shardings=tensor_parallel, layout="stacked")


# A llama GGUF's architecture metadata (llama.cpp's keys), as the shipped SmolLM2 file has them, at a tiny shape.
GGUF_FIELDS = {
    "general.architecture": "llama",
    "llama.vocab_size": 128,
    "llama.context_length": 256,
    "llama.embedding_length": 64,
    "llama.block_count": 2,
    "llama.feed_forward_length": 112,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.rope.freq_base": 10000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.dimension_count": 16,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"llama.expert_count": 8, "llama.expert_used_count": 2}, "mixture of experts"),  # Mixtral converts as llama
        ({"llama.rope.dimension_count": 8}, "rotates 8 of each head's 16 channels"),
        ({"llama.attention.value_length": 32}, "values have 32 channels and its keys 16"),
    ],
)
def test_gguf_metadata_the_decoder_does_not_compute_is_refused(change, message):
    """llama.cpp metadata that changes the math: a mixture of experts, partial RoPE, values wider than keys (before,
    a missing tensor or a shape error at best, silently wrong logits at worst)."""
    from duo_jax.loading import _gguf_config

    with pytest.raises(ConfigError, match=message):
        _gguf_config({**GGUF_FIELDS, **change}, set(), "x")


def test_gguf_metadata_duo_jax_does_not_know_is_named_in_a_warning(recwarn):
    from duo_jax.loading import _gguf_config

    _gguf_config(GGUF_FIELDS, set(), "x")  # what the shipped file holds: no warning
    assert not [w for w in recwarn if "GGUF" in str(w.message)]
    with pytest.warns(UserWarning, match=r"sets llama.attention.clamp_kqv, llama.logit_scale, which duo-jax does"):
        config = _gguf_config({**GGUF_FIELDS, "llama.logit_scale": 0.5, "llama.attention.clamp_kqv": 8.0}, set(), "x")
    assert config.head_dim == 16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"llama.attention.head_count": 0}, r"llama\.attention\.head_count must be a positive integer, got 0"),
        (
            {"llama.rope.scaling.type": "linear"},
            r"sets llama\.rope\.scaling\.type linear but no llama\.rope\.scaling\.factor",
        ),
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, "rope_scaling factor must be"),
        # checked in from_hf, which named the Hugging Face field alone
        ({"llama.attention.layer_norm_rms_epsilon": 0.0}, "rms_norm_eps is the GGUF's llama.attention.layer_norm_rms_"),
        ({"llama.attention.head_count_kv": 3}, r"num_kv_heads is the GGUF's llama\.attention\.head_count_kv"),
        ({"llama.block_count": -1}, r"num_layers must be a positive integer, got -1 \(num_layers is the GGUF's llama"),
        # was 'rotates 16 of each head's 0 channels (partial RoPE)'
        ({"llama.attention.key_length": 0}, r"llama\.attention\.key_length must be a positive integer, got 0"),
    ],
)
def test_broken_gguf_metadata_names_the_gguf_key(change, message):
    """A ZeroDivisionError, and an error blaming config.json, before."""
    from duo_jax.loading import _gguf_config

    with pytest.raises(ConfigError, match=message) as err:
        _gguf_config({**GGUF_FIELDS, **change}, set(), "x")
    assert "config.json" not in str(err.value)

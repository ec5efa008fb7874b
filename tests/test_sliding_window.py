"""Models with a sliding window (Mistral v0.1 style) through the engine: the same logits and greedy tokens as
Hugging Face transformers, chunked prefill included; methods that cannot honour the window refuse it."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import duo_jax
from duo_jax.errors import DuoJaxError
from duo_jax.generation import generate
from duo_jax.methods import make_method
from duo_jax.pattern import Pattern
from tests.conftest import run_method
from tests.test_model import TINY, hf_logits, write_random_hf_model

WINDOW = 8
FIELDS = dict(TINY, num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
              tie_word_embeddings=False, rope_theta=1e6)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral-window")
    hf_model = write_random_hf_model(directory, transformers.MistralConfig, FIELDS)
    return hf_model, duo_jax.load(directory, dtype=jnp.float32)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(3).integers(0, FIELDS["vocab_size"], 29).tolist()


def test_config_reads_the_window(models):
    assert models[1].config.sliding_window == WINDOW


@pytest.mark.parametrize("chunk", [5, 29])
def test_engine_logits_match_transformers(models, prompt, chunk):
    hf_model, model = models
    method = make_method("full", model.config, context=64)
    sequence, logits, _, _ = run_method(model.params, model.config, method, prompt, chunk=chunk, decode_steps=6)
    ref = hf_logits(hf_model, np.asarray([sequence[:-1]]))[0]
    assert np.abs(ref).max() > 1.0
    np.testing.assert_array_less(np.abs(logits[: len(ref)] - ref).max(), 1e-4)
    # the window matters: without it the logits past the window differ
    unwindowed = duo_jax.forward(model.params, dataclasses.replace(model.config, sliding_window=None),
                                 jnp.asarray([sequence[:-1]]))
    assert np.abs(np.asarray(unwindowed)[0, WINDOW + 1:] - ref[WINDOW + 1:]).max() > 1e-2


def test_generate_matches_transformers_greedy(models, prompt):
    hf_model, model = models
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                               pad_token_id=0)
    out = generate(model, prompt, max_new_tokens=10, chunk_size=7, stop_at_eos=False)
    assert out.tokens[0] == hf[0, len(prompt):].tolist()


def test_duo_streaming_heads_keep_the_window(models, prompt):
    """Every head streaming with sink + recent covering the sequence is full attention: the window still applies."""
    _, model = models
    pattern = Pattern.full(model.config.num_layers, model.config.num_kv_heads)
    duo = make_method("duo", model.config, context=64, pattern=pattern, sparsity=1.0, sink=4, recent=60)
    _, logits, _, _ = run_method(model.params, model.config, duo, prompt, chunk=6, decode_steps=0)
    ref = np.asarray(duo_jax.forward(model.params, model.config, jnp.asarray([prompt])))[0]
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)


@pytest.mark.parametrize("name", ["h2o", "tova", "snapkv"])
def test_methods_without_window_support_refuse(models, prompt, name):
    _, model = models
    with pytest.raises(DuoJaxError, match="sliding window"):
        generate(model, prompt, method=name, kv_budget=40, max_new_tokens=2)

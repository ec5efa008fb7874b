"""generate(): batching, patterns, sampling, compilation and argument errors on a tiny random model."""

import jax
import numpy as np
import pytest

import duo_jax
from duo_jax.errors import DuoJaxError, LoadError
from duo_jax.generation import generate
from duo_jax.model import greedy_reference
from duo_jax.pattern import Pattern, PatternError
from tests.conftest import tiny_config

CONFIG = tiny_config(num_layers=3, max_position_embeddings=256)
GATES = np.array([[0.9, 0.1], [0.2, 0.3], [0.05, 0.8]])  # sparsity 0.5 -> 3 retrieval heads, mixed layers


@pytest.fixture(scope="module")
def model():
    return duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(1), scale=0.2), None, "random")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (30, 17, 41)]


def test_full_attention_is_plain_greedy_decoding(model, prompts):
    out = generate(model, prompts[0], max_new_tokens=10, chunk_size=8, stop_at_eos=False)
    assert out.tokens == [greedy_reference(model.params, CONFIG, prompts[0], 10)]
    assert out.text is None
    assert out.stats["cache_bytes"] == out.stats["full_cache_bytes"] == out.stats["expected_cache_bytes"]


def test_sparsity_zero_is_full_attention(model, prompts):
    full = generate(model, prompts[0], max_new_tokens=10, chunk_size=8, stop_at_eos=False)
    duo = generate(model, prompts[0], pattern=Pattern(GATES), sparsity=0.0, sink=1, recent=2, max_new_tokens=10,
                   chunk_size=8, stop_at_eos=False)
    assert duo.tokens == full.tokens


def test_duo_saves_memory_and_changes_the_output(model, prompts):
    kwargs = dict(max_new_tokens=10, chunk_size=8, stop_at_eos=False, sink=2, recent=4)
    duo = generate(model, prompts[2], pattern=Pattern(GATES), sparsity=0.5, **kwargs)
    streaming = generate(model, prompts[2], pattern=Pattern(GATES), sparsity=1.0, **kwargs)
    full = generate(model, prompts[2], **kwargs)
    assert duo.stats["retrieval_heads"] == 3 and streaming.stats["retrieval_heads"] == 0
    assert streaming.stats["cache_bytes"] < duo.stats["cache_bytes"] < full.stats["cache_bytes"]
    assert duo.stats["cache_bytes"] == duo.stats["expected_cache_bytes"]
    assert streaming.tokens != full.tokens  # a 6-token window on random weights changes the continuation


@pytest.mark.parametrize("pattern", [None, Pattern(GATES)])
def test_batch_of_different_lengths_equals_each_alone(model, prompts, pattern):
    kwargs = dict(pattern=pattern, sink=2, recent=5, max_new_tokens=8, chunk_size=8, stop_at_eos=False)
    batch = generate(model, prompts, **kwargs)
    alone = [generate(model, p, **kwargs).tokens[0] for p in prompts]
    assert batch.tokens == alone


def test_stops_at_eos(model, prompts):
    first = generate(model, prompts[1], max_new_tokens=6, stop_at_eos=False).tokens[0]
    eos_model = duo_jax.Model(CONFIG.__class__(**{**vars(CONFIG), "eos_token_ids": (first[2],)}), model.params,
                              None, "random")
    out = generate(eos_model, prompts[1], max_new_tokens=6)
    assert out.tokens[0] == first[: first.index(first[2]) + 1]


def test_sampling_is_seeded_and_top_k_one_is_greedy(model, prompts):
    greedy = generate(model, prompts[0], max_new_tokens=8, stop_at_eos=False).tokens
    assert generate(model, prompts[0], max_new_tokens=8, temperature=1.0, top_k=1, seed=3,
                    stop_at_eos=False).tokens == greedy
    a = generate(model, prompts[0], max_new_tokens=8, temperature=2.0, seed=1, stop_at_eos=False).tokens
    b = generate(model, prompts[0], max_new_tokens=8, temperature=2.0, seed=1, stop_at_eos=False).tokens
    c = generate(model, prompts[0], max_new_tokens=8, temperature=2.0, seed=2, stop_at_eos=False).tokens
    assert a == b and a != c
    nucleus = generate(model, prompts[0], max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=5,
                       stop_at_eos=False).tokens
    assert nucleus == greedy  # the smallest nucleus is the argmax token


def test_decode_does_not_recompile_as_the_sequence_grows(model, prompts):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    generate(model, prompts[0], max_new_tokens=4, chunk_size=8, stop_at_eos=False)  # compiles
    before = len(compiles)
    generate(model, prompts[0], max_new_tokens=40, chunk_size=8, stop_at_eos=False)  # 36 more steps
    assert len(compiles) == before
    generate(model, prompts[0], max_new_tokens=4, chunk_size=8, stop_at_eos=False, context=300)
    assert len(compiles) > before  # the counter works: a new capacity is a new executable


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(pattern=Pattern(GATES), sparsity=1.5), PatternError, r"\[0, 1\]"),
    (dict(pattern=Pattern(GATES), sparsity=-0.1), PatternError, r"\[0, 1\]"),
    (dict(pattern=Pattern(np.ones((4, 2)))), PatternError, "4x2.*3x2"),
    (dict(chunk_size=0), DuoJaxError, "chunk_size must be positive"),
    (dict(sink=-1), DuoJaxError, "sink and recent must be >= 0"),
    (dict(recent=-5), DuoJaxError, "sink and recent must be >= 0"),
    (dict(max_new_tokens=250), DuoJaxError, "exceeds the model's context of 256"),
    (dict(context=32), DuoJaxError, "exceeds the cache capacity"),
    (dict(max_new_tokens=0), DuoJaxError, "max_new_tokens must be positive"),
    (dict(top_p=0.0), DuoJaxError, "top_p"),
])
def test_bad_arguments_are_clear_errors(model, prompts, kwargs, error, message):
    with pytest.raises(error, match=message):
        generate(model, prompts[0], **kwargs)


def test_bad_prompts_are_clear_errors(model):
    with pytest.raises(DuoJaxError, match="empty"):
        generate(model, [[]])
    with pytest.raises(DuoJaxError, match=r"token ids must lie in \[0, 128\)"):
        generate(model, [5, 900])
    with pytest.raises(LoadError, match="needs a tokenizer"):
        generate(model, "hello")

"""Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm) and Llama 3.2 (tied embeddings + llama3 RoPE) against
Hugging Face transformers on random tiny checkpoints: logits through `forward` and greedy tokens through
`generate` (chunked prefill + decode), full and DuoAttention; DuoAttention with streaming heads against the float64
reference decoder."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import duo_jax
from duo_jax.generation import generate
from duo_jax.pattern import Pattern
from tests.test_model import TINY, hf_logits, write_random_hf_model

FAMILIES = {
    "qwen2": (
        transformers.Qwen2Config,
        dict(TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        dict(
            TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, rope_theta=1e6
        ),
    ),
    "llama3.2": (
        transformers.LlamaConfig,
        dict(
            TINY,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    config_cls, fields = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = write_random_hf_model(directory, config_cls, fields)
    return request.param, hf_model, duo_jax.load(directory, dtype=jnp.float32)


def test_config_switches(family):
    name, _, model = family
    assert model.config.qkv_bias == (name == "qwen2")
    assert model.config.qk_norm == (name == "qwen3")
    assert model.config.sliding_window is None  # Qwen configs carry a window they do not use


def test_logits_match_transformers(family):
    _, hf_model, model = family
    tokens = np.random.default_rng(1).integers(0, TINY["vocab_size"], (2, 50)).astype(np.int32)
    ours = np.asarray(duo_jax.forward(model.params, model.config, jnp.asarray(tokens)))
    ref = hf_logits(hf_model, tokens)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_array_less(np.abs(ours - ref).max(), 1e-4)


def test_a_llama_configs_sliding_window_is_not_applied(tmp_path):
    """transformers' Llama attention ignores a config's sliding_window (its forward attends to every earlier token);
    duo-jax applied it, logits off from position 16 on. (Its own cached generate builds a sliding cache from the key:
    transformers disagrees with itself there, so the logits are the reference.)"""
    fields = dict(TINY, num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    hf_model = write_random_hf_model(tmp_path, transformers.LlamaConfig, fields)
    model = duo_jax.load(tmp_path, dtype=jnp.float32)
    assert model.config.sliding_window is None
    tokens = np.random.default_rng(3).integers(0, TINY["vocab_size"], (1, 50)).astype(np.int32)
    ours = np.asarray(duo_jax.forward(model.params, model.config, jnp.asarray(tokens)))
    np.testing.assert_array_less(np.abs(ours - hf_logits(hf_model, tokens)).max(), 1e-4)


@pytest.mark.slow
def test_generate_matches_transformers_greedy(family):
    _, hf_model, model = family
    prompt = np.random.default_rng(2).integers(0, TINY["vocab_size"], 23).tolist()
    with torch.no_grad():
        hf = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0
        )
    expected = hf[0, len(prompt) :].tolist()
    assert generate(model, prompt, max_new_tokens=10, chunk_size=8, stop_at_eos=False).tokens[0] == expected
    # DuoAttention with reordered heads (biases move with their heads) and windows covering the sequence
    gates = np.random.default_rng(3).random((model.config.num_layers, model.config.num_kv_heads))
    duo = generate(
        model,
        prompt,
        pattern=Pattern(gates),
        sparsity=0.5,
        sink=4,
        recent=64,
        max_new_tokens=10,
        chunk_size=8,
        stop_at_eos=False,
    )
    assert duo.tokens[0] == expected


def test_duo_with_streaming_heads_matches_the_float64_reference(family):
    """DuoAttention whose streaming heads do stream (a ring of 2 + 5 under a 29-token sequence), with each family's
    switches (Qwen2's q/k/v biases, Qwen3's q/k norms, Llama 3.2's RoPE scaling and tied head), chunked prefill and
    decode, against the float64 decoder under duo's masks (`tests.reference_decoder`, which shares no attention
    code with the engine). Layer 0 keeps its second head, layer 1 its first: heads are reordered in one of them."""
    from tests.test_engine import reference_logits, run_engine

    _, _, model = family
    mask = np.array([[False, True], [True, False]])
    prompt = np.random.default_rng(4).integers(0, TINY["vocab_size"], 23).tolist()
    sequence, logits = run_engine(model.params, model.config, prompt, mask, sink=2, recent=5, chunk=7, decode_steps=6)
    starts = [(i // 7) * 7 if i < len(prompt) else i for i in range(len(sequence))]
    ref = reference_logits(model.params, model.config, sequence, mask, 2, 5, starts)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4 * max(1.0, np.abs(ref).max()))
    full = reference_logits(model.params, model.config, sequence, np.ones_like(mask), 2, 5, starts)
    assert np.abs(full - ref).max() > 1e-2  # the streaming heads' masks matter


def test_a_tied_model_with_a_different_stored_lm_head_is_refused(tmp_path):
    """tie_word_embeddings with an lm_head.weight in the file that is not the embedding contradicts itself:
    transformers keeps that lm_head (untied, with a warning); duo-jax used the embedding, logits 1.3x off. Now an
    error naming the fix; an lm_head equal to the embedding loads as before."""
    from safetensors.numpy import load_file, save_file

    fields = dict(TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    write_random_hf_model(tmp_path, transformers.LlamaConfig, fields)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    embed = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embed.copy()}, path, metadata={"format": "pt"})
    assert duo_jax.load(tmp_path, dtype=jnp.float32).config.tie_word_embeddings
    save_file({**tensors, "lm_head.weight": embed[::-1].copy()}, path, metadata={"format": "pt"})
    with pytest.raises(duo_jax.DuoJaxError, match="lm_head.weight that differs from it; set tie_word_embeddings"):
        duo_jax.load(tmp_path, dtype=jnp.float32)

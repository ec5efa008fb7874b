"""The rest of duo-jax on tiny random Qwen models: every KV-cache method generates what transformers generates
(budgets that keep every token), HeadKV head scores from transformers' own attention maps (also with a sliding
window on one layer), and gate training through train_gates.py on a Qwen3 with a sliding window on one layer,
writing a pattern that loads and drives generate."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import duo_jax
import train_gates
from duo_jax.generation import generate
from duo_jax.head_scores import prompt_scores
from duo_jax.methods import METHODS, InfiniGen, entry
from duo_jax.pattern import Pattern
from tests.test_model import TINY, write_random_hf_model
from tests.test_training import VOCAB, tiny_tokenizer, write_haystack

FAMILIES = {
    "qwen2": (
        transformers.Qwen2Config,
        dict(
            TINY,
            vocab_size=VOCAB,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=1e6,
        ),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        dict(
            TINY,
            vocab_size=VOCAB,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=True,
            rope_theta=1e6,
        ),
    ),
}
# Qwen3 with a sliding window shorter than the sequences on layer 1 only (layers >= max_window_layers)
FAMILIES["qwen3-window"] = (
    transformers.Qwen3Config,
    dict(FAMILIES["qwen3"][1], use_sliding_window=True, sliding_window=8, max_window_layers=1),
)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (directory, torch model, our fp32 model)}: random tiny checkpoints with a BPE tokenizer.json."""
    out = {}
    for family, (config_cls, fields) in FAMILIES.items():
        directory = tmp_path_factory.mktemp(family)
        hf_model = write_random_hf_model(directory, config_cls, fields)
        tiny_tokenizer().save(str(directory / "tokenizer.json"))
        out[family] = directory, hf_model, duo_jax.load(directory, dtype=jnp.float32)
    return out


def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: transformers would mask the prompt's pad-id tokens otherwise
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_every_kind_of_method_generates_on_qwen3(checkpoints):
    """Budgets at least the sequence keep every token, so every method is full attention and must give
    transformers' greedy tokens. One method per cache kind (tova, pyramidkv and headkv share h2o's and
    snapkv's code paths, tested on Llama in their own files): what differs per family is the shared layer."""
    _, hf_model, model = checkpoints["qwen3"]
    prompt = np.random.default_rng(5).integers(0, VOCAB, 21).tolist()
    expected = hf_greedy(hf_model, prompt)
    L, K = model.config.num_layers, model.config.num_kv_heads
    gates = Pattern(np.random.default_rng(6).random((L, K)))
    scores = Pattern(np.random.default_rng(7).random((L, K)))
    options = {
        "full": {},
        "duo": dict(pattern=gates, sparsity=0.5, sink=4, recent=64),
        "streaming_llm": dict(start=4, recent=64),
        "h2o": dict(kv_budget=64),
        "snapkv": dict(kv_budget=64),
        "duo_headkv": dict(pattern=gates, sparsity=0.5, sink=4, recent=64, scores=scores, kv_budget=64),
    }
    assert set(options) <= set(METHODS) and not any(entry(name).needs_model for name in options)
    for name in options:
        out = generate(
            model,
            prompt,
            method=name,
            max_new_tokens=NEW_TOKENS,
            chunk_size=8,
            stop_at_eos=False,
            context=64,
            **options[name],
        )
        assert out.tokens[0] == expected, name
    infinigen = InfiniGen.calibrate(model.params, model.config, np.asarray(prompt, np.int32), context=64, kv_budget=64)
    out = generate(
        model, prompt, method=infinigen, max_new_tokens=NEW_TOKENS, chunk_size=8, stop_at_eos=False, context=64
    )
    assert out.tokens[0] == expected


@pytest.mark.parametrize("family", list(FAMILIES))
def test_head_scores_match_transformers_attention(checkpoints, family):
    """HeadKV's score from transformers' attention probabilities (eager attention): for each of the n answer
    steps, the attention of its top-n keys that fall in the answer span, / n."""
    _, hf_model, model = checkpoints[family]
    tokens = np.random.default_rng(8).integers(0, VOCAB, 30)
    start, end, n = 19, 24, 5  # answer steps at 24 .. 28: with a window of 8, the span is partly in sight
    ours, predicted = prompt_scores(model.params, jnp.asarray(tokens[None]), start, end, config=model.config, n=n)
    hf_model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = hf_model(torch.as_tensor(tokens[None]), output_attentions=True)
    T = len(tokens)
    ref = np.zeros(np.asarray(ours).shape)
    for layer, probs in enumerate(out.attentions):
        for head, i in np.ndindex(probs.shape[1], T):
            if T - 1 - n <= i < T - 1:
                p = probs[0, head, i].double().numpy()
                top = np.argsort(-p, kind="stable")[:n]
                ref[layer, head] += p[top][(top >= start) & (top < end)].sum() / n
    assert ref.max() > 0.05
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(predicted), out.logits[0, T - 1 - n : T - 1].argmax(-1).numpy())


@pytest.mark.slow
def test_train_gates_on_qwen3_writes_a_pattern_that_drives_generate(checkpoints, tmp_path):
    """On the Qwen3 whose layer 1 has a sliding window (8 tokens) shorter than the training sequences (the
    teacher and the student keep it: tests/test_gates.py); a Λ of 2 sinks + 6 recent tokens within it."""
    directory, hf_model, model = checkpoints["qwen3-window"]
    assert model.config.window_runs() == ((0, 1, None), (1, 2, 8))
    out = tmp_path / "run"
    status = train_gates.main(
        [
            "--model",
            str(directory),
            "--out",
            str(out),
            "--dtype",
            "fp32",
            "--steps",
            "3",
            "--sink",
            "2",
            "--recent",
            "6",
            "--min-len",
            "1",
            "--max-len",
            "200",
            "--num-lengths",
            "1",
            "--num-passkeys",
            "2",
            "--passkey-words",
            "4",
            "--haystack",
            str(write_haystack(tmp_path / "hay")),
        ]
    )
    assert status == 0
    pattern = Pattern.load(out)
    pattern.validate(model.config)
    assert pattern.gates.shape == (2, 2) and pattern.gates.min() < 1.0  # the gates moved
    prompt = np.random.default_rng(9).integers(0, VOCAB, 19).tolist()
    duo = generate(
        model,
        prompt,
        pattern=out,
        sparsity=0.5,
        sink=4,
        recent=64,
        max_new_tokens=NEW_TOKENS,
        chunk_size=8,
        stop_at_eos=False,
    )
    assert duo.tokens[0] == hf_greedy(hf_model, prompt)

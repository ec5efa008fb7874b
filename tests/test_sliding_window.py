"""Models with a sliding window through the engine: on every layer (Mistral v0.1) and on some layers only
(Qwen2's use_sliding_window with max_window_layers). The same logits and greedy tokens as Hugging Face
transformers, chunked prefill included; DuoAttention's streaming heads keep each layer's window; every other
method (eviction, SnapKV's family, HeadKV, InfiniGen) with a budget covering the sequence gives `full`'s logits,
and with a budget of the window (their rule: tokens out of every future window go first) too."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import duo_jax
from duo_jax.config import ModelConfig
from duo_jax.errors import ConfigError, DuoJaxError
from duo_jax.generation import generate
from duo_jax.methods import METHODS as METHOD_NAMES
from duo_jax.methods import entry, make_method
from duo_jax.methods.infinigen import InfiniGen
from duo_jax.pattern import Pattern
from tests.conftest import run_method
from tests.reference_decoder import decode
from tests.test_model import TINY, hf_logits, write_random_hf_model

WINDOW = 8
FIELDS = dict(
    TINY,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=WINDOW,
    tie_word_embeddings=False,
    rope_theta=1e6,
)
# Qwen2 with the window on layers >= max_window_layers only: layer 0 attends to everything, layer 1 within WINDOW.
QWEN_FIELDS = dict(
    TINY,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    rope_theta=1e6,
    use_sliding_window=True,
    sliding_window=WINDOW,
    max_window_layers=1,
)


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


def test_mistral_gguf_reads_the_window(tmp_path):
    """A Mistral written as llama.cpp converts it (architecture llama, Q / K rows permuted, the window as
    `llama.attention.sliding_window`): the window is read onto every layer, and the model is the safetensors
    one: equal config and weights, the same logits, transformers' within 1e-4."""
    from tests.test_qwen_gguf import VOCAB, _tokenizer_fields, _trained_bpe, write_gguf

    hf_model = write_random_hf_model(tmp_path, transformers.MistralConfig, dict(FIELDS, vocab_size=VOCAB))
    path = tmp_path / "tiny-mistral.gguf"
    write_gguf(path, hf_model, "llama", _tokenizer_fields(*_trained_bpe(), pre="llama-bpe"))
    from_dir, from_gguf = duo_jax.load(tmp_path, dtype=jnp.float32), duo_jax.load(path, dtype=jnp.float32)
    g = from_gguf.config
    assert g.sliding_window == WINDOW and g.layer_windows() == (WINDOW, WINDOW)
    assert g == dataclasses.replace(
        from_dir.config,
        name=g.name,
        rms_norm_eps=g.rms_norm_eps,
        bos_token_id=g.bos_token_id,
        eos_token_ids=g.eos_token_ids,
    )
    jax.tree.map(np.testing.assert_array_equal, from_gguf.params, from_dir.params)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 3 * WINDOW)).astype(np.int32)
    ours = np.asarray(duo_jax.forward(from_gguf.params, g, jnp.asarray(tokens)))
    np.testing.assert_array_less(np.abs(ours - hf_logits(hf_model, tokens)).max(), 1e-4)


def test_forward_matches_transformers(models, prompt):
    hf_model, model = models
    ref = hf_logits(hf_model, np.asarray([prompt]))[0]
    ours = np.asarray(duo_jax.forward(model.params, model.config, jnp.asarray([prompt])))[0]
    assert np.abs(ref).max() > 1.0
    np.testing.assert_array_less(np.abs(ours - ref).max(), 1e-4)
    # the window matters: without it the logits past the window differ
    unwindowed = duo_jax.forward(
        model.params, dataclasses.replace(model.config, sliding_window=None), jnp.asarray([prompt])
    )
    assert np.abs(np.asarray(unwindowed)[0, WINDOW + 1 :] - ref[WINDOW + 1 :]).max() > 1e-2


@pytest.mark.slow
def test_generate_matches_transformers_greedy(models, prompt):
    hf_model, model = models
    with torch.no_grad():
        hf = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0
        )
    out = generate(model, prompt, max_new_tokens=10, chunk_size=7, stop_at_eos=False)
    assert out.tokens[0] == hf[0, len(prompt) :].tolist()


# --- every method on a windowed model ---------------------------------------------------------------------

# Every registered method that chooses which tokens to keep: each with a kv_budget but duo and streaming_llm, whose
# windows are sinks + recent tokens (tested above). A new method joins these tests by registering.
METHODS = tuple(n for n in METHOD_NAMES if "kv_budget" in entry(n).options and n not in ("duo", "streaming_llm"))
# ... and those among them whose budget is every head's: not per layer (pyramidkv) or per head (headkv, duo_headkv)
EVEN_BUDGETS = tuple(n for n in METHODS if n not in ("pyramidkv", "headkv", "duo_headkv"))


def build(name, model, budget, *, window=4, alpha=1e9):
    """Method `name` for `model` keeping `budget` tokens per KV head (SnapKV's family: observation window
    `window`; duo_headkv: half the heads streaming, with a ring that holds the whole sequence; InfiniGen:
    `alpha` 1e9 so that its count is every token it may fetch, layer 1 speculating, calibrated on random tokens)."""
    config = model.config
    grid = np.random.default_rng(5).uniform(0.1, 1.0, (config.num_layers, config.num_kv_heads))
    if name == "infinigen":
        sample = np.random.default_rng(6).integers(0, config.vocab_size, 24)
        return InfiniGen.calibrate(
            model.params,
            config,
            sample,
            context=64,
            kv_budget=budget,
            alpha=alpha,
            partial_ratio=0.25,
            offload="device",
            dense_layers=1,
        )
    options = {
        "snapkv": dict(window=window),
        "pyramidkv": dict(window=window, beta=4.0),
        "headkv": dict(window=window, scores=grid),
        "duo_headkv": dict(window=window, scores=grid, pattern=Pattern(grid), sparsity=0.5, sink=4, recent=64),
    }.get(name, {})
    return make_method(name, config, context=64, kv_budget=budget, **options)


@pytest.fixture(scope="module")
def full_runs(models, qwen):
    """`full` on each model: chunked prefill and 6 greedy decode steps (tokens, logits at every position)."""
    prompt = np.random.default_rng(8).integers(0, TINY["vocab_size"], 29).tolist()
    runs = {}
    for family, (_, model) in (("mistral", models), ("qwen2", qwen)):
        full = make_method("full", model.config, context=64)
        runs[family] = (model, prompt) + run_method(model.params, model.config, full, prompt, chunk=8, decode_steps=6)[
            :2
        ]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("name", METHODS)
def test_budget_covering_the_sequence_is_full_attention(full_runs, family, name):
    """Each method with a budget of the whole sequence (29 + 6 tokens, the window 8) on the Mistral-like model
    (every layer windowed) and on the Qwen2 (layer 1 only): nothing the window can see is evicted, so every
    logit (prefill and decode) and every greedy token is `full`'s, which is transformers' (tests above)."""
    model, prompt, tokens, expected = full_runs[family]
    method = build(name, model, 64 if name != "headkv" else 200)  # headkv: the lowest head budget covers it
    sequence, logits, _, _ = run_method(model.params, model.config, method, prompt, chunk=8, decode_steps=6)
    assert sequence == tokens
    np.testing.assert_array_less(np.abs(logits - expected).max(), 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, budget",
    [(name, WINDOW - 1) for name in EVEN_BUDGETS] + [("h2o", 3)],
)
def test_a_budget_of_the_window_is_exact(full_runs, name, budget):
    """On the model whose every layer is windowed, a query sees at most WINDOW - 1 earlier tokens, so a budget
    of WINDOW - 1 (below the 29-token prompt) loses nothing: the methods drop the tokens out of every future
    window first and keep the rest (SnapKV: 4 observation-window tokens + the 3 visible prefix tokens;
    InfiniGen fetches all it sees). A method that kept an old token by its score instead of a visible one
    would change the logits; a smaller budget does."""
    model, prompt, tokens, expected = full_runs["mistral"]
    sequence, logits, _, _ = run_method(
        model.params,
        model.config,
        build(name, model, budget),
        prompt,
        chunk=8,
        decode_steps=6,
        force=tokens[len(prompt) :],
    )
    error = np.abs(logits - expected).max()
    if budget >= WINDOW - 1:
        np.testing.assert_array_less(error, 1e-4)
    else:
        assert error > 1e-2


def test_a_method_built_for_other_windows_is_refused(models, qwen, prompt):
    """SnapKV's family keeps each layer's window for its compression after prefill: run on a model whose
    windows differ from those it was built for, it refuses rather than select past the window."""
    method = make_method("snapkv", qwen[1].config, context=64, kv_budget=16, window=4)  # window on layer 1 only
    _, model = models
    with pytest.raises(DuoJaxError, match="built for sliding window None on layer 0 but the model has 8"):
        run_method(model.params, model.config, method, prompt, chunk=8, decode_steps=0)


# --- a window on some layers only (Qwen2) ---------------------------------------------------------------


def hf_layer_windows(config) -> list:
    """transformers' window of each layer: its config's `sliding_window` where `layer_types` says sliding."""
    return [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]


QWEN_RULES = [  # config.json keys as written by older transformers (no layer_types) and by transformers 5
    dict(use_sliding_window=True, max_window_layers=1),
    dict(use_sliding_window=True, max_window_layers=0),  # every layer
    dict(use_sliding_window=True),  # max_window_layers defaults to 28: no layer of 4
    dict(use_sliding_window=False, max_window_layers=1),
    dict(max_window_layers=1),  # use_sliding_window defaults to false
    dict(use_sliding_window=True, layer_types=["full_attention", "sliding_attention"] * 2),
    dict(use_sliding_window=True, max_window_layers=3, layer_types=["sliding_attention"] + ["full_attention"] * 3),
]


@pytest.mark.parametrize("config_cls", [transformers.Qwen2Config, transformers.Qwen3Config])
def test_qwen_layer_windows_read_as_transformers_reads_them(config_cls):
    base = dict(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        sliding_window=4,
    )
    model_type = config_cls.model_type
    seen = set()
    for rule in QWEN_RULES:
        hf = config_cls(**base, **rule)
        expected = hf_layer_windows(hf)
        for raw in (dict(base, model_type=model_type, **rule), hf.to_dict()):  # as given, and as saved
            ours = ModelConfig.from_hf(raw)
            assert [ours.layer_window(l) for l in range(4)] == expected, (rule, raw)
        seen.add(tuple(expected))
    assert len(seen) == 5  # the rules above differ: none, all, top three, alternating, bottom one
    with pytest.raises(ConfigError, match="no window"):  # transformers fails too (its cache needs the window)
        ModelConfig.from_hf(dict(base, model_type=model_type, layer_types=["sliding_attention"] * 4))
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf(dict(base, model_type=model_type, use_sliding_window=True, layer_types=["full_attention"]))


def test_window_layers_are_checked_and_canonical():
    config = ModelConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_layers=4,
        num_heads=2,
        num_kv_heads=2,
        head_dim=4,
        sliding_window=4,
        window_layers=(1, 3),
    )
    assert config.window_runs() == ((0, 1, None), (1, 2, 4), (2, 3, None), (3, 4, 4))
    every = dataclasses.replace(config, window_layers=(0, 1, 2, 3))
    assert every.window_layers is None and every == dataclasses.replace(config, window_layers=None)
    assert dataclasses.replace(config, sliding_window=None).window_runs() == ((0, 4, None),)
    for bad in [(3, 1), (1, 1), (4,), (), (-1,)]:
        with pytest.raises(ConfigError, match="window_layers"):
            dataclasses.replace(config, window_layers=bad)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-layer-window")
    hf_model = write_random_hf_model(directory, transformers.Qwen2Config, QWEN_FIELDS)
    return hf_model, duo_jax.load(directory, dtype=jnp.float32)


@pytest.mark.slow
def test_qwen_layer_window_forward_matches_transformers(qwen):
    hf_model, model = qwen
    assert [model.config.layer_window(l) for l in range(2)] == [None, WINDOW]
    tokens = np.random.default_rng(1).integers(0, TINY["vocab_size"], (2, 40)).astype(np.int32)
    ref = hf_logits(hf_model, tokens)
    ours = np.asarray(duo_jax.forward(model.params, model.config, jnp.asarray(tokens)))
    assert np.abs(ref).max() > 1.0
    np.testing.assert_array_less(np.abs(ours - ref).max(), 1e-4)
    # the rule matters: the window on every layer, or on none, gives other logits
    for other in (
        dataclasses.replace(model.config, window_layers=None),
        dataclasses.replace(model.config, sliding_window=None),
    ):
        logits = np.asarray(duo_jax.forward(model.params, other, jnp.asarray(tokens)))
        assert np.abs(logits - ref).max() > 1e-2


@pytest.mark.slow
def test_qwen_layer_window_engine_matches_transformers(qwen):
    """Chunked prefill + decode through the engine's steps with `full` (duo with every head a retrieval head):
    every logit within 1e-4 of transformers', greedy tokens those of `model.generate`; and through `generate`
    (chunked prefill, the device decode loop) with streaming_llm, whose sink + ring (the streaming heads' code)
    covers the sequence, the same tokens."""
    hf_model, model = qwen
    prompt = np.random.default_rng(2).integers(0, TINY["vocab_size"], 29).tolist()
    with torch.no_grad():
        hf = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
    expected = hf[0, len(prompt) :].tolist()
    method = make_method("full", model.config, context=64)
    sequence, logits, _, _ = run_method(model.params, model.config, method, prompt, chunk=5, decode_steps=8)
    assert sequence[len(prompt) :] == expected
    ref = hf_logits(hf_model, np.asarray([sequence[:-1]]))[0]
    np.testing.assert_array_less(np.abs(logits[: len(ref)] - ref).max(), 1e-4)
    out = generate(
        model, prompt, method="streaming_llm", sink=4, recent=64, max_new_tokens=8, chunk_size=7, stop_at_eos=False
    )
    assert out.tokens[0] == expected


def duo_reference(params, config, tokens, retrieval, *, sink, recent, windows):
    """Logits [T, V] of the dense model as DuoAttention runs it one token at a time, from explicit masks:
    on a retrieval head (retrieval[l, kv_head]) query i sees every key j <= i, on a streaming head the keys
    j <= i with j < sink or i - j <= recent (the last `recent` tokens before it, and itself); in a windowed
    layer (windows[l]) only those with i - j < window."""
    T = len(tokens)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]

    def mask(layer):
        window = windows[layer.index]
        full = (j <= i) & (True if window is None else i - j < window)
        streaming = full & ((j < sink) | (i - j <= recent))
        return np.where(retrieval[layer.index][:, None, None], full, streaming)  # [K, T, T]

    return decode(params, config, tokens, mask).logits


@pytest.mark.slow
def test_duo_heads_keep_each_layers_window(qwen):
    """DuoAttention one token per step (so each streaming query's keys are exactly Λ's), a retrieval and a
    streaming head in each layer (layer 1's retrieval head second: heads reordered): the layer's window
    applies to both kinds, on layer 1 only, and Λ besides on streaming heads."""
    _, model = qwen
    prompt = np.random.default_rng(4).integers(0, TINY["vocab_size"], 20).tolist()
    pattern = Pattern(np.asarray([[0.9, 0.1], [0.2, 0.8]]))
    retrieval = pattern.retrieval_mask(0.5)
    assert retrieval.tolist() == [[True, False], [False, True]]
    duo = make_method("duo", model.config, context=64, pattern=pattern, sparsity=0.5, sink=2, recent=10)
    _, logits, _, _ = run_method(model.params, model.config, duo, prompt, chunk=1, decode_steps=0)
    ref = duo_reference(model.params, model.config, prompt, retrieval, sink=2, recent=10, windows=[None, WINDOW])
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    unwindowed = duo_reference(model.params, model.config, prompt, retrieval, sink=2, recent=10, windows=[None, None])
    assert np.abs(unwindowed - ref).max() > 1e-2  # with recent > window, the window is what hides keys

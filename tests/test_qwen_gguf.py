"""Qwen2 / Qwen3 GGUF files: tiny random models written with the `gguf` package the way llama.cpp's converter
writes them (Q/K rows as Hugging Face stores them, biases and q/k norms as their own tensors, the vocabulary
padded with unused tokens), loaded against the same weights' safetensors directory and transformers; the BPE
tokenizer with Qwen's pre-tokenizer against transformers' `Qwen2Tokenizer`."""

import dataclasses
import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

import duo_jax
from duo_jax.errors import LoadError
from duo_jax.tokenizer import Tokenizer
from tests.test_model import TINY, hf_logits, write_random_hf_model

VOCAB = 320  # the model's rows: the tokenizer's 300 tokens, padded as llama.cpp pads
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>"]
CORPUS = [
    "I'VE seen 12345 apples and you've got 3.14159 pies; we'll see. They'RE here at 10:30.",
    "naïve café über straße ÜNÏCÖDÉ 我想在apple工作1314151天 — 2024-05-17, 999 bottles",
    "  indented\n\n\tcode = x+1 // 42 ... 'quoted' don't won't it's\r\n",
] * 20
# Strings on which Qwen's split (one piece per digit, letters with one leading non-letter, NFC) matters.
TEXTS = [
    "12345 apples and 3.14159 pies",
    "I'VE seen it; you've got it. They'RE here",
    "naïve café über ÜNÏCÖDÉ",
    "cafe\u0301 na\u0131ve",
    "我想在apple工作1314151天",
    "<|im_start|>user\nhi 2024<|im_end|>",
    "<think>\n\n</think>\n\n999 bottles",
    "  indented\n\n\tcode = x+1 // 42 ...",
    "won't it's DON'T",
]


def _trained_bpe() -> tuple[dict[str, int], list[str]]:
    """A byte-level BPE whose merges cross every pre-tokenizer boundary (trained on whole lines), so any
    difference in how text is split shows in the tokens."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=CONTROL + USER_DEFINED,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    model = json.loads(backend.model.__getstate__())
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return model["vocab"], merges


@pytest.fixture(scope="module")
def bpe():
    return _trained_bpe()


def _tokenizer_fields(vocab: dict[str, int], merges: list[str], pre: str = "qwen2") -> dict:
    """GGUF tokenizer metadata as llama.cpp's converter writes it: ids 0..V-1, [PADi] unused rows."""
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(VOCAB)]
    kinds = [3 if t in CONTROL else 4 if t in USER_DEFINED else 1 if i in by_id else 5 for i, t in enumerate(tokens)]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.add_bos_token": False,
    }


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter (`LlamaModel.permute`): Q / K rows of each head from the half-split RoPE layout
    to the interleaved one."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_model, arch: str, tokenizer_fields: dict, dtype=np.float32) -> None:
    """The torch model's weights (as `dtype`: fp32 by default) and config as a GGUF of architecture `arch` (qwen2 /
    qwen3, or llama: a Mistral's Q / K rows permuted and its sliding window written, as llama.cpp's converter
    does)."""
    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-qwen")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    if getattr(c, "head_dim", None):  # written when config.json gives it, as the converter does
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "llama" and getattr(c, "sliding_window", None) is not None:
        writer.add_sliding_window(c.sliding_window)
    writer.add_tokenizer_model(tokenizer_fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(tokenizer_fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokenizer_fields["tokenizer.ggml.tokens"])
    writer.add_token_types(tokenizer_fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(tokenizer_fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(tokenizer_fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(tokenizer_fields["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, w in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:  # no output tensor: the embedding is used
            continue
        stem, suffix = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, i, rest = stem.split(".", 3)
            target = f"blk.{i}.{layer[rest]}.{suffix}"
        else:
            target = f"{names[stem]}.{suffix}"
        w = w.numpy().astype(dtype)
        if arch == "llama" and target.endswith((".attn_q.weight", ".attn_k.weight")):
            w = llama_cpp_permute(w, c.num_attention_heads if ".attn_q." in target else c.num_key_value_heads)
        writer.add_tensor(target, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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


@pytest.fixture(scope="module", params=list(FAMILIES))
def loaded(request, tmp_path_factory, bpe):
    """(family, torch model, our model from safetensors, our model from GGUF, GGUF path)."""
    config_cls, fields = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = write_random_hf_model(directory, config_cls, fields)
    path = directory / f"tiny-{request.param}.gguf"
    write_gguf(path, hf_model, request.param, _tokenizer_fields(*bpe))
    return (
        request.param,
        hf_model,
        duo_jax.load(directory, dtype=jnp.float32),
        duo_jax.load(path, dtype=jnp.float32),
        path,
    )


def test_gguf_matches_safetensors_and_transformers(loaded):
    family, hf_model, from_dir, from_gguf, _ = loaded
    g = from_gguf.config  # the GGUF stores eps as float32 and the tokenizer's BOS / EOS ids
    assert g == dataclasses.replace(
        from_dir.config,
        name=g.name,
        rms_norm_eps=g.rms_norm_eps,
        bos_token_id=g.bos_token_id,
        eos_token_ids=g.eos_token_ids,
    )
    assert g.rms_norm_eps == pytest.approx(from_dir.config.rms_norm_eps, rel=1e-7)
    assert from_gguf.config.qkv_bias == (family == "qwen2") and from_gguf.config.qk_norm == (family == "qwen3")
    jax.tree.map(np.testing.assert_array_equal, from_gguf.params, from_dir.params)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 40)).astype(np.int32)
    ours = np.asarray(duo_jax.forward(from_gguf.params, from_gguf.config, jnp.asarray(tokens)))
    np.testing.assert_array_less(
        np.abs(ours - np.asarray(duo_jax.forward(from_dir.params, from_dir.config, jnp.asarray(tokens)))).max(), 1e-6
    )
    ref = hf_logits(hf_model, tokens)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_array_less(np.abs(ours - ref).max(), 1e-4)


@pytest.mark.parametrize("loaded", ["qwen2"], indirect=True)  # its reader lacks qwen3's explicit head_dim
def test_transformers_reads_our_qwen2_gguf_the_same_way(loaded):
    """transformers' own GGUF reader (llama.cpp's conventions, written independently of ours) gives the same
    model from the file: the Q/K rows are not permuted for qwen2."""
    _, _, _, from_gguf, path = loaded
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (1, 30)).astype(np.int32)
    ours = np.asarray(duo_jax.forward(from_gguf.params, from_gguf.config, jnp.asarray(tokens)))
    np.testing.assert_array_less(np.abs(ours - hf_logits(theirs, tokens)).max(), 1e-4)


@pytest.mark.parametrize("loaded", ["qwen2"], indirect=True)  # qwen3 GGUFs carry the same tokenizer
def test_gguf_tokenizer_matches_qwen2_tokenizer(loaded, bpe):
    _, _, _, from_gguf, _ = loaded
    vocab, merges = bpe
    reference = transformers.Qwen2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges])
    # the added tokens of Qwen's tokenizer.json: control tokens special, <think> / </think> not
    reference.add_tokens([transformers.AddedToken(t, special=True, normalized=False) for t in CONTROL])
    reference.add_tokens([transformers.AddedToken(t, special=False, normalized=False) for t in USER_DEFINED])
    ours = from_gguf.tokenizer
    assert ours.vocab_size == VOCAB and ours.eos_ids == (vocab["<|im_end|>"],)
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == reference.decode(expected), text
    assert ours.encode("cafe\u0301") == ours.encode("café")  # NFC first, as Qwen's tokenizer.json
    # the test can tell the splits apart: Llama 3's regex gives other tokens on these strings
    llama = Tokenizer.from_gguf_fields(_tokenizer_fields(vocab, merges, pre="llama-bpe"))
    assert sum(llama.encode(t) != ours.encode(t) for t in TEXTS) >= 3


def test_unknown_pre_tokenizer_is_a_clear_error(tmp_path, bpe):
    hf_model = write_random_hf_model(tmp_path, *FAMILIES["qwen2"])
    path = tmp_path / "unknown-pre.gguf"
    write_gguf(path, hf_model, "qwen2", _tokenizer_fields(*bpe, pre="some-new-model"))
    with pytest.raises(LoadError, match=r"unknown-pre.gguf: .*pre-tokenizer .*'some-new-model'.* Hugging Face"):
        duo_jax.load(path)


def test_f64_tensors_load_and_integer_ones_are_named(tmp_path, bpe):
    """The gguf package dequantizes neither: a bare NotImplementedError before, for F64 weights too."""
    hf_model = write_random_hf_model(tmp_path, *FAMILIES["qwen2"])
    write_gguf(tmp_path / "f32.gguf", hf_model, "qwen2", _tokenizer_fields(*bpe))
    write_gguf(tmp_path / "f64.gguf", hf_model, "qwen2", _tokenizer_fields(*bpe), dtype=np.float64)
    f32, f64 = duo_jax.load(tmp_path / "f32.gguf", jnp.float32), duo_jax.load(tmp_path / "f64.gguf", jnp.float32)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(f32.params), jax.tree.leaves(f64.params)))
    write_gguf(tmp_path / "i32.gguf", hf_model, "qwen2", _tokenizer_fields(*bpe), dtype=np.int32)
    message = r"i32\.gguf: tensor '[\w.]+' has GGUF type I32, which duo-jax does not load; it loads F32, F16, F64, BF16"
    with pytest.raises(LoadError, match=message):
        duo_jax.load(tmp_path / "i32.gguf")


@pytest.mark.parametrize("key", ["tokenizer.ggml.merges", "tokenizer.ggml.tokens"])
def test_bpe_tokenizer_without_its_merges_is_a_clear_error(bpe, key):
    """A KeyError before."""
    fields = _tokenizer_fields(*bpe)
    del fields[key]
    with pytest.raises(LoadError, match=rf"BPE tokenizer .* lacks {key}; the file is incomplete"):
        Tokenizer.from_gguf_fields(fields)


def test_llama3_gguf_takes_whole_vocabulary_words_and_adds_bos():
    """llama.cpp's LLAMA3 pre-tokenizers (llama-bpe, llama3, llama-v3) match a word that is one vocabulary entry
    before merging (Llama 3's tokenizer.json: BPE ignore_merges), and add BOS unless the GGUF says not: " Việt" is
    one token of Llama 3 that its merges cannot build."""
    tokens = ["<|begin_of_text|>", "a", "b", "c", "ab", "abc"]
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],  # no merge makes "abc"
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    llama3 = Tokenizer.from_gguf_fields(fields)
    assert llama3.encode("abc") == [0, 5] and llama3.encode("abcab", add_special_tokens=False) == [4, 3, 4]
    gpt2 = Tokenizer.from_gguf_fields(dict(fields, **{"tokenizer.ggml.pre": "gpt-2"}))
    assert gpt2.encode("abc") == [4, 3]  # merges only, and no BOS by default
    assert Tokenizer.from_gguf_fields(dict(fields, **{"tokenizer.ggml.add_bos_token": False})).encode("abc") == [5]

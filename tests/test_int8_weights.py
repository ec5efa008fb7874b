"""int8 weights (per output channel, `duo_jax.model.quantize_weights`): the model over them against its
dequantized weights (exact) and the fp32 weights (a stated bound), through forward, the
engine and the loader."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.errors import DuoJaxError
from duo_jax.model import greedy_reference, quantize_weights
from duo_jax.pattern import Pattern
from duo_jax.quant import QuantizedWeight, dequantize
from tests.conftest import tiny_config

CONFIG = tiny_config(num_layers=2, max_position_embeddings=256, qkv_bias=True, qk_norm=True)


def dequantized(params):
    return jax.tree.map(dequantize, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


@pytest.fixture(scope="module")
def params():
    return duo_jax.init_params(CONFIG, jax.random.key(2), scale=0.1)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 24)))


@pytest.mark.slow
def test_int8_weights_compute_the_model_of_their_dequantized_weights(params, tokens):
    q = quantize_weights(params)
    matmuls = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]
    assert all(isinstance(getattr(q.layers, n), QuantizedWeight) for n in matmuls)
    assert isinstance(q.embed, QuantizedWeight) and q.dtype == jnp.float32
    assert q.layers.bq is params.layers.bq and q.layers.q_norm is params.layers.q_norm  # not matmuls: as they were
    assert q.layers.wo.scale.shape == (2, 1, 1, CONFIG.hidden_size)  # per output channel
    got = duo_jax.forward(q, CONFIG, tokens)
    np.testing.assert_allclose(got, duo_jax.forward(dequantized(q), CONFIG, tokens), atol=2e-5, rtol=2e-5)
    fp32 = duo_jax.forward(params, CONFIG, tokens)
    err = float(jnp.abs(got - fp32).max() / jnp.abs(fp32).max())
    # Per-channel int8 moves each weight by <= 1/254 of its channel's absmax (~0.8% rms); through this random
    # model's two layers the logits move by 3.8% of their largest (2.3% rms), measured. A lost or misplaced
    # scale moves them by ~100%.
    assert 1e-4 < err < 0.08


@pytest.mark.slow
def test_tied_embeddings_bf16(tokens):
    config = tiny_config(num_layers=2, tie_word_embeddings=True)
    params = duo_jax.init_params(config, jax.random.key(3), jnp.bfloat16, scale=0.1)
    q = quantize_weights(params)
    assert q.lm_head is None and q.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        duo_jax.forward(q, config, tokens), duo_jax.forward(dequantized(q), config, tokens), atol=0.05, rtol=0.02
    )  # bf16 activations: rounding of one vs the other order


@pytest.mark.slow
def test_generate_over_int8_weights_is_greedy_decoding_of_them(params):
    model = duo_jax.Model(CONFIG, quantize_weights(params), None, "random")
    prompt = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 29).tolist()
    gates = np.array([[0.9, 0.1], [0.05, 0.8]])
    out = duo_jax.generate(
        model,
        prompt,
        pattern=Pattern(gates),
        sparsity=0.0,
        sink=2,
        recent=4,
        max_new_tokens=8,
        chunk_size=8,
        stop_at_eos=False,
    )  # heads split per layer, all retrieval
    assert out.tokens == [greedy_reference(model.params, CONFIG, prompt, 8)]


@pytest.mark.slow
def test_load_int8(tmp_path):
    from tests.test_model import HF_CASES, write_random_hf_model

    write_random_hf_model(tmp_path, *HF_CASES["llama-gqa-llama3-rope-untied"])
    plain = duo_jax.load(tmp_path, jnp.float32)
    int8 = duo_jax.load(tmp_path, jnp.float32, weights="int8")
    assert isinstance(int8.params.lm_head, QuantizedWeight)
    tokens = jnp.arange(12)[None] % plain.config.vocab_size
    np.testing.assert_allclose(
        duo_jax.forward(int8.params, int8.config, tokens),
        duo_jax.forward(quantize_weights(plain.params), plain.config, tokens),
        atol=1e-6,
    )
    nbytes = lambda p: sum(x.nbytes for x in jax.tree.leaves(p))  # noqa: E731
    assert nbytes(int8.params) < 0.3 * nbytes(plain.params)
    with pytest.raises(DuoJaxError, match="weights must be"):
        duo_jax.load(tmp_path, weights="int4")

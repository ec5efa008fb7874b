"""The dense model against Hugging Face transformers (PyTorch) on random tiny checkpoints, fp32."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import duo_jax
from duo_jax.attention import attention_probs, attention_received
from duo_jax.model import greedy_reference, rope_inv_freq
from tests.conftest import tiny_config

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

HF_CASES = {
    "llama-gqa-llama3-rope-untied": (
        transformers.LlamaConfig,
        dict(
            TINY,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-mha-tied": (
        transformers.LlamaConfig,
        dict(TINY, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0),
    ),
    "llama-linear-rope": (
        transformers.LlamaConfig,
        dict(
            TINY,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        dict(
            TINY,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=None,
            tie_word_embeddings=False,
            rope_theta=1e6,
        ),
    ),
}


def write_random_hf_model(directory, config_cls, fields, seed=0, **save_kwargs):
    """A random transformers model saved with `save_pretrained` (safetensors); returns the torch model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**fields), dtype=torch.float32)
    with torch.no_grad():  # default init has unit norm weights and tiny projections: make every weight matter
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("case", list(HF_CASES))
def test_logits_match_transformers(case, tmp_path):
    config_cls, fields = HF_CASES[case]
    hf_model = write_random_hf_model(tmp_path, config_cls, fields)
    model = duo_jax.load(tmp_path, dtype=jnp.float32)
    tokens = np.random.default_rng(1).integers(0, fields["vocab_size"], (2, 80)).astype(np.int32)
    ours = np.asarray(duo_jax.forward(model.params, model.config, jnp.asarray(tokens)))
    ref = hf_logits(hf_model, tokens)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.abs(ref).max() > 1.0  # the comparison is not between two near-zero tensors
    np.testing.assert_array_less(np.abs(ours - ref).max(), 1e-4)


def test_sharded_checkpoint_loads_identically(tmp_path):
    config_cls, fields = HF_CASES["llama-gqa-llama3-rope-untied"]
    write_random_hf_model(tmp_path / "one", config_cls, fields)
    write_random_hf_model(tmp_path / "sharded", config_cls, fields, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one = duo_jax.load(tmp_path / "one", dtype=jnp.float32).params
    sharded = duo_jax.load(tmp_path / "sharded", dtype=jnp.float32).params
    jax.tree.map(np.testing.assert_array_equal, one, sharded)


def test_bf16_params_compute_in_bf16_with_fp32_logits(tmp_path):
    config_cls, fields = HF_CASES["llama-mha-tied"]
    hf_model = write_random_hf_model(tmp_path, config_cls, fields)
    model = duo_jax.load(tmp_path)  # default dtype bf16
    assert all(layer.wq.dtype == jnp.bfloat16 for layer in model.params.layers)
    tokens = np.arange(40, dtype=np.int32)[None] % fields["vocab_size"]
    logits = duo_jax.forward(model.params, model.config, jnp.asarray(tokens))
    assert logits.dtype == jnp.float32
    ref = hf_logits(hf_model, tokens)
    # bf16 weights and activations (8-bit mantissa): close to the fp32 model, far from random.
    assert np.abs(np.asarray(logits) - ref).max() < 0.05 * np.abs(ref).max()


def test_llama3_rope_frequencies_match_transformers():
    config_cls, fields = HF_CASES["llama-gqa-llama3-rope-untied"]
    hf_config = config_cls(**fields)
    rope = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    expected, _ = rope(hf_config, "cpu")
    config = duo_jax.ModelConfig.from_hf(hf_config.to_dict())
    np.testing.assert_allclose(rope_inv_freq(config), expected.numpy(), rtol=1e-6)


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_attention_probs_matches_float64_numpy(dtype, atol):
    """The per-head masked softmax the scoring methods use (duo_jax.attention.probs), jitted, in float32 and in
    bfloat16 (where XLA:CPU once had no kernel for the weighted sum's dot at batch 2: H2O crashed on a batch)."""
    rng = np.random.default_rng(0)
    B, T, S, H, K, E = 2, 5, 24, 6, 3, 8
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, H, E), (B, S, K, E), (B, S, K, E)))
    mask = rng.random((B, K, T, S)) < 0.6
    mask[0, 1, 2] = False  # a query that sees nothing returns zeros
    k, v = np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2)  # [B, K, S, E]
    q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))  # the values it sees
    out = jax.jit(attention_probs)(*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(mask))[0]
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), masked_attention64(q, k, v, mask)[0], atol=atol)


def masked_attention64(q, k, v, mask):
    """float64 numpy: q [B, T, H, E], k / v [B, K, S, E], mask [B, K, T, S] -> (out [B, T, H, E], probs
    [B, H, T, S]); a query that sees nothing gets zeros."""
    (B, T, H, E), K, S = q.shape, k.shape[1], k.shape[2]
    out, probs = np.zeros((B, T, H, E)), np.zeros((B, H, T, S))
    for b, h, t in np.ndindex(B, H, T):
        kv = h // (H // K)
        seen = mask[b, kv, t]
        if not seen.any():
            continue
        s = k[b, kv, seen].astype(np.float64) @ q[b, t, h].astype(np.float64) / math.sqrt(E)
        p = np.exp(s - s.max())
        probs[b, h, t, seen] = p / p.sum()
        out[b, t, h] = probs[b, h, t, seen] @ v[b, kv, seen]
    return out, probs


def test_attention_received_matches_float64_numpy():
    """attention_probs' output and its probabilities summed over weighted queries, 4 queries at a time
    (11 queries: the last block padded), with a mask built from positions as the scoring methods build it."""
    rng = np.random.default_rng(1)
    B, T, S, H, K, E = 2, 11, 9, 4, 2, 8
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, H, E), (B, K, S, E), (B, K, S, E)))
    q_positions = np.arange(T)[None] + np.array([[0], [3]])  # [B, T]
    k_positions = rng.integers(-1, 14, (B, K, S))  # -1: an empty slot
    weights = (rng.random((B, T)) < 0.8).astype(np.float32)

    def sees(positions):  # [B, Tb] -> [B, K, Tb, S]
        keys = jnp.asarray(k_positions)[:, :, None]
        return (keys >= 0) & (keys <= positions[:, None, :, None])

    out, received = attention_received(*map(jnp.asarray, (q, k, v, q_positions)), sees, jnp.asarray(weights), block=4)
    ref_out, probs = masked_attention64(q, k, v, np.asarray(sees(jnp.asarray(q_positions))))
    ref_received = np.einsum("bhts,bt->bhs", probs, weights).reshape(B, K, H // K, S).sum(axis=2)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-5)
    np.testing.assert_allclose(np.asarray(received), ref_received, atol=1e-5)
    dense = attention_received(*map(jnp.asarray, (q, k, v, q_positions)), sees, jnp.asarray(weights), block=T)
    np.testing.assert_allclose(np.asarray(dense[1]), ref_received, atol=1e-5)


def test_attention_received_with_the_causal_cut_matches_float64_numpy():
    """Kept tokens (earlier positions, some slots empty), then the queries' own keys in order (`own_keys_at`):
    each block of 4 queries reads the slots up to its last query's own, and gives the whole mask's values."""
    rng = np.random.default_rng(2)
    B, N, T, H, K, E = 2, 5, 11, 4, 2, 8
    S = N + T
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, H, E), (B, K, S, E), (B, K, S, E)))
    q_positions = np.arange(T)[None] + np.array([[20], [7]])  # [B, T]
    k_positions = np.concatenate(
        [rng.integers(-1, 7, (B, K, N)), np.broadcast_to(q_positions[:, None], (B, K, T))], axis=2
    )  # kept tokens before every query (-1: empty), then the queries' own
    weights = np.ones((B, T), np.float32)

    def sees(positions):  # [B, Tb] -> [B, K, Tb, S]
        keys = jnp.asarray(k_positions)[:, :, None]
        return (keys >= 0) & (keys <= positions[:, None, :, None])

    args = (*map(jnp.asarray, (q, k, v, q_positions)), sees, jnp.asarray(weights))
    out, received = attention_received(*args, block=4, own_keys_at=N)
    ref_out, probs = masked_attention64(q, k, v, np.asarray(sees(jnp.asarray(q_positions))))
    ref_received = np.einsum("bhts,bt->bhs", probs, weights).reshape(B, K, H // K, S).sum(axis=2)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-5)
    np.testing.assert_allclose(np.asarray(received), ref_received, atol=1e-5)
    # the cut is what it claims: a block that read past its own keys would not change this, one that read less would
    cut_short = attention_received(*args, block=4, own_keys_at=N - 2)[1]
    assert np.abs(np.asarray(cut_short) - ref_received).max() > 1e-3


def test_greedy_reference_matches_transformers_generate(tmp_path):
    config_cls, fields = HF_CASES["llama-gqa-llama3-rope-untied"]
    hf_model = write_random_hf_model(tmp_path, config_cls, fields)
    model = duo_jax.load(tmp_path, dtype=jnp.float32)
    prompt = [5, 17, 99, 3, 64, 20, 7]
    with torch.no_grad():
        hf = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0
        )
    assert greedy_reference(model.params, model.config, prompt, 12) == hf[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_init_params_shapes_and_sliding_window():
    config = tiny_config(sliding_window=4)
    params = duo_jax.init_params(config, jax.random.key(0))
    tokens = jnp.asarray(np.arange(12, dtype=np.int32)[None])
    full = duo_jax.forward(params, tiny_config(), tokens)
    windowed = duo_jax.forward(params, config, tokens)
    np.testing.assert_allclose(windowed[:, :4], full[:, :4], atol=1e-6)  # identical inside the window
    assert np.abs(np.asarray(windowed[:, 8:] - full[:, 8:])).max() > 1e-4  # different beyond it


@pytest.mark.parametrize(
    "tokens, message",
    [
        (np.asarray([[1, 400]]), r"token ids must lie in \[0, 128\), got 1..400"),  # the gather clamped it before
        (jnp.asarray([[-1, 2]]), r"token ids must lie in \[0, 128\), got -1..2"),
        (np.asarray([[1.0, 2.0]]), "integer array .* float64 of shape"),
        (np.asarray([1, 2]), r"\[batch, length\]; got int64 of shape \(2,\)"),
        (np.zeros((2, 0), np.int32), "no positions"),
        (np.zeros((0, 3), np.int32), "no rows"),  # numpy's "zero-size array to reduction" before
        ([[1, 2], [3]], "rows of one length"),  # numpy's "inhomogeneous shape" before
    ],
)
def test_forward_refuses_tokens_it_cannot_embed(tokens, message):
    config = tiny_config()
    params = duo_jax.init_params(config, jax.random.key(0))
    with pytest.raises(duo_jax.DuoJaxError, match=message):
        duo_jax.forward(params, config, tokens)


def test_forward_takes_lists_and_runs_under_a_callers_jit():
    """A nested list of ids is an array; under jit the values cannot be read, so only shape and dtype are checked."""
    config = tiny_config()
    params = duo_jax.init_params(config, jax.random.key(0))
    want = duo_jax.forward(params, config, jnp.asarray([[3, 1, 4]]))
    np.testing.assert_array_equal(duo_jax.forward(params, config, [[3, 1, 4]]), want)
    np.testing.assert_array_equal(
        jax.jit(lambda p, x: duo_jax.forward(p, config, x))(params, jnp.asarray([[3, 1, 4]])), want
    )


def test_every_layer_weight_has_its_place_in_the_tables_that_name_weights():
    """Three tables treat `LayerParams` fields by name, and a weight missing from one fails silently: the Flax front
    would drop it (None), int8 weights would leave it unquantized, a mesh would replicate it. A new field fails here,
    naming the table (docs/adding-a-model.md, step 3)."""
    import dataclasses

    from duo_jax import flax as duo_flax
    from duo_jax import sharding
    from duo_jax.model import CONTRACTED_AXES, LayerParams

    names = {field.name for field in dataclasses.fields(LayerParams)}
    fused = {"wqkv"}  # the engine's copy of wq / wk / wv (`fuse_qkv`, one device only)
    norms = {"attn_norm", "mlp_norm", "q_norm", "k_norm"}  # vectors over the hidden or head dim: replicated
    biases = {"bq", "bk", "bv"}  # split by head with the projections; not matmuls, so never int8
    flax_fields = {*duo_flax.ATTENTION_FIELDS, *duo_flax.MLP_FIELDS, *duo_flax.NORM_FIELDS}
    assert flax_fields == names - fused, "duo_jax/flax.py: ATTENTION_FIELDS, MLP_FIELDS, NORM_FIELDS"
    assert set(CONTRACTED_AXES) & names == names - norms - biases, "duo_jax/model.py: CONTRACTED_AXES"
    assert set(sharding._TP_AXIS) == names - fused - norms, "duo_jax/sharding.py: _TP_AXIS"

"""InfiniGen against numpy: the skewing, full attention with a budget covering everything, and a float64
reference of its decode-time speculation (partial scores, alpha threshold, averaged count, budget cap)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.methods import cache_nbytes
from duo_jax.methods.infinigen import InfiniGen, _layer_qk, host_offload_supported, skew
from duo_jax.model import mlp, output_projection, rms_norm, rope_inv_freq, unembed
from tests.conftest import qkv_projection, run_method, tiny_config

CONFIG = tiny_config()
PROMPT_LEN = 21


@pytest.fixture(scope="module")
def params():
    return duo_jax.init_params(CONFIG, jax.random.key(4), scale=0.3)


@pytest.fixture(scope="module")
def sample():
    return np.random.default_rng(7).integers(0, CONFIG.vocab_size, 24).tolist()


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(2).integers(0, CONFIG.vocab_size, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def skewed(params, sample):
    return skew(params, CONFIG, sample, partial_ratio=0.25)


def test_skew_is_orthogonal_and_keeps_the_top_query_channels(params, sample, skewed):
    A, channels = skewed
    L, K, G, E = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.group_size, CONFIG.head_dim
    assert A.shape == (L, K, E, E) and channels.shape == (L, K, 4) and channels.dtype == np.int32
    for l, (q, k) in enumerate(_layer_qk(params, CONFIG, sample)):
        for h in range(K):
            a = A[l, h].astype(np.float64)
            np.testing.assert_allclose(a.T @ a, np.eye(E), atol=1e-5)
            Q = q[:, h * G:(h + 1) * G].reshape(-1, E).astype(np.float64)
            keys = k[:, h].astype(np.float64)
            np.testing.assert_allclose((Q @ a) @ (keys @ a).T, Q @ keys.T, atol=1e-4 * np.abs(Q @ keys.T).max())
            magnitude = np.abs(Q @ a).sum(axis=0)
            assert sorted(channels[l, h]) == sorted(np.argsort(-magnitude)[:4].tolist())


def test_method_is_hashable_and_round_trips_its_skew(skewed):
    A, channels = skewed
    m1 = InfiniGen.from_skew(A, channels, context=64, kv_budget=6)
    m2 = InfiniGen.from_skew(A.copy(), channels.copy(), context=64, kv_budget=6)
    assert hash(m1) == hash(m2) and m1 == m2 and m1.capacity == 128
    np.testing.assert_array_equal(m1.skew_matrices, A)
    np.testing.assert_array_equal(m1.channels, channels)


@pytest.mark.parametrize("offload", ["device", "host"])
def test_budget_covering_the_sequence_is_full_attention(params, prompt, skewed, offload):
    if offload == "host" and not host_offload_supported():
        pytest.skip("no pinned_host memory on this backend")
    method = InfiniGen.from_skew(*skewed, context=64, kv_budget=64, alpha=1e9, offload=offload)
    sequence, logits, _, cache = run_method(params, CONFIG, method, prompt, chunk=8, decode_steps=6)
    dense = np.asarray(duo_jax.forward(params, CONFIG, jnp.asarray([sequence]))[0])
    np.testing.assert_array_less(np.abs(logits - dense).max(), 1e-4)
    assert cache_nbytes(cache) == method.expected_cache_bytes(1, 4) == 2 * 128 * 2 * (2 * 16 + 4) * 4
    kind = "pinned_host" if offload == "host" else "device"
    assert cache[0].k.sharding.memory_kind == kind and cache[0].v.sharding.memory_kind == kind
    assert cache[0].partial_k.sharding.memory_kind == "device"


def reference_logits(params, tokens, prompt_len, A, channels, budget, alpha):
    """float64: positions < prompt_len attend causally to everything; each decode position i speculates with
    the skewed partial query that layer l's weights make of layer l-1's attention input (layer 0: its own)
    against the skewed partial keys of tokens < i, keeps per KV head the tokens within alpha of the max (max
    over the group), ceil(mean count over heads) capped at budget, by rank, then attends exactly to those
    plus itself."""
    T, G, K, E = len(tokens), CONFIG.group_size, CONFIG.num_kv_heads, CONFIG.head_dim
    positions = jnp.arange(T)[None]
    x = params.embed[jnp.asarray(tokens)][None]
    kept_counts = []
    previous_input = None
    for l in range(CONFIG.num_layers):
        layer = jax.tree.map(lambda w: w[l], params.layers)
        attention_input = rms_norm(x, layer.attn_norm, 1e-5)
        q, k, v = (np.asarray(a[0], np.float64) for a in
                   qkv_projection(attention_input, layer, positions, rope_inv_freq(CONFIG)))
        source = attention_input if previous_input is None else previous_input
        q_spec = np.asarray(qkv_projection(source, layer, positions, rope_inv_freq(CONFIG))[0][0], np.float64)
        previous_input = attention_input
        out = np.zeros_like(q)
        for i in range(T):
            if i < prompt_len:
                seen = [list(range(i + 1))] * K
            else:
                head_scores = []
                for h in range(K):
                    a, ch = A[l, h].astype(np.float64), channels[l, h]
                    kp = (k[:i, h] @ a)[:, ch]
                    qp = (q_spec[i, h * G:(h + 1) * G] @ a)[:, ch]
                    head_scores.append((qp @ kp.T / math.sqrt(E)).max(axis=0))  # [i]
                counts = [int(np.sum(s >= s.max() - alpha)) for s in head_scores]
                n = int(min(math.ceil(np.mean(counts)), budget))
                kept_counts.append(n)
                seen = [sorted(np.argsort(-s, kind="stable")[:n].tolist()) + [i] for s in head_scores]
            for h in range(K):
                for g in range(G):
                    s = k[seen[h], h] @ q[i, h * G + g] / math.sqrt(E)
                    p = np.exp(s - s.max())
                    out[i, h * G + g] = (p / p.sum()) @ v[seen[h], h]
        x = x + output_projection(jnp.asarray(out[None], jnp.float32), layer)
        x = x + mlp(rms_norm(x, layer.mlp_norm, 1e-5), layer)
    return np.asarray(unembed(params, CONFIG, x)[0]), kept_counts


@pytest.mark.parametrize("offload, budget, alpha", [("device", 5, 4.0), ("host", 6, 2.0)])
def test_decode_matches_the_speculation_reference(params, prompt, skewed, offload, budget, alpha):
    if offload == "host" and not host_offload_supported():
        pytest.skip("no pinned_host memory on this backend")
    A, channels = skewed
    method = InfiniGen.from_skew(A, channels, context=64, kv_budget=budget, alpha=alpha, offload=offload)
    sequence, logits, _, cache = run_method(params, CONFIG, method, prompt, chunk=8, decode_steps=8)
    ref, counts = reference_logits(params, sequence, PROMPT_LEN, A, channels, budget, alpha)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    assert min(counts) < PROMPT_LEN  # the selection really dropped tokens ...
    full, _ = reference_logits(params, sequence, PROMPT_LEN, A, channels, 10_000, 1e9)
    assert np.abs(full - ref)[PROMPT_LEN:].max() > 1e-3  # ... and changed the logits
    assert cache_nbytes(cache) == method.expected_cache_bytes(1, 4)


def test_generate_with_a_calibrated_instance():
    from duo_jax.generation import generate

    config = tiny_config()
    params = duo_jax.init_params(config, jax.random.key(7), scale=0.2)
    prompts = [np.arange(1, 30).tolist(), np.arange(5, 17).tolist()]
    method = InfiniGen.calibrate(params, config, np.arange(40) % config.vocab_size, context=64, kv_budget=6,
                                 offload="device")
    model = duo_jax.Model(config, params, None, "random")
    batch = generate(model, prompts, method=method, max_new_tokens=6, chunk_size=8, stop_at_eos=False)
    alone = generate(model, prompts[1], method=method, max_new_tokens=6, chunk_size=8, stop_at_eos=False)
    assert batch.tokens[1] == alone.tokens[0]
    assert batch.stats["cache_bytes"] == method.expected_cache_bytes(2, 4)
    if host_offload_supported():  # the compiled steps generate runs keep the full cache in host memory
        offloaded = dataclasses.replace(method, offload="host")
        hosted = generate(model, prompts, method=offloaded, max_new_tokens=6, chunk_size=8, stop_at_eos=False)
        assert hosted.tokens == batch.tokens


def test_generate_checks_the_instance_capacity():
    from duo_jax.errors import DuoJaxError
    from duo_jax.generation import generate

    config = tiny_config()
    params = duo_jax.init_params(config, jax.random.key(7), scale=0.2)
    method = InfiniGen.calibrate(params, config, np.arange(40) % config.vocab_size, context=64, kv_budget=6,
                                 offload="device")  # capacity rounds up to 128 tokens
    with pytest.raises(DuoJaxError, match="capacity of 128 tokens"):
        generate(duo_jax.Model(config, params, None, "random"), list(range(1, 120)), method=method,
                 max_new_tokens=20)


def test_generate_calibrates_by_name(tokenizer):
    """generate(method="infinigen") skews on the essays: the same tokens as the instance built by hand."""
    from duo_jax.generation import generate
    from duo_jax.methods.infinigen import skew_on_text

    config = tiny_config(vocab_size=2000)
    params = duo_jax.init_params(config, jax.random.key(3), scale=0.2)
    model = duo_jax.Model(config, params, tokenizer, "tiny")
    prompt = np.arange(1, 40).tolist()
    by_name = generate(model, prompt, method="infinigen", kv_budget=6, max_new_tokens=5, stop_at_eos=False)
    A, channels = skew_on_text(params, config, tokenizer)
    built = InfiniGen.from_skew(A, channels, context=44, kv_budget=6)
    assert by_name.tokens == generate(model, prompt, method=built, max_new_tokens=5, stop_at_eos=False).tokens
    assert by_name.stats["method"] == "infinigen"
    with pytest.raises(duo_jax.DuoJaxError, match="does not take window"):
        generate(model, prompt, method="infinigen", kv_budget=6, window=4)

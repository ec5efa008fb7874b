"""InfiniGen against numpy: the skewing and partial channels, full attention with a budget covering
everything, and a float64 reference of its decode-time speculation written from the authors' Llama code
(snu-comparch/InfiniGen: `accuracy/src/modeling_llama_ours.py` `LlamaModel.forward` / `kv_cache_mask`,
`accuracy/src/modeling_llama_ours_setup.py` `LlamaAttention.forward`, `accuracy/perplexity/table2.sh`):
layers 0 and 1 dense, layer i >= 2 speculating from layer i-1's attention input, alpha 5, partial channels
= union of the top |QA| and top |KA| columns, count = int(mean over heads) capped by the budget."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.methods import cache_nbytes
from duo_jax.methods.infinigen import InfiniGen, _layer_qk, host_offload_supported, skew
from tests.conftest import run_method, tiny_config
from tests.reference_decoder import decode, project

CONFIG = tiny_config(num_layers=4)  # two dense layers, two speculating ones (one from a speculating layer)
PROMPT_LEN = 21
AUTHORS_LLAMA = dict(dense_layers=2, alpha=5.0, channel_rule="qk")  # the original's rules
SINGLE_QUERY_RULES = dict(dense_layers=0, alpha=4.0, channel_rule="q")  # the rules duo-jax had before


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


def top_columns(x, c):
    return set(np.argsort(-np.abs(x).sum(axis=0))[:c].tolist())


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["qk", "q"])
def test_skew_is_orthogonal_and_keeps_the_top_query_and_key_channels(params, sample, rule):
    A, mask = skew(params, CONFIG, sample, partial_ratio=0.25, channel_rule=rule)
    L, K, G, E = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.group_size, CONFIG.head_dim
    assert A.shape == (L, K, E, E) and mask.shape == (L, K, E) and mask.dtype == bool
    union_larger = False
    for l, (q, k) in enumerate(_layer_qk(params, CONFIG, sample)):
        for h in range(K):
            a = A[l, h].astype(np.float64)
            np.testing.assert_allclose(a.T @ a, np.eye(E), atol=1e-5)
            Q = q[:, h * G : (h + 1) * G].reshape(-1, E).astype(np.float64)
            keys = k[:, h].astype(np.float64)
            np.testing.assert_allclose((Q @ a) @ (keys @ a).T, Q @ keys.T, atol=1e-4 * np.abs(Q @ keys.T).max())
            expected = top_columns(Q @ a, 4) | (top_columns(keys @ a, 4) if rule == "qk" else set())
            assert set(np.flatnonzero(mask[l, h]).tolist()) == expected
            union_larger |= len(expected) > 4
    assert union_larger == (rule == "qk")  # the key ranking really adds channels


@pytest.mark.slow
def test_defaults_are_the_authors_llama_rules(params, sample):
    method = InfiniGen.calibrate(params, CONFIG, sample, context=64, kv_budget=6, partial_ratio=0.25)
    assert (method.alpha, method.dense_layers, method.lookahead) == (5.0, 2, True)
    np.testing.assert_array_equal(
        method.channel_mask, skew(params, CONFIG, sample, partial_ratio=0.25, channel_rule="qk")[1]
    )
    with pytest.raises(duo_jax.DuoJaxError, match="channel_rule"):
        skew(params, CONFIG, sample, channel_rule="k")
    with pytest.raises(duo_jax.DuoJaxError, match="dense_layers"):
        dataclasses.replace(method, dense_layers=5)
    for alpha in (float("nan"), -1.0, float("inf")):  # NaN and negative alphas fetched nothing, silently
        with pytest.raises(duo_jax.DuoJaxError, match="alpha must be a finite number >= 0"):
            dataclasses.replace(method, alpha=alpha)
    with pytest.raises(duo_jax.DuoJaxError, match="lookahead must be True or False"):
        dataclasses.replace(method, lookahead="no")


def test_method_is_hashable_and_round_trips_its_skew(skewed):
    A, mask = skewed
    m1 = InfiniGen.from_skew(A, mask, context=64, kv_budget=6)
    m2 = InfiniGen.from_skew(A.copy(), mask.copy(), context=64, kv_budget=6)
    assert hash(m1) == hash(m2) and m1 == m2 and m1.capacity == 128
    np.testing.assert_array_equal(m1.skew_matrices, A)
    np.testing.assert_array_equal(m1.channel_mask, mask)


@pytest.mark.slow
def test_recalibration_of_the_same_shape_compiles_nothing(params, prompt, skewed):
    """The skew is the method's state (an argument of the compiled steps), not a constant baked into them: a
    recalibrated InfiniGen with the same channel widths reuses the executables and still gives its own answer."""
    from duo_jax.engine import compiled_extend

    A, mask = skewed
    rotation = np.linalg.qr(np.random.default_rng(9).normal(size=A.shape[-2:]))[0].astype(np.float32)
    other = InfiniGen.from_skew(A @ rotation, mask, context=64, kv_budget=4, alpha=1.0, offload="device")
    first = InfiniGen.from_skew(A, mask, context=64, kv_budget=4, alpha=1.0, offload="device")
    assert first == other and first.widths == other.widths
    compiled_extend.cache_clear()
    _, alone, _, _ = run_method(params, CONFIG, other, prompt, chunk=8, decode_steps=6)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    _, logits, _, _ = run_method(params, CONFIG, first, prompt, chunk=8, decode_steps=6)
    _, again, _, _ = run_method(params, CONFIG, other, prompt, chunk=8, decode_steps=6)
    assert not compiles
    np.testing.assert_array_equal(again, alone)  # other's own skew, not first's
    assert np.abs(logits - again)[PROMPT_LEN:].max() > 1e-4  # the two calibrations really select differently


@pytest.mark.slow
def test_budget_as_runtime_data(params, prompt, skewed):
    """With budget_slots 8 a decode step fetches 8 rows per KV head and the budget is runtime data: budgets 3, 5 and
    8 run one set of executables, and each gives the float64 reference's logits at its own budget (the ranks past
    the budget fetched but masked). budget_slots below kv_budget is an error naming both."""
    from duo_jax.engine import compiled_extend

    A, mask = skewed
    compiled_extend.cache_clear()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    counts, logits = [], {}
    for budget in (3, 5, 8):
        method = InfiniGen.from_skew(A, mask, context=64, kv_budget=budget, budget_slots=8, offload="device")
        before = len(compiles)
        sequence, logits[budget], _, _ = run_method(params, CONFIG, method, prompt, chunk=8, decode_steps=6)
        counts.append(len(compiles) - before)
        ref, _ = reference_logits(params, sequence, PROMPT_LEN, A, mask, budget, 5.0, 2)
        np.testing.assert_array_less(np.abs(logits[budget] - ref).max(), 1e-4)
    assert counts[0] > 0 and counts[1:] == [0, 0]
    assert np.abs(logits[3] - logits[8])[PROMPT_LEN:].max() > 1e-3  # the budgets really select differently
    three, eight = (InfiniGen.from_skew(A, mask, context=64, kv_budget=b, budget_slots=8) for b in (3, 8))
    assert three == eight and hash(three) == hash(eight) and three != dataclasses.replace(three, budget_slots=None)
    with pytest.raises(duo_jax.DuoJaxError, match="budget_slots must be an integer >= kv_budget = 6"):
        InfiniGen.from_skew(A, mask, context=64, kv_budget=6, budget_slots=5)
    with pytest.raises(duo_jax.DuoJaxError, match="kv_budget is runtime data"):
        three.budget_of(three.calibration)


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["device", "host"])
def test_budget_covering_the_sequence_is_full_attention(params, prompt, skewed, offload):
    if offload == "host" and not host_offload_supported():
        pytest.skip("no pinned_host memory on this backend")
    A, mask = skewed
    method = InfiniGen.from_skew(A, mask, context=64, kv_budget=64, alpha=1e9, offload=offload)
    sequence, logits, _, cache = run_method(params, CONFIG, method, prompt, chunk=8, decode_steps=6)
    dense = np.asarray(duo_jax.forward(params, CONFIG, jnp.asarray([sequence]))[0])
    np.testing.assert_array_less(np.abs(logits - dense).max(), 1e-4)
    widths = [int(mask[l].sum(-1).max()) if l >= 2 else 0 for l in range(CONFIG.num_layers)]  # dense: no partial
    assert [c.partial_k.shape[-1] for c in cache] == widths
    assert cache_nbytes(cache) == method.expected_cache_bytes(1, 4) == 128 * 2 * (4 * 2 * 16 + sum(widths)) * 4
    kind = "pinned_host" if offload == "host" else "device"
    assert cache[0].k.sharding.memory_kind == kind and cache[0].v.sharding.memory_kind == kind
    assert cache[2].partial_k.sharding.memory_kind == "device"


def reference_logits(params, tokens, prompt_len, A, mask, budget, alpha, dense_layers, config=CONFIG):
    """float64, as the authors' Llama code: positions < prompt_len attend causally to everything, and so does
    every position in layers < dense_layers; in layer l >= dense_layers each decode position i speculates with
    the skewed query that layer l's weights make of layer l-1's attention input (layer 0: its own), cut to the
    head's partial channels, against the same channels of the skewed keys of tokens < i; per KV head (max over
    its query group) the tokens within alpha of the max are counted, int(mean count over heads) capped at
    budget are kept by rank, and the position attends exactly to those plus itself. On a layer with a sliding
    window W only the tokens i - W < j <= i are attended, speculated on and counted."""
    T, G, K, E = len(tokens), config.group_size, config.num_kv_heads, config.head_dim
    kept_counts = []
    previous_input = None

    def seen(layer):
        nonlocal previous_input
        l, window = layer.index, config.layer_window(layer.index) or T + 1
        source = layer.normed if previous_input is None else previous_input
        q_spec = project(source, layer.weights, config, np.arange(T))[0]
        previous_input = layer.normed
        keys = np.zeros((K, T, T), bool)
        for i in range(T):
            first = max(i - window + 1, 0)  # the first key the window lets query i see
            if i < prompt_len or l < dense_layers:
                keys[:, i, first : i + 1] = True
                continue
            head_scores = []
            for h in range(K):
                a, ch = A[l, h].astype(np.float64), np.flatnonzero(mask[l, h])
                kp = (layer.k[first:i, h] @ a)[:, ch]
                qp = (q_spec[i, h * G : (h + 1) * G] @ a)[:, ch]
                head_scores.append((qp @ kp.T / math.sqrt(E)).max(axis=0))  # [i - first]
            counts = [int(np.sum(s >= s.max() - alpha)) for s in head_scores]
            n = int(min(int(np.mean(counts)), budget))
            kept_counts.append(n)
            for h, s in enumerate(head_scores):
                keys[h, i, first + np.argsort(-s, kind="stable")[:n]] = True
            keys[:, i, i] = True
        return keys

    return decode(params, config, tokens, seen).logits, kept_counts


@pytest.mark.slow
@pytest.mark.parametrize(
    "offload, budget, rules",
    [("device", 5, AUTHORS_LLAMA), ("host", 6, SINGLE_QUERY_RULES), ("device", 6, dict(AUTHORS_LLAMA, alpha=2.0))],
)
def test_decode_matches_the_speculation_reference(params, prompt, sample, offload, budget, rules):
    if offload == "host" and not host_offload_supported():
        pytest.skip("no pinned_host memory on this backend")
    A, mask = skew(params, CONFIG, sample, partial_ratio=0.25, channel_rule=rules["channel_rule"])
    method = InfiniGen.from_skew(
        A, mask, context=64, kv_budget=budget, alpha=rules["alpha"], dense_layers=rules["dense_layers"], offload=offload
    )
    sequence, logits, _, cache = run_method(params, CONFIG, method, prompt, chunk=8, decode_steps=8)
    ref, counts = reference_logits(params, sequence, PROMPT_LEN, A, mask, budget, rules["alpha"], rules["dense_layers"])
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    assert min(counts) < PROMPT_LEN  # the selection really dropped tokens ...
    full, _ = reference_logits(params, sequence, PROMPT_LEN, A, mask, 10_000, 1e9, 0)
    assert np.abs(full - ref)[PROMPT_LEN:].max() > 1e-3  # ... and changed the logits
    assert cache_nbytes(cache) == method.expected_cache_bytes(1, 4)


@pytest.mark.slow
def test_windowed_layers_match_the_speculation_reference(params, prompt, sample):
    """A 6-token window on layers 1 (dense) and 3 (speculating; layer 2 speculates without a window): a
    speculating layer ranks, counts and fetches only the tokens inside the query's window, under the budget
    of 4 (below the window's 5 earlier tokens). Every logit is the float64 reference's."""
    config = dataclasses.replace(CONFIG, sliding_window=6, window_layers=(1, 3))
    A, mask = skew(params, config, sample, partial_ratio=0.25)  # on the windowed model's queries
    method = InfiniGen.from_skew(A, mask, context=64, kv_budget=4, offload="device")
    sequence, logits, _, _ = run_method(params, config, method, prompt, chunk=8, decode_steps=8)
    ref, counts = reference_logits(params, sequence, PROMPT_LEN, A, mask, 4, 5.0, 2, config=config)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    assert min(counts) < 4 and max(counts) == 4  # the alpha rule counted fewer somewhere, the budget capped it


@pytest.mark.slow
def test_default_instance_decodes_as_the_authors_rules(params, prompt, sample):
    """Built with no options, InfiniGen decodes as the float64 reference of the original's rules; the rules
    duo-jax had before (every layer speculating, alpha 4, |QA| channels) give other logits."""
    method = InfiniGen.calibrate(params, CONFIG, sample, context=64, kv_budget=5, partial_ratio=0.25, offload="device")
    sequence, logits, _, _ = run_method(params, CONFIG, method, prompt, chunk=8, decode_steps=8)
    A, mask = skew(params, CONFIG, sample, partial_ratio=0.25, channel_rule="qk")
    ref, _ = reference_logits(params, sequence, PROMPT_LEN, A, mask, 5, 5.0, 2)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    A, mask = skew(params, CONFIG, sample, partial_ratio=0.25, channel_rule="q")
    old, _ = reference_logits(params, sequence, PROMPT_LEN, A, mask, 5, 4.0, 0)
    assert np.abs(old - ref)[PROMPT_LEN:].max() > 1e-3


@pytest.mark.slow
def test_generate_with_a_calibrated_instance():
    from duo_jax.generation import generate

    config = tiny_config()
    params = duo_jax.init_params(config, jax.random.key(7), scale=0.2)
    prompts = [np.arange(1, 30).tolist(), np.arange(5, 17).tolist()]
    method = InfiniGen.calibrate(
        params, config, np.arange(40) % config.vocab_size, context=64, kv_budget=6, offload="device"
    )
    model = duo_jax.Model(config, params, None, "random")
    batch = generate(model, prompts, method=method, max_new_tokens=6, chunk_size=8, stop_at_eos=False)
    alone = generate(model, prompts[1], method=method, max_new_tokens=6, chunk_size=8, stop_at_eos=False)
    assert batch.tokens[1] == alone.tokens[0]
    assert batch.stats["cache_bytes"] == method.expected_cache_bytes(2, 4)
    if host_offload_supported():  # the compiled steps generate runs keep the full cache in host memory
        offloaded = dataclasses.replace(method, offload="host")
        hosted = generate(model, prompts, method=offloaded, max_new_tokens=6, chunk_size=8, stop_at_eos=False)
        assert hosted.tokens == batch.tokens


@pytest.mark.slow
def test_generate_checks_the_instance_capacity():
    from duo_jax.errors import DuoJaxError
    from duo_jax.generation import generate

    config = tiny_config()
    params = duo_jax.init_params(config, jax.random.key(7), scale=0.2)
    method = InfiniGen.calibrate(
        params, config, np.arange(40) % config.vocab_size, context=64, kv_budget=6, offload="device"
    )  # capacity rounds up to 128 tokens
    with pytest.raises(DuoJaxError, match="capacity of 128 tokens"):
        generate(duo_jax.Model(config, params, None, "random"), list(range(1, 120)), method=method, max_new_tokens=20)


@pytest.mark.slow
def test_generate_calibrates_by_name(tokenizer):
    """generate(method="infinigen") skews on the essays: the same tokens as the instance built by hand."""
    from duo_jax.generation import generate
    from duo_jax.methods.infinigen import skew_on_text

    config = tiny_config(vocab_size=2000)
    params = duo_jax.init_params(config, jax.random.key(3), scale=0.2)
    model = duo_jax.Model(config, params, tokenizer, "tiny")
    prompt = np.arange(1, 40).tolist()
    by_name = generate(model, prompt, method="infinigen", kv_budget=6, max_new_tokens=5, stop_at_eos=False)
    A, mask = skew_on_text(params, config, tokenizer)
    built = InfiniGen.from_skew(A, mask, context=44, kv_budget=6)
    assert by_name.tokens == generate(model, prompt, method=built, max_new_tokens=5, stop_at_eos=False).tokens
    assert by_name.stats["method"] == "infinigen"
    with pytest.raises(duo_jax.DuoJaxError, match="does not take window"):
        generate(model, prompt, method="infinigen", kv_budget=6, window=4)

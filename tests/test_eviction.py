"""H2O and TOVA against a float64 numpy simulation of their eviction rules on a tiny random model, with and
without a sliding window on a layer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.errors import DuoJaxError
from duo_jax.generation import generate
from duo_jax.methods import cache_nbytes, make_method
from tests.conftest import run_method, tiny_config
from tests.reference_decoder import attention, decode

CONFIG = tiny_config()
# Layer 1 attends within 5 tokens (Qwen2-style: a window on some layers only); layer 0 to every earlier token.
WINDOWED = tiny_config(sliding_window=5, window_layers=(1,))


def reference_logits(params, tokens, chunks, rule, budget, recent=0, config=CONFIG, kept_out=None, exact_first=False):
    """Per layer: for each chunk [s, e), every query sees the kept tokens plus the chunk causally (within
    the layer's window W: i - j < W); then the tokens no later query can see (j <= e - W) are dropped, and of
    the others H2O keeps (per KV head) the `recent` newest + the highest accumulated attention, TOVA (per
    layer) the tokens the chunk's last query attends to most, averaged over all heads. `kept_out`: a list
    that receives each layer's final kept positions per KV head (sets). `exact_first`: the first chunk keeps
    every token and adds nothing to the scores (DuoAttention's appendix: an exact prefill, the eviction and its
    scores starting with the next query)."""
    T, G, K = len(tokens), config.group_size, config.num_kv_heads

    def mask(layer):
        window = config.layer_window(layer.index) or T + 1
        seen = np.zeros((K, T, T), bool)
        kept = [[] for _ in range(K)]
        score = np.zeros((K, T))  # attention each token received, summed over queries and the group's heads
        for c, (s, e) in enumerate(chunks):
            candidates = [kept[h] + list(range(s, e)) for h in range(K)]
            for h, i in np.ndindex(K, e - s):
                seen[h, s + i, [j for j in candidates[h] if j <= s + i and s + i - j < window]] = True
            _, probs = attention(layer.q[s:e], layer.k, layer.v, seen[:, s:e])  # [H, e - s, T]
            if exact_first and c == 0:
                kept = candidates
                continue
            score += probs.reshape(K, G, e - s, T).sum(axis=(1, 2))
            for h in range(K):
                candidates[h] = [j for j in candidates[h] if j > e - window]  # out of every later window: dropped
                if len(candidates[h]) > budget and rule == "h2o":
                    newest = [j for j in candidates[h] if j >= e - recent]
                    rest = sorted((j for j in candidates[h] if j < e - recent), key=lambda j: -score[h, j])
                    kept[h] = newest + rest[: budget - len(newest)]
                else:
                    kept[h] = candidates[h]
            if rule == "tova" and len(kept[0]) > budget:
                mean = probs[:, -1].mean(axis=0)  # the chunk's last query, over all heads
                chosen = sorted(kept[0], key=lambda j: -mean[j])[:budget]
                kept = [list(chosen) for _ in range(K)]
        if kept_out is not None:
            kept_out.append([set(row) for row in kept])
        return seen

    return decode(params, config, tokens, mask).logits


@pytest.fixture(scope="module")
def params():
    return duo_jax.init_params(CONFIG, jax.random.key(4), scale=0.3)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(2).integers(0, CONFIG.vocab_size, 17).tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule, chunk, budget, recent", [("h2o", 1, 6, 2), ("h2o", 4, 6, 3), ("tova", 3, 5, 0), ("tova", 1, 4, 0)]
)
def test_matches_the_eviction_reference(params, prompt, rule, chunk, budget, recent):
    options = dict(kv_budget=budget) | (dict(recent=recent) if rule == "h2o" else {})
    method = make_method(rule, CONFIG, context=64, **options)
    sequence, logits, chunks, cache = run_method(params, CONFIG, method, prompt, chunk=chunk, decode_steps=8)
    ref = reference_logits(params, sequence, chunks, rule, budget, recent)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    full = reference_logits(params, sequence, chunks, rule, budget=10_000)
    assert np.abs(full - ref).max() > 1e-2  # eviction really changed the result
    assert cache_nbytes(cache) == method.expected_cache_bytes(1, 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule, budget, recent, impl", [("h2o", 6, 2, "auto"), ("h2o", 6, 2, "xla"), ("tova", 5, 0, "auto")]
)
def test_the_papers_protocol_is_one_chunk_then_decode_steps(params, prompt, rule, budget, recent, impl):
    """DuoAttention's appendix runs H2O and TOVA with an exact prefill of all but the prompt's last N tokens, then
    those N one at a time, the first attending to the whole prefix: their eviction, and H2O's scores, start there.
    That is one chunk of all but the last N - 1 tokens, compressed at its end by its newest query's attention
    (h2o's scores_from="newest"), then N - 1 decode steps: against the float64 reference of the paper's rule; H2O's
    own rule (every prompt query scores) gives other logits."""
    N = 5
    head = len(prompt) - N + 1  # the chunk: the exact prefix and the first of the last N tokens
    options = dict(kv_budget=budget) | (dict(recent=recent, scores_from="newest") if rule == "h2o" else {})
    method = make_method(rule, CONFIG, context=64, **options)
    force = prompt[head:] + [3, 5, 7]
    sequence, logits, _, _ = run_method(
        params, CONFIG, method, prompt[:head], chunk=head, decode_steps=len(force), force=force, impl=impl
    )
    assert sequence == prompt + [3, 5, 7]
    chunks = [(0, len(prompt) - N)] + [(i, i + 1) for i in range(len(prompt) - N, len(sequence))]
    ref = reference_logits(params, sequence, chunks, rule, budget, recent, exact_first=True)
    np.testing.assert_array_less(np.abs(logits - ref[: len(logits)]).max(), 1e-4)
    if rule == "h2o":
        every = make_method(rule, CONFIG, context=64, kv_budget=budget, recent=recent)
        _, own, _, _ = run_method(
            params, CONFIG, every, prompt[:head], chunk=head, decode_steps=len(force), force=force
        )
        assert np.abs(own - logits).max() > 1e-3  # the prompt's scores really change the eviction


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule, budget, recent, impl",
    [
        ("h2o", 6, 2, "auto"),
        ("h2o", 6, 2, "xla"),
        ("tova", 5, 0, "auto"),
        ("tova", 5, 0, "pallas"),
        ("tova", 5, 0, "mosaic"),
    ],
)
def test_whole_prompt_chunk_in_query_blocks_matches_the_reference(params, prompt, rule, budget, recent, impl):
    """One chunk holding the whole prompt (as the evaluations prefill H2O / TOVA). H2O under "xla" takes its
    probabilities 4 queries at a time (`attention_received`; the prompt is not a multiple of 4, so the last block
    is padded), under "auto" from the C++ CPU kernel's sums where it builds; TOVA's chunk runs through the kernels
    (the GPU's and TPU's in interpret mode too), each KV head a batch row."""
    options = dict(kv_budget=budget) | (dict(recent=recent) if rule == "h2o" else {})
    method = dataclasses.replace(make_method(rule, CONFIG, context=64, **options), query_rows=4)
    sequence, logits, chunks, _ = run_method(
        params, CONFIG, method, prompt, chunk=len(prompt), decode_steps=6, impl=impl
    )
    assert chunks[0] == (0, len(prompt)) and len(prompt) % 4
    ref = reference_logits(params, sequence, chunks, rule, budget, recent)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("rule, impl", [("h2o", "xla"), ("h2o", "auto"), ("tova", "auto")])
def test_whole_prompt_chunk_memory_follows_the_query_block(rule, impl):
    """Where H2O's probabilities are materialised (impl="xla"), a whole-prompt chunk holds them one block at a time:
    with 64 query rows the compiled step needs a fraction of the temporary memory of one block holding every query
    (B x T x (budget + T) floats). Through the kernels (TOVA's chunk; H2O's where the C++ CPU kernel sums them)
    they are never held: a fraction either way."""
    from duo_jax.engine import compiled_extend

    config = tiny_config(max_position_embeddings=2048)
    B, T = 2, 1024

    def temp_bytes(rows):
        method = dataclasses.replace(make_method(rule, config, context=T, kv_budget=64), query_rows=rows)
        return compiled_extend(config, method, B, T, "float32", impl).memory_analysis().temp_size_in_bytes

    probs = B * config.num_heads * T * (64 + T) * 4  # one layer's probabilities, all queries at once
    blocked, whole = temp_bytes(64), temp_bytes(B * T)
    materialised = impl == "xla"
    assert blocked < probs / 4 and (whole > probs if materialised else whole < probs / 4), (blocked, whole, probs)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["h2o", "tova"])
def test_budget_covering_the_sequence_is_full_attention(params, prompt, rule):
    method = make_method(rule, CONFIG, context=64, kv_budget=32)
    sequence, logits, _, _ = run_method(params, CONFIG, method, prompt, chunk=5, decode_steps=6)
    dense = np.asarray(duo_jax.forward(params, CONFIG, jnp.asarray([sequence]))[0])
    np.testing.assert_array_less(np.abs(logits - dense).max(), 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule, chunk, budget, recent", [("h2o", 1, 3, 1), ("h2o", 4, 6, 2), ("tova", 3, 3, 0), ("tova", 1, 6, 0)]
)
def test_windowed_layer_matches_the_eviction_reference(params, prompt, rule, chunk, budget, recent):
    """Layer 1 with a 5-token window: the scores are the windowed attention's and the tokens out of every
    later window go first, so the layer keeps at most 4 tokens (budget 6: exactly the window's, budget 3: the
    budget's pick among them) while layer 0 evicts by the budget alone. The kept positions of every KV head
    and every logit are the reference's."""
    options = dict(kv_budget=budget) | (dict(recent=recent) if rule == "h2o" else {})
    method = make_method(rule, WINDOWED, context=64, **options)
    sequence, logits, chunks, cache = run_method(params, WINDOWED, method, prompt, chunk=chunk, decode_steps=6)
    kept = []
    ref = reference_logits(params, sequence, chunks, rule, budget, recent, config=WINDOWED, kept_out=kept)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    for layer, expected in zip(cache, kept):
        positions = np.asarray(layer.positions[0])
        assert [set(row[row >= 0].tolist()) for row in positions] == expected
    assert all(len(row) == min(budget, 4) for row in kept[1])  # at most the window's 4 tokens before the next
    assert [layer.k.shape[2] for layer in cache] == [budget, min(budget, 4)]  # and no slot for more
    assert cache_nbytes(cache) == method.expected_cache_bytes(1, 4)
    assert max(len(row) for row in kept[0]) == budget
    # the window matters: the reference without it (every token visible) gives other logits
    assert np.abs(reference_logits(params, sequence, chunks, rule, budget, recent) - ref).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule, config, impl", [("h2o", CONFIG, "xla"), ("tova", CONFIG, "auto"), ("h2o", WINDOWED, "auto")]
)
def test_budgets_in_one_bucket_share_steps_and_each_matches_the_reference(params, prompt, rule, config, impl):
    """With `budget_slots` 9 the cache holds 9 slots per KV head and the budget (and H2O's recent) is runtime data:
    budgets 6 (recent 3), 4 (recent 1) and 9 (recent 5) compile one prefill step and one decode step between them,
    and each keeps the tokens and gives the logits of the float64 reference at its own budget (prefill in chunks of
    4, then decode steps; on the windowed layer, at most the window's 4 tokens). Equal budget_slots make equal
    methods whatever the budget; without them two budgets are two methods."""
    from duo_jax import engine as engine_lib

    def compiles():
        return engine_lib._compiled_extend.cache_info().misses

    seen = []
    for budget, recent in [(6, 3), (4, 1), (9, 5)]:
        options = dict(kv_budget=budget, budget_slots=9) | (dict(recent=recent) if rule == "h2o" else {})
        method = make_method(rule, config, context=64, **options)
        before = compiles()
        sequence, logits, chunks, cache = run_method(params, config, method, prompt, chunk=4, decode_steps=6, impl=impl)
        seen.append(compiles() - before)
        kept = []
        ref = reference_logits(params, sequence, chunks, rule, budget, recent if rule == "h2o" else 0, config, kept)
        np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
        for layer, expected in zip(cache, kept):
            positions = np.asarray(layer.positions[0])
            assert [set(row[row >= 0].tolist()) for row in positions] == expected
        assert cache[0].k.shape[2] == 9 and cache_nbytes(cache) == method.expected_cache_bytes(1, 4)
    assert seen[0] > 0 and seen[1:] == [0, 0], seen
    six, four = (make_method(rule, config, context=64, kv_budget=b, budget_slots=9) for b in (6, 4))
    assert six == four and hash(six) == hash(four)
    assert make_method(rule, config, context=64, kv_budget=6) != make_method(rule, config, context=64, kv_budget=4)
    with pytest.raises(
        DuoJaxError,
        match="budget_slots must be an integer >= budget = 6 .the tokens it holds., got 5: raise budget_slots or lower",
    ):
        make_method(rule, config, context=64, kv_budget=6, budget_slots=5)
    with pytest.raises(DuoJaxError, match="budget_slots must be an integer"):
        dataclasses.replace(six, budget_slots=True)


@pytest.mark.slow
def test_generate_with_eviction_methods(params, prompt):
    model = duo_jax.Model(CONFIG, params, None, "random")
    for rule in ("h2o", "tova"):
        out = generate(
            model, [prompt, prompt[:9]], method=rule, kv_budget=6, max_new_tokens=5, chunk_size=4, stop_at_eos=False
        )
        alone = generate(model, prompt[:9], method=rule, kv_budget=6, max_new_tokens=5, chunk_size=4, stop_at_eos=False)
        assert out.tokens[1] == alone.tokens[0] and out.stats["method"] == rule


def test_tova_through_cudnn_without_triton_matches_the_xla_path(params, prompt, monkeypatch):
    """A GPU without Triton, bf16: TOVA's chunks attend each KV head's kept tokens (filled first) and then the
    chunk's own through cuDNN's two calls, its decode steps both in one call (the XLA stand-in, counted), with the
    XLA path's logits."""
    from duo_jax.attention import cudnn, dispatch

    params16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    method = make_method("tova", CONFIG, context=64, kv_budget=5)
    calls = []

    def counted(*args, **kwargs):
        calls.append((args[0].shape[1], args[1].shape[1]))  # (queries, keys) of the call
        return cudnn.xla_part(*args, **kwargs)

    sequence, want, _, _ = run_method(params16, CONFIG, method, prompt, chunk=4, decode_steps=4, impl="xla")
    force = sequence[len(prompt) :]  # the same tokens fed to both (bf16 rounding may flip a near tie)
    monkeypatch.setattr(dispatch, "resolve_impl", lambda impl: "cudnn" if impl in ("auto", "cudnn") else impl)
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")
    monkeypatch.setattr(cudnn, "_cudnn", counted)
    _, got, _, _ = run_method(params16, CONFIG, method, prompt, chunk=4, decode_steps=4, impl="cudnn", force=force)
    assert (4, 5) in calls and (4, 4) in calls  # a chunk over the 5 kept tokens, and over its own 4
    assert (1, 6) in calls and (1, 1) not in calls  # a step over the 5 kept tokens and its own key, in one call
    assert np.abs(got - want).max() < 3e-2 * np.abs(want).max()


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("h2o", {}, "needs kv_budget"),
        ("tova", {"recent": 3, "kv_budget": 4}, "does not take recent"),
        ("h2o", {"kv_budget": 4, "recent": 5}, r"recent window must lie in \[0, kv_budget=4\]"),
    ],
)
def test_errors(name, options, message):
    with pytest.raises(DuoJaxError, match=message):
        make_method(name, CONFIG, context=32, **options)

"""StreamingLLM (sinks + rolling window, positions re-indexed in the cache) against a float64 numpy reference."""

import jax
import numpy as np
import pytest

import duo_jax
from duo_jax.errors import DuoJaxError
from duo_jax.generation import generate
from duo_jax.methods import StreamingLLM, cache_nbytes, make_method
from tests.conftest import run_method, tiny_config
from tests.reference_decoder import decode

CONFIG = tiny_config(max_position_embeddings=64)
START, RECENT = 2, 4


def reference_logits(params, tokens, chunk_starts, start=START, recent=RECENT):
    """Query i in a chunk starting at c sees keys j <= i with j < start or j >= c - recent. Positions are
    re-indexed: the visible keys before the chunk are numbered 0, 1, ... in order, the chunk continues."""
    T = len(tokens)
    seen = np.zeros((T, T), bool)
    q_positions, k_positions = np.zeros(T, int), np.zeros((T, T), int)
    for i in range(T):
        c = chunk_starts[i]
        before = [j for j in range(c) if j < start or j >= c - recent]
        seen[i, before + list(range(c, i + 1))] = True
        q_positions[i] = len(before) + i - c
        k_positions[i, before] = np.arange(len(before))
        k_positions[i, c : i + 1] = len(before) + np.arange(i + 1 - c)
    return decode(params, CONFIG, tokens, lambda layer: seen, positions=(q_positions, k_positions)).logits


@pytest.fixture(scope="module")
def params():
    return duo_jax.init_params(CONFIG, jax.random.key(3), scale=0.2)


@pytest.mark.slow
def test_matches_the_reindexed_reference(params):
    prompt = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 19).tolist()
    chunk, steps = 5, 8
    method = make_method("streaming_llm", CONFIG, context=64, start=START, recent=RECENT)
    sequence, logits, _, cache = run_method(params, CONFIG, method, prompt, chunk=chunk, decode_steps=steps)
    starts = [(i // chunk) * chunk if i < len(prompt) else i for i in range(len(sequence))]
    ref = reference_logits(params, sequence, starts)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    assert cache_nbytes(cache) == method.expected_cache_bytes(1, 4) == 2 * 2 * 2 * 6 * 16 * 4


@pytest.mark.slow
def test_windows_in_one_ring_share_steps_and_each_matches_the_reference(params):
    """A ring of 12 slots (`ring_slots`) holds the window as data: windows (2, 4), (1, 7) and (0, 12) compile one
    prefill step and one decode step between them, and each gives the re-indexed reference's logits."""
    from duo_jax import engine

    prompt = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 19).tolist()
    chunk, steps, compiled = 5, 8, []
    for start, recent in [(2, 4), (1, 7), (0, 12)]:
        method = make_method("streaming_llm", CONFIG, context=64, start=start, recent=recent, ring_slots=12)
        before = engine._compiled_extend.cache_info().misses
        sequence, logits, _, cache = run_method(params, CONFIG, method, prompt, chunk=chunk, decode_steps=steps)
        compiled.append(engine._compiled_extend.cache_info().misses - before)
        starts = [(i // chunk) * chunk if i < len(prompt) else i for i in range(len(sequence))]
        np.testing.assert_array_less(
            np.abs(logits - reference_logits(params, sequence, starts, start, recent)).max(), 1e-4
        )
        assert cache_nbytes(cache) == method.expected_cache_bytes(1, 4) == 2 * 2 * 2 * 12 * 16 * 4
    assert compiled[1:] == [0, 0], compiled
    with pytest.raises(DuoJaxError, match="ring_slots must be an integer >= start \\+ recent = 9"):
        make_method("streaming_llm", CONFIG, context=64, start=2, recent=7, ring_slots=8)
    with pytest.raises(DuoJaxError, match="ring_slots must be an integer >= start \\+ recent = 22"):
        StreamingLLM(2, 2, 16, 2, 20, None, 8)  # built directly: a ring too small would drop tokens silently
    with pytest.raises(DuoJaxError, match="ring_slots must be an integer"):
        make_method("streaming_llm", CONFIG, context=64, start=0, recent=1, ring_slots=True)
    # a budget sets recent: the two together were the budget's, recent silently overwritten
    with pytest.raises(DuoJaxError, match="streaming_llm takes kv_budget or recent, not both .kv_budget=20 keeps"):
        make_method("streaming_llm", CONFIG, context=64, kv_budget=20, recent=5)
    assert make_method("streaming_llm", CONFIG, context=64, kv_budget=20).recent == 16
    assert make_method("streaming_llm", CONFIG, context=64).recent == 256


@pytest.mark.slow
def test_reindexing_differs_from_absolute_positions_and_outlives_the_context(params):
    prompt = list(range(1, 41))
    kwargs = dict(max_new_tokens=40, chunk_size=8, stop_at_eos=False, sink=START, recent=RECENT)
    streaming = generate(duo_jax.Model(CONFIG, params, None, "random"), prompt, method="streaming_llm", **kwargs)
    assert len(streaming.tokens[0]) == 40  # 80 tokens on a model trained for 64
    assert streaming.stats["cache_bytes"] == StreamingLLM(2, 2, 16, START, RECENT).expected_cache_bytes(1, 4)
    with pytest.raises(DuoJaxError, match="exceeds the model's context of 64.*streaming_llm"):
        generate(
            duo_jax.Model(CONFIG, params, None, "random"),
            prompt,
            method="full",
            **{k: v for k, v in kwargs.items() if k not in ("sink", "recent")},
        )
    short = dict(kwargs, max_new_tokens=10)
    absolute = generate(
        duo_jax.Model(CONFIG, params, None, "random"),
        prompt[:30],
        pattern=duo_jax.Pattern.full(2, 2),
        sparsity=1.0,
        **short,
    )
    reindexed = generate(duo_jax.Model(CONFIG, params, None, "random"), prompt[:30], method="streaming_llm", **short)
    assert absolute.tokens != reindexed.tokens


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("h3o", {}, "unknown method 'h3o'"),
        ("streaming_llm", {"sparsity": 0.5}, "does not take sparsity"),
        ("streaming_llm", {"start": -1}, "start must be >= 0 and recent >= 1"),
        ("streaming_llm", {"recent": 0}, r"recent >= 1 \(a ring of the newest tokens\)"),
        ("streaming_llm", {"start": 4, "kv_budget": 4}, "recent=0 from kv_budget=4"),
        ("duo", {}, "needs a head pattern"),
        ("full", {"recent": 3}, "does not take recent"),
    ],
)
def test_method_errors(name, options, message):
    with pytest.raises(DuoJaxError, match=message):
        make_method(name, CONFIG, context=32, **options)


def test_kv_budget_sets_comparable_windows():
    from duo_jax.methods import duo_sparsity_for_budget

    streaming = make_method("streaming_llm", CONFIG, context=64, kv_budget=20)
    assert (streaming.start, streaming.recent) == (4, 16)
    # duo at context 1000 with 64 + 256 windows: half the heads full gives (1000 + 320) / 2 = 660 per head; the
    # sparsity returned lies halfway between those at which the binarisation keeps that many heads.
    for heads in (4, 90, 256, 1024):
        sparsity = duo_sparsity_for_budget(660, context=1000, window=320, heads=heads)
        assert duo_jax.Pattern.full(1, heads).retrieval_mask(sparsity).sum() == heads // 2
        for budget in np.linspace(320, 1000, 37):  # R = floor(r * N + 1/2) heads at every budget
            sparsity = duo_sparsity_for_budget(budget, context=1000, window=320, heads=heads)
            expected = np.floor((budget - 320) / 680 * heads + 0.5)
            assert duo_jax.Pattern.full(1, heads).retrieval_mask(sparsity).sum() == expected
    assert duo_sparsity_for_budget(100, context=1000, window=320, heads=90) == 1.0
    assert duo_sparsity_for_budget(1000, context=1000, window=320, heads=90) == 0.0
    duo = make_method("duo", CONFIG, context=1000, pattern=duo_jax.Pattern(np.arange(4.0).reshape(2, 2)), kv_budget=660)
    assert sum(duo.layout.num_retrieval) == 2
    with pytest.raises(DuoJaxError, match="kv_budget"):
        make_method("streaming_llm", CONFIG, context=64, kv_budget=0)
    # A capacity below the window: the least budget is the capacity, and the refusal says so (it said sink + recent).
    gates = duo_jax.Pattern(np.arange(4.0).reshape(2, 2))
    with pytest.raises(
        DuoJaxError, match=r"capacity, 128\); pass a smaller sink / recent, or a kv_budget of at least 128"
    ):
        make_method("duo", CONFIG, context=100, pattern=gates, kv_budget=127)
    assert sum(make_method("duo", CONFIG, context=100, pattern=gates, kv_budget=128).layout.num_retrieval) == 0

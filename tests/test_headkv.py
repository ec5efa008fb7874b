"""HeadKV: per-head budgets from head scores, SnapKV selection per head, the packed decode cache."""

import jax
import numpy as np
import pytest

import duo_jax
from duo_jax.errors import DuoJaxError
from duo_jax.methods.headkv import duo_headkv_budget, headkv_budgets, make_duo_headkv, make_headkv, resolve_scores
from tests.conftest import tiny_config
from tests.test_snapkv import CONFIG, WINDOW, check_against_reference, reference_logits, run_engine

# Layer 0 favours KV head 0, layer 1 KV head 1.
SCORES = np.array([[0.9, 0.1], [0.3, 0.7]])


@pytest.fixture(scope="module")
def params():
    return duo_jax.init_params(CONFIG, jax.random.key(1), scale=0.2)


def test_budgets_follow_the_formula():
    # b = 10, beta = 1.25: every head keeps 10 - 8 = 2, the pool of 8 * 4 = 32 goes by score share.
    budgets = headkv_budgets(SCORES, base=10, beta=1.25)
    share = SCORES / SCORES.sum()  # 0.45, 0.05, 0.15, 0.35
    np.testing.assert_array_equal(budgets, np.round(share * 32 + 2))
    np.testing.assert_array_equal(budgets, [[16, 4], [7, 13]])
    assert budgets.sum() == 4 * 10
    np.testing.assert_array_equal(headkv_budgets(np.ones((3, 4)), base=50, beta=1.1), np.full((3, 4), 50))
    np.testing.assert_array_equal(headkv_budgets(SCORES, base=10, beta=1e9), np.full((2, 2), 10))


@pytest.mark.slow
def test_matches_the_float64_reference(params):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (44, 37)]
    continuations = rng.integers(0, CONFIG.vocab_size, (2, 6)).tolist()
    method = make_headkv(CONFIG, context=64, scores=duo_jax.Pattern(SCORES), kv_budget=16, beta=1.25, window=WINDOW)
    assert method.budgets == ((16, 4), (7, 13)) and (method.kernel, method.pooling) == (7, "max")
    _, cache, decode = check_against_reference(params, method, prompts, continuations, 7, "max")
    assert decode.name == "headkv"
    # The heads are packed: each layer holds exactly its heads' budgets plus their windows.
    assert decode.head_slots == ((22, 10), (13, 19))
    assert [layer.k.shape[1] for layer in cache] == [32, 32]


@pytest.mark.parametrize(
    "scores, options, message",
    [
        (np.ones((3, 2)), {}, "shape 3x2.*2x2"),
        (-SCORES, {}, "non-negative"),
        (np.zeros((2, 2)), {}, "positive sum"),
        (SCORES, dict(beta=0.5), "beta must be >= 1"),
        (SCORES, dict(kv_budget=4), "at least the observation window"),
    ],
)
def test_bad_options_are_clear_errors(scores, options, message):
    with pytest.raises(DuoJaxError, match=message):
        make_headkv(CONFIG, context=64, scores=scores, **dict(dict(kv_budget=16), **options))


@pytest.mark.slow
@pytest.mark.parametrize("window_layers", [None, (0, 2)])
def test_duo_with_headkv_retrieval_heads_matches_the_float64_reference(window_layers):
    """Layer 0: both heads retrieval (budgets 11 and 5), layer 1: both streaming, layer 2: head 1 retrieval.
    With a 16-token window on layers 0 and 2, their retrieval heads select among the 9 prefix tokens still
    visible (budget 11 keeps those 9, budgets 5 and 8 choose) and the streaming heads' sinks fall out of it."""
    window = None if window_layers is None else 16
    config = tiny_config(num_layers=3, max_position_embeddings=128, sliding_window=window, window_layers=window_layers)
    params = duo_jax.init_params(config, jax.random.key(3), scale=0.2)
    pattern = duo_jax.Pattern([[0.9, 0.8], [0.1, 0.2], [0.3, 0.7]])
    scores = np.array([[0.5, 0.1], [0.9, 0.9], [0.2, 0.3]])  # the streaming heads' scores do not count
    sink, recent, chunk = 2, 5, 8
    method = make_duo_headkv(
        config,
        context=64,
        pattern=pattern,
        sparsity=0.5,
        scores=scores,
        kv_budget=14,
        beta=2.0,
        sink=sink,
        recent=recent,
        window=WINDOW,
    )
    assert method.budgets == ((11, 5), (), (8,))  # b = 8, pool 4 * 3 = 12 by shares 5/9, 1/9, 3/9
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (45, 38)]
    continuations = rng.integers(0, config.vocab_size, (2, 6)).tolist()
    logits, cache, decode, _ = run_engine(params, config, method, prompts, continuations, chunk=chunk, first=3)
    assert decode.name == "duo_headkv" and decode.head_slots == ((17, 11), (), (14,))

    mask = np.array(method.retrieval_mask)
    budgets = np.zeros((3, 2), int)
    budgets[mask] = [11, 5, 8]
    for b, (prompt, cont) in enumerate(zip(prompts, continuations)):
        P = len(prompt)
        starts = [(i // chunk) * chunk for i in range(P)] + [P] * 3 + list(range(P + 3, P + len(cont)))
        ref, kept = reference_logits(
            params,
            config,
            prompt + cont,
            P,
            budgets.tolist(),
            kernel=7,
            pooling="max",
            streaming=~mask,
            sink=sink,
            recent=recent,
            chunk_starts=starts,
        )
        for l in range(3):
            positions = np.asarray(cache[l].retrieval.positions[b])
            bounds = np.cumsum((0,) + decode.head_slots[l])
            for head, s, e in zip(np.flatnonzero(mask[l]), bounds[:-1], bounds[1:]):  # reordered: retrieval first
                assert set(positions[s:e][positions[s:e] >= 0].tolist()) == kept[l][head]
                if window_layers is not None and l != 1:
                    assert len(kept[l][head]) == min(budgets[l, head], 9) + WINDOW
        np.testing.assert_array_less(np.abs(logits[b] - ref).max(), 1e-4)


def test_duo_headkv_budget_refuses_a_share_below_the_observation_window():
    """The evaluations' rule gives duo_headkv's retrieval heads what the streaming heads leave of the budget; a share
    below the window each keeps whole is refused there, naming the budget and the way out, not later by the builder
    as a kv_budget the caller never passed. One token more of budget builds."""
    config = tiny_config(num_layers=3)
    rule = dict(
        sink=64,
        recent=256,
        sparsity=0.5,  # 3 of 6 retrieval heads; the window fitted to 0 + 1
        pattern=duo_jax.Pattern([[0.9, 0.8], [0.1, 0.2], [0.3, 0.7]]),
        scores=np.array([[0.5, 0.1], [0.9, 0.9], [0.2, 0.3]]),
    )
    with pytest.raises(DuoJaxError, match="budget of 4 tokens per head.*keep 7 tokens each.*raise the sparsity"):
        duo_headkv_budget(config, 4, **rule)  # (6 * 4 - 3 * 1) / 3 = 7 < 8
    options = duo_headkv_budget(config, 5, **rule)
    assert (options["sink"], options["recent"], options["kv_budget"]) == (0, 1, 9)
    assert sum(map(len, make_duo_headkv(config, context=64, **options).budgets)) == 3
    with pytest.raises(DuoJaxError, match="no retrieval head.*lower the sparsity"):
        duo_headkv_budget(config, 64, **dict(rule, sparsity=1.0))


def test_head_scores_resolution():
    with pytest.raises(duo_jax.DuoJaxError, match="ships no HeadKV head scores"):
        resolve_scores("default", duo_jax.get_config("llama3-8b"))
    config = duo_jax.get_config("smollm2-135m")
    shipped = resolve_scores("default", config)  # configs/scores/smollm2-135m, from python -m duo_jax.head_scores
    assert shipped.gates.shape == (30, 3) and shipped.meta["kind"] == "headkv_head_scores"
    assert resolve_scores(None, config) is None and resolve_scores(shipped, config) is shipped
    with pytest.raises(duo_jax.PatternError):
        resolve_scores(duo_jax.Pattern.full(2, 2), config)

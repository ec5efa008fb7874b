"""HeadKV head scoring: the score on hand-made attention maps, the teacher-forced forward against a float64
reference, and the whole procedure on a tiny random model with a real BPE tokenizer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.data import DataError, encode, haystack_tokens, make_needle_prompt
from duo_jax.errors import DuoJaxError
from duo_jax.head_scores import (
    REASONING,
    RETRIEVAL,
    ScoringNeedle,
    answer_span,
    load_scores,
    main,
    needle_attention_score,
    prompt_scores,
    score_heads,
)
from duo_jax.methods.headkv import make_headkv
from tests.conftest import tiny_config
from tests.reference_decoder import decode

CONFIG = tiny_config(vocab_size=2000, max_position_embeddings=256)


def test_score_on_hand_made_attention_maps():
    """Answer span [4, 6), N = 2 steps over 10 keys; each step's top-2 keys inside the span add attention / 2."""
    probs = np.zeros((4, 2, 10))
    probs[0, :, 4] = probs[0, :, 5] = 0.5  # all attention on the answer: 2 steps x (0.5 + 0.5) / 2 = 1
    probs[1, :, 0] = probs[1, :, 9] = 0.5  # none on it
    probs[2, 0, [4, 1, 5]] = [0.6, 0.3, 0.1]  # step 0: top-2 are keys 4 and 1, only 4 counts: 0.3
    probs[2, 1] = 0.1  # step 1: a tie everywhere, the top-2 are keys 0 and 1: nothing
    probs[3, :, [2, 3]] = 0.5  # a distractor just before the answer
    scores = needle_attention_score(jnp.asarray(probs), 4, 6)
    np.testing.assert_allclose(scores, [1.0, 0.0, 0.3, 0.0], atol=1e-7)
    assert int(jnp.argmax(scores)) == 0


def test_needles_and_answer_spans(tokenizer):
    for needle in (RETRIEVAL, REASONING):
        start, end = answer_span(tokenizer, needle)
        ids = encode(tokenizer, needle.needle)
        assert needle.answer in tokenizer.decode(ids[start:end].tolist())
        # The span is tight: dropping either end token loses part of the answer.
        assert needle.answer not in tokenizer.decode(ids[start + 1 : end].tolist())
        assert needle.answer not in tokenizer.decode(ids[start : end - 1].tolist())
    assert REASONING.distractor not in tokenizer.decode(
        encode(tokenizer, REASONING.needle)[slice(*answer_span(tokenizer, REASONING))].tolist()
    )
    with pytest.raises(DataError, match="not part of the needle"):
        ScoringNeedle("x", "a b c", "d", "q", "{context}")


@pytest.fixture(scope="module")
def params():
    return duo_jax.init_params(CONFIG, jax.random.key(2), scale=0.2)


def reference_scores(params, tokens, start, end, n):
    """Float64: per layer and query head, the score of the n answer-step queries' attention; and the greedy
    next tokens at those steps."""
    T = len(tokens)
    ref = decode(params, CONFIG, tokens)
    scores = np.zeros((CONFIG.num_layers, CONFIG.num_heads))
    for l, probs in enumerate(ref.probs):
        for i in range(T - 1 - n, T - 1):
            for head in range(CONFIG.num_heads):
                top = np.argsort(-probs[head, i, : i + 1], kind="stable")[:n]
                scores[l, head] += probs[head, i, top][(top >= start) & (top < end)].sum() / n
    return scores, ref.logits[T - 1 - n : T - 1].argmax(-1)


@pytest.mark.slow
def test_prompt_scores_match_the_float64_reference(params):
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 40)
    start, end, n = 12, 17, 5
    scores, predicted = prompt_scores(params, jnp.asarray(tokens[None]), start, end, config=CONFIG, n=n)
    ref_scores, ref_predicted = reference_scores(params, tokens, start, end, n)
    np.testing.assert_allclose(scores, ref_scores, atol=1e-5)
    assert ref_scores.max() > 0.05  # the span holds a real share of the top attention
    np.testing.assert_array_equal(predicted, ref_predicted)


@pytest.mark.slow
def test_score_heads_on_a_tiny_model(params, tokenizer, tmp_path):
    scores = score_heads(params, CONFIG, tokenizer, lengths=[150, 200], depths=[0.0, 0.5, 1.0], min_accuracy=0.0)
    assert scores.gates.shape == (CONFIG.num_layers, CONFIG.num_kv_heads)
    assert 0.0 < scores.gates.max() <= 1.0 and scores.gates.min() >= 0.0
    assert scores.meta["needle"] == "reasoning" and scores.meta["prompts_used"] == 6
    assert scores.meta["haystack"] == "paul_graham:calibration"  # held out from the evaluations' half
    loaded = load_scores(scores.save(tmp_path / "r2"), CONFIG)
    np.testing.assert_array_equal(loaded.gates, scores.gates)
    assert loaded.meta == scores.meta
    method = make_headkv(CONFIG, context=256, scores=loaded, kv_budget=24)
    assert sum(map(sum, method.budgets)) == pytest.approx(4 * 16, abs=2)
    # One prompt alone gives that prompt's scores, per KV head the mean of its query heads.
    alone = score_heads(params, CONFIG, tokenizer, needle=RETRIEVAL, lengths=[150], depths=[0.5], min_accuracy=0.0)
    prompt = make_needle_prompt(
        tokenizer,
        haystack_tokens(tokenizer, "paul_graham:calibration", 150),
        150,
        0.5,
        needle=RETRIEVAL.needle,
        question=RETRIEVAL.question,
        template=RETRIEVAL.template,
    )
    start, end = answer_span(tokenizer, RETRIEVAL)
    answer = encode(tokenizer, RETRIEVAL.needle)[start:end]
    direct, _ = prompt_scores(
        params,
        jnp.asarray(np.concatenate([prompt.tokens, answer])[None]),
        prompt.needle_start + start,
        prompt.needle_start + end,
        config=CONFIG,
        n=len(answer),
    )
    np.testing.assert_allclose(alone.gates, np.asarray(direct).reshape(2, 2, 2).mean(-1), atol=1e-6)


def test_score_heads_errors(params, tokenizer, tmp_path):
    with pytest.raises(DataError, match="no prompt reached min_accuracy"):
        score_heads(params, CONFIG, tokenizer, lengths=[150], depths=[0.5], min_accuracy=1.0)
    with pytest.raises(DataError, match="exceed the model's context"):
        score_heads(params, CONFIG, tokenizer, lengths=[250], depths=[0.5])
    duo_jax.Pattern(np.ones((2, 2)), dict(kind="something else")).save(tmp_path / "other")
    with pytest.raises(DuoJaxError, match="holds .something else. .*not HeadKV scores"):
        load_scores(tmp_path / "other")


def test_command_line_reports_errors(capsys, tmp_path):
    assert main(["/nonexistent/model", str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err
    # Refused before the model loads (min_accuracy 2 failed after every prompt was scored; lengths -1 was named
    # n_tokens): the model here does not exist, so a later check would name it instead.
    for args, message in (
        (["--min-accuracy", "2"], "min_accuracy must be a finite number >= 0 and <= 1"),
        (["--min-accuracy", "nan"], "min_accuracy must be a finite number"),
        (["--lengths", "100", "-1"], "lengths must be an integer >= 1"),
    ):
        assert main(["/nonexistent/model", str(tmp_path / "out"), *args]) == 2
        assert message in capsys.readouterr().err, args

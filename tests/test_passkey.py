"""DuoAttention's multi-passkey training samples: layout, depths, supervision, determinism, errors."""

import numpy as np
import pytest

from duo_jax.data import (
    DataError,
    SampleStream,
    context_lengths,
    haystack_tokens,
    make_sample,
    min_context_len,
)
from duo_jax.data.passkey import BOOK_PREFIX, BOOK_SUFFIX, NATO_ALPHABET, NEEDLE_TEMPLATE, ORDINALS


@pytest.fixture(scope="session")
def haystack(tokenizer):
    return haystack_tokens(tokenizer, "paul_graham", 16_000)


def _find(tokens, sub) -> int:
    """Start of the first occurrence of token sequence `sub` in `tokens`."""
    sub = np.asarray(sub)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, len(sub))
    hits = np.flatnonzero((windows == sub).all(axis=1))
    assert len(hits), "sequence not found"
    return int(hits[0])


def _runs(mask):
    """(start, end) of each run of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


@pytest.mark.parametrize("context_len", [4000, 8000, 16000])
def test_sample_layout_length_and_supervision(tokenizer, haystack, context_len):
    sample = make_sample(tokenizer, haystack, context_len, np.random.default_rng(context_len), supervise="answers")
    assert sample.tokens.dtype == np.int32 and sample.supervise.dtype == bool
    assert len(sample.tokens) == len(sample.supervise) == sample.context_len == context_len  # exact length

    assert len(sample.passkeys) == 10
    for passkey in sample.passkeys:
        words = passkey.split(" ")
        assert len(words) == 32 and set(words) <= set(NATO_ALPHABET)
    assert len(set(sample.passkeys)) == 10
    assert sample.depths == sorted(sample.depths) and 0.05 <= sample.depths[0] and sample.depths[-1] <= 0.95

    # The supervised positions are exactly the ten answers, in order.
    runs = _runs(sample.supervise)
    assert [tokenizer.decode(sample.tokens[a:b]) for a, b in runs] == [" " + p for p in sample.passkeys]

    text = tokenizer.decode(sample.tokens)
    assert text.startswith(BOOK_PREFIX)
    for ordinal, passkey in zip(ORDINALS, sample.passkeys):
        assert (
            f"Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey: {passkey}\n\n"
        ) in text
    assert text.endswith(f"Passkey: {sample.passkeys[-1]}\n\n")


def test_needles_sit_at_their_depths(tokenizer, haystack):
    sample = make_sample(tokenizer, haystack, 8000, np.random.default_rng(3))
    head = len(tokenizer.encode(BOOK_PREFIX))
    needles = [
        tokenizer.encode(NEEDLE_TEMPLATE.format(ordinal=o, passkey=p)) for o, p in zip(ORDINALS, sample.passkeys)
    ]
    starts = [_find(sample.tokens, n) for n in needles]
    hay_len = _find(sample.tokens, tokenizer.encode(BOOK_SUFFIX)) - head - sum(map(len, needles))
    assert sample.tokens[head : head + 50].tolist() == haystack[:50]  # the haystack is used from its start
    for k, (start, depth) in enumerate(zip(starts, sample.depths)):
        haystack_before = start - head - sum(len(n) for n in needles[:k])
        assert haystack_before == round(depth * hay_len)


def test_qa_supervision_is_the_default_and_covers_everything_after_the_context(tokenizer, haystack):
    sample = make_sample(tokenizer, haystack, 6000, np.random.default_rng(1))  # supervise="qa", the original's
    assert np.array_equal(
        sample.supervise, make_sample(tokenizer, haystack, 6000, np.random.default_rng(1), supervise="qa").supervise
    )
    context_end = _find(sample.tokens, tokenizer.encode(BOOK_SUFFIX)) + len(tokenizer.encode(BOOK_SUFFIX))
    assert not sample.supervise[:context_end].any() and sample.supervise[context_end:].all()
    assert tokenizer.decode(sample.tokens[context_end:]).startswith("Based on the content of the book, what is")
    # the position right after "Passkey:" (whose hidden state retrieves each first word) is supervised with
    # "qa" and not with "answers": "answers" starts at each answer's first token.
    answers = make_sample(tokenizer, haystack, 6000, np.random.default_rng(1), supervise="answers").supervise
    for start, _ in _runs(answers):
        assert tokenizer.decode(sample.tokens[:start]).endswith("Passkey:")
        assert sample.supervise[start - 1] and not answers[start - 1]


def test_bos_and_fewer_shorter_passkeys(tokenizer, haystack):
    sample = make_sample(
        tokenizer,
        haystack,
        1000,
        np.random.default_rng(0),
        num_passkeys=3,
        passkey_words=5,
        bos_id=2000,
        supervise="answers",
    )  # outside the 2000-token vocabulary
    assert sample.tokens[0] == 2000 and (sample.tokens == 2000).sum() == 1 and len(sample.tokens) == 1000
    assert len(sample.passkeys) == 3 and all(len(p.split()) == 5 for p in sample.passkeys)
    runs = _runs(sample.supervise)
    assert [tokenizer.decode(sample.tokens[a:b]).strip() for a, b in runs] == sample.passkeys


def test_stream_is_deterministic_per_seed_and_step(tokenizer, haystack):
    lengths = context_lengths(4000, 16000, 4)
    stream = SampleStream(tokenizer, haystack, lengths, seed=7)
    again = SampleStream(tokenizer, haystack, lengths, seed=7)
    first, first_again = stream[3], again[3]
    assert np.array_equal(first.tokens, first_again.tokens) and first.passkeys == first_again.passkeys
    assert np.array_equal(first.supervise, first_again.supervise) and first.depths == first_again.depths
    assert stream[4].passkeys != first.passkeys
    assert SampleStream(tokenizer, haystack, lengths, seed=8)[3].passkeys != first.passkeys
    assert {stream[i].context_len for i in range(12)} <= set(lengths)
    assert len({stream[i].context_len for i in range(12)}) > 1
    with pytest.raises(DataError, match="steps are numbered from 0"):
        stream[-1]


def test_stream_checks_lengths_up_front(tokenizer, haystack):
    shortest = min_context_len(tokenizer)
    for seed in range(3):  # the bound holds whatever passkeys are drawn
        assert len(make_sample(tokenizer, haystack, shortest, np.random.default_rng(seed)).tokens) == shortest
    with pytest.raises(DataError, match=f"use lengths >= {shortest}"):
        SampleStream(tokenizer, haystack, context_lengths(), seed=0)  # the paper's 1,000-token low end
    with pytest.raises(DataError, match="fewer than the longest context"):
        SampleStream(tokenizer, haystack[:5000], [shortest, 8000], seed=0)
    with pytest.raises(DataError, match="at least one context length"):
        SampleStream(tokenizer, haystack, [], seed=0)


def test_context_lengths_are_evenly_spaced():
    lengths = context_lengths()
    assert len(lengths) == 50 and lengths[0] == 1000 and lengths[-1] == 32000
    assert all(isinstance(n, int) for n in lengths)
    assert set(np.diff(lengths).tolist()) <= {632, 633}
    assert context_lengths(2000, 2000, 1) == [2000]
    with pytest.raises(DataError):
        context_lengths(5000, 1000)


def test_errors(tokenizer, haystack):
    rng = np.random.default_rng(0)
    with pytest.raises(DataError, match="cannot hold 10 passkeys of 32 words"):
        make_sample(tokenizer, haystack, 1000, rng)
    with pytest.raises(DataError, match="haystack has 100 tokens"):
        make_sample(tokenizer, haystack[:100], 8000, rng)
    for min_depth, max_depth in [(-0.1, 0.9), (0.1, 1.5), (0.8, 0.2), (float("nan"), 0.5)]:
        with pytest.raises(DataError, match="depth"):
            make_sample(tokenizer, haystack, 8000, rng, min_depth=min_depth, max_depth=max_depth)
    with pytest.raises(DataError, match="num_passkeys"):
        make_sample(tokenizer, haystack, 8000, rng, num_passkeys=21)
    with pytest.raises(DataError, match="passkey_words"):
        make_sample(tokenizer, haystack, 8000, rng, passkey_words=0)
    with pytest.raises(DataError, match="supervise"):
        make_sample(tokenizer, haystack, 8000, rng, supervise="labels")

"""Needle-in-a-haystack and passkey-retrieval prompts: lengths, needle depths, scoring, errors."""

import numpy as np
import pytest

from duo_jax.data import (
    DataError,
    grid,
    haystack_tokens,
    make_needle_prompt,
    make_passkey_prompt,
    score_contains,
    score_needle,
    score_passkey,
)
from duo_jax.data.niah import (
    NEEDLE,
    NEEDLE_SEPARATOR,
    NEEDLE_TEMPLATE,
    PASSKEY_SEPARATOR,
    PASSKEY_TEMPLATE,
    QUESTION,
    SENTENCE_SNAP,
)


@pytest.fixture(scope="session")
def haystack(tokenizer):
    return haystack_tokens(tokenizer, "paul_graham", 8000)


def _check_placement(tokenizer, prompt, template, separator, needle_text, context_len, depth, bos=0):
    """Exact length, the needle decoding at needle_start, and the needle at `depth` of the haystack part."""
    assert prompt.tokens.dtype == np.int32 and len(prompt.tokens) == prompt.context_len == context_len
    needle_len = len(tokenizer.encode(needle_text))
    assert tokenizer.decode(prompt.tokens[prompt.needle_start : prompt.needle_start + needle_len]) == needle_text

    prefix_text, suffix_text = template.split("{context}")
    prefix, suffix = bos + len(tokenizer.encode(prefix_text)), len(tokenizer.encode(suffix_text))
    sep = len(tokenizer.encode(separator))
    hay_len = context_len - prefix - 2 * sep - needle_len - suffix
    before = prompt.needle_start - sep - prefix  # haystack tokens before the needle
    assert abs(before - depth * hay_len) <= SENTENCE_SNAP + 0.5
    if depth in (0.0, 1.0):
        assert before == depth * hay_len
    # The same in characters: the decoded haystack before the needle is about `depth` of all of it.
    hay_before = prompt.tokens[prefix : prefix + before]
    hay_after = prompt.tokens[prompt.needle_start + needle_len + sep : context_len - suffix]
    assert len(hay_before) + len(hay_after) == hay_len
    chars_before = len(tokenizer.decode(hay_before))
    assert abs(chars_before / (chars_before + len(tokenizer.decode(hay_after))) - depth) < 0.06
    return before


@pytest.mark.parametrize("context_len", [500, 2000, 8000])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_prompt_length_and_depth(tokenizer, haystack, context_len, depth):
    prompt = make_needle_prompt(tokenizer, haystack, context_len, depth)
    assert prompt.answer == NEEDLE and prompt.depth == depth
    template = NEEDLE_TEMPLATE.replace("{question}", QUESTION)
    before = _check_placement(tokenizer, prompt, template, NEEDLE_SEPARATOR, NEEDLE, context_len, depth)
    text = tokenizer.decode(prompt.tokens)
    assert text.startswith("This is a very long story book: <book> ")
    assert text.endswith(f" </book>.\n\nQuestion: {QUESTION}\n\nAnswer: The best thing to do in San Francisco is")
    assert f"\n\n{NEEDLE}\n\n" in text
    if depth == 0.5:  # snapped to the end of a sentence
        prefix = len(tokenizer.encode(template.split("{context}")[0]))
        assert tokenizer.decode(prompt.tokens[prefix + before - 1 : prefix + before]).rstrip(" ")[-1] in ".!?\n"


def test_needle_prompt_options(tokenizer, haystack):
    prompt = make_needle_prompt(
        tokenizer,
        haystack,
        1000,
        0.3,
        needle="The magic number is 42.",
        question="What is the magic number?",
        template="{context}\nQ: {question}\nA:",
        bos_id=2000,
    )  # outside the 2000-token vocabulary
    assert prompt.tokens[0] == 2000 and (prompt.tokens == 2000).sum() == 1 and len(prompt.tokens) == 1000
    _check_placement(
        tokenizer,
        prompt,
        "{context}\nQ: What is the magic number?\nA:",
        NEEDLE_SEPARATOR,
        "The magic number is 42.",
        1000,
        0.3,
        bos=1,
    )
    assert tokenizer.decode(prompt.tokens[1:]).endswith("\nQ: What is the magic number?\nA:")


@pytest.mark.parametrize("context_len", [500, 2000, 8000])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt_length_and_depth(tokenizer, context_len, depth):
    prompt = make_passkey_prompt(tokenizer, context_len, depth, np.random.default_rng(context_len))
    assert len(prompt.answer) == 5 and prompt.answer.isdigit()
    needle = f"The pass key is {prompt.answer}. Remember it. {prompt.answer} is the pass key."
    _check_placement(tokenizer, prompt, PASSKEY_TEMPLATE, PASSKEY_SEPARATOR, needle, context_len, depth)
    text = tokenizer.decode(prompt.tokens)
    assert text.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again." in text
    assert text.endswith("\nWhat is the pass key? The pass key is")


def test_passkey_prompt_is_deterministic_per_rng(tokenizer):
    a = make_passkey_prompt(tokenizer, 1000, 0.4, np.random.default_rng(11))
    b = make_passkey_prompt(tokenizer, 1000, 0.4, np.random.default_rng(11))
    c = make_passkey_prompt(tokenizer, 1000, 0.4, np.random.default_rng(12))
    assert np.array_equal(a.tokens, b.tokens) and a.answer == b.answer != c.answer
    assert len(make_passkey_prompt(tokenizer, 1000, 0.4, np.random.default_rng(0), digits=8).answer) == 8
    assert a.question == "What is the pass key?"


def test_grid():
    assert list(grid([1000, 2000], [0.0, 0.5, 1.0])) == [
        (1000, 0.0),
        (1000, 0.5),
        (1000, 1.0),
        (2000, 0.0),
        (2000, 0.5),
        (2000, 1.0),
    ]
    with pytest.raises(DataError, match="depth"):
        grid([1000], [0.5, 1.2])


def test_errors(tokenizer, haystack):
    rng = np.random.default_rng(0)
    for depth in (-0.1, 1.1, float("nan")):
        with pytest.raises(DataError, match=r"depth must be a fraction in \[0, 1\]"):
            make_needle_prompt(tokenizer, haystack, 2000, depth)
        with pytest.raises(DataError, match=r"depth must be a fraction in \[0, 1\]"):
            make_passkey_prompt(tokenizer, 2000, depth, rng)
    with pytest.raises(DataError, match="too small: the prompt without its haystack already takes"):
        make_needle_prompt(tokenizer, haystack, 40, 0.5)
    with pytest.raises(DataError, match="too small"):
        make_passkey_prompt(tokenizer, 40, 0.5, rng)
    with pytest.raises(DataError, match="haystack has 300 tokens"):
        make_needle_prompt(tokenizer, haystack[:300], 2000, 0.5)
    with pytest.raises(DataError, match="exactly once"):
        make_needle_prompt(tokenizer, haystack, 2000, 0.5, template="Question: {question}")
    with pytest.raises(DataError, match="digits"):
        make_passkey_prompt(tokenizer, 2000, 0.5, rng, digits=0)


def test_score_needle():
    continuation = "eat a sandwich and sit in Dolores Park on a sunny day."
    assert score_needle(NEEDLE, NEEDLE) == 1.0
    assert score_needle(continuation, NEEDLE) == pytest.approx(7 / 11)  # without the question: 11 key words
    assert score_needle(continuation, NEEDLE, question=QUESTION) == 1.0
    assert score_needle("  EAT a SANDWICH!!! sit... dolores-park; sunny/day ", NEEDLE, question=QUESTION) == 1.0
    assert score_needle("Dolores Park.", NEEDLE, question=QUESTION) == pytest.approx(2 / 7)
    assert score_needle("The best thing to do in San Francisco is unknown.", NEEDLE, question=QUESTION) == 0.0
    with pytest.raises(DataError, match="no key words"):
        score_needle("anything", "Is it the one?", question="Which one?")


def test_score_contains_for_needles(tokenizer, haystack):
    prompt = make_needle_prompt(tokenizer, haystack, 1000, 0.5)
    assert prompt.question == QUESTION

    def correct(generated):
        return score_contains(generated, prompt.answer, question=prompt.question)

    assert correct(" eat a sandwich and sit in Dolores Park on a sunny day.")
    assert correct("You should sit in Dolores Park and eat a sandwich")  # 5/7, paraphrased
    assert not correct("The best thing to do in San Francisco is a mystery.")  # echoes the question: 0/7
    assert not correct("visit the Golden Gate Bridge on a sunny day")  # near miss: 2/7
    assert not correct("to sit in Golden Gate Park")  # near miss: 2/7
    assert not correct("")
    assert correct(" eat a sandwich and sit in Dolores Park")  # 5/7
    assert not score_contains(" eat a sandwich and sit in Dolores Park", NEEDLE)  # no question given: 5/11


def test_score_passkeys_match_whole_numbers():
    assert score_passkey("The pass key is 52586.", "52586")
    assert score_passkey("52586", "52586") and score_passkey("key:52586!", "52586")
    assert score_passkey("2345 6", "2345")
    assert not score_passkey("123456", "2345")  # another number that merely contains the digits
    assert not score_passkey("The pass key is 52587.", "52586")
    assert not score_passkey("52,586", "52586")
    assert score_contains("It is 71432. Remember it.", "71432")
    assert not score_contains("It is 714321.", "71432")

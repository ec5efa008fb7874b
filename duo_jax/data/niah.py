"""Evaluation prompts: needle in a haystack (NIAH) and numeric passkey retrieval, and their scoring.

`make_needle_prompt` (the San Francisco needle, with a template that primes the answer as DuoAttention's
evaluation does) and `make_passkey_prompt` (a random number in the passkey literature's filler) build token-id
prompts of exactly `context_len` tokens with the needle at a given depth, snapped to a nearby sentence end
(``|c - depth * H| <= SENTENCE_SNAP + 0.5`` for H haystack tokens). `score_needle`, `score_passkey` and
`score_contains` score a generation. The prompt layout and the rules: docs/evaluation.md.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from duo_jax.data.haystack import DataError, encode

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
# A template holds `{context}` once and may hold `{question}`. This one primes the answer as DuoAttention's
# NIAH evaluation does, so it goes with this needle.
NEEDLE_TEMPLATE = (
    "This is a very long story book: <book> {context} </book>.\n\n"
    "Question: {question}\n\nAnswer: The best thing to do in San Francisco is"
)
NEEDLE_SEPARATOR = "\n\n"

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {passkey}. Remember it. {passkey} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_TEMPLATE = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there.\n{context}\n"
    f"{PASSKEY_QUESTION} The pass key is"
)
PASSKEY_SEPARATOR = "\n"

MAX_PASSKEY_DIGITS = 18  # 10**18 - 1 is the largest such number below int64's bound
SENTENCE_SNAP = 16  # how many tokens the needle may move to sit at a sentence end
NEEDLE_PASS_FRACTION = 0.5  # score_contains: share of the needle's key words a correct answer has

STOP_WORDS = frozenset(
    "a an and are as at be by for from has have he her his i in is it its of on or she that the their them "
    "they this to was were will with you your do does did what which who".split()
)


@dataclass
class NeedlePrompt:
    """An evaluation prompt.

    tokens: int32 [context_len] prompt ids.
    needle_start: index in `tokens` of the needle's first token (after its separator).
    answer: what a correct generation contains: the needle sentence (NIAH) or the passkey digits.
    question: the question the prompt asks (its words are not needed in the answer; see score_needle).
    context_len: the requested total length, equal to len(tokens).
    depth: the requested depth in [0, 1].
    """

    tokens: np.ndarray
    needle_start: int
    answer: str
    question: str
    context_len: int
    depth: float


def make_needle_prompt(
    tokenizer: Any,
    haystack_ids: Sequence[int],
    context_len: int,
    depth: float,
    *,
    needle: str = NEEDLE,
    question: str = QUESTION,
    template: str = NEEDLE_TEMPLATE,
    bos_id: int | None = None,
) -> NeedlePrompt:
    """A NIAH prompt of exactly `context_len` tokens with `needle` at `depth` of the haystack part.

    `template` must contain ``{context}`` once and may contain ``{question}``. Raises DataError for a depth
    outside [0, 1], a context too short for the prompt without haystack, or a haystack that is too short.
    """
    return _build_prompt(
        tokenizer,
        haystack_ids,
        context_len,
        depth,
        needle=needle,
        answer=needle,
        question=question,
        template=template.replace("{question}", question),
        separator=NEEDLE_SEPARATOR,
        bos_id=bos_id,
    )


def make_passkey_prompt(
    tokenizer: Any,
    context_len: int,
    depth: float,
    rng: np.random.Generator,
    *,
    digits: int = 5,
    bos_id: int | None = None,
) -> NeedlePrompt:
    """A passkey-retrieval prompt of exactly `context_len` tokens; the passkey is a random `digits`-digit
    number drawn from `rng` and is the prompt's `answer`."""
    if not 1 <= digits <= MAX_PASSKEY_DIGITS:
        raise DataError(f"digits must lie in [1, {MAX_PASSKEY_DIGITS}] (a passkey is one int64 draw), got {digits}")
    passkey = str(rng.integers(10 ** (digits - 1), 10**digits))
    return _build_prompt(
        tokenizer,
        _filler_ids(tokenizer, context_len),
        context_len,
        depth,
        needle=PASSKEY_NEEDLE.format(passkey=passkey),
        answer=passkey,
        question=PASSKEY_QUESTION,
        template=PASSKEY_TEMPLATE,
        separator=PASSKEY_SEPARATOR,
        bos_id=bos_id,
    )


def grid(lengths: Iterable[int], depths: Iterable[float]) -> Iterator[tuple[int, float]]:
    """Every (length, depth) pair, lengths outermost, as NIAH heat maps are swept."""
    depths = list(depths)
    for depth in depths:
        _check_depth(depth)
    return itertools.product(lengths, depths)


def score_needle(generated: str, needle: str, *, question: str = "") -> float:
    """The fraction of the needle's key words found in `generated`.

    Words are lowercased runs of letters and digits (so case, whitespace and punctuation do not matter).
    Key words are the needle's words that are neither in STOP_WORDS nor in `question` (the question gives
    those away, and a primed answer does not repeat them), each counted once. For the San Francisco needle
    and question they are: eat, sandwich, sit, dolores, park, sunny, day.
    """
    given = set(_words(question))
    key_words = [w for w in dict.fromkeys(_words(needle)) if w not in STOP_WORDS and w not in given]
    if not key_words:
        raise DataError(f"the needle {needle!r} has no key words to score: all are stop words or in the question")
    found = set(_words(generated))
    return sum(w in found for w in key_words) / len(key_words)


def score_passkey(generated: str, passkey: str) -> bool:
    """Whether `generated` contains the passkey as a whole number: some maximal run of digits in it equals
    `passkey`. "1234567" does not contain passkey "23456" (the model answered another number)."""
    return passkey in re.findall(r"\d+", generated)


def score_contains(generated: str, answer: str, *, question: str = "") -> bool:
    """Whether `generated` answers correctly: `score_passkey` for an all-digit answer, otherwise
    ``score_needle(generated, answer, question=question) >= NEEDLE_PASS_FRACTION``.

    For a prompt: ``score_contains(generated, prompt.answer, question=prompt.question)``.
    """
    if answer.isdigit():
        return score_passkey(generated, answer)
    return score_needle(generated, answer, question=question) >= NEEDLE_PASS_FRACTION


def _build_prompt(
    tokenizer: Any,
    haystack_ids: Sequence[int],
    context_len: int,
    depth: float,
    *,
    needle: str,
    answer: str,
    question: str,
    template: str,
    separator: str,
    bos_id: int | None,
) -> NeedlePrompt:
    _check_depth(depth)
    if template.count("{context}") != 1:
        raise DataError(f"the template must contain '{{context}}' exactly once: {template!r}")
    prefix_text, suffix_text = template.split("{context}")
    bos = np.asarray([] if bos_id is None else [bos_id], dtype=np.int32)
    prefix = np.concatenate([bos, encode(tokenizer, prefix_text)])
    sep, needle_ids, suffix = encode(tokenizer, separator), encode(tokenizer, needle), encode(tokenizer, suffix_text)

    fixed = len(prefix) + 2 * len(sep) + len(needle_ids) + len(suffix)
    hay_len = context_len - fixed
    if hay_len < 1:
        raise DataError(
            f"context_len={context_len} tokens is too small: the prompt without its haystack "
            f"already takes {fixed} tokens"
        )
    if len(haystack_ids) < hay_len:
        raise DataError(
            f"the haystack has {len(haystack_ids)} tokens but this prompt needs {hay_len}: "
            f"pass haystack_tokens(tokenizer, source, {context_len})"
        )
    hay = np.asarray(haystack_ids[:hay_len], dtype=np.int32)

    cut = _sentence_end_near(tokenizer, hay, round(depth * hay_len))
    tokens = np.concatenate([prefix, hay[:cut], sep, needle_ids, sep, hay[cut:], suffix]).astype(np.int32)
    return NeedlePrompt(
        tokens=tokens,
        needle_start=len(prefix) + cut + len(sep),
        answer=answer,
        question=question,
        context_len=context_len,
        depth=float(depth),
    )


def _sentence_end_near(tokenizer: Any, hay: np.ndarray, target: int) -> int:
    """The cut (number of haystack tokens before the needle) nearest to `target` that follows a sentence end,
    within SENTENCE_SNAP tokens; `target` itself when none does or when it is the start or end."""
    if target in (0, len(hay)):
        return target
    candidates = range(max(1, target - SENTENCE_SNAP), min(len(hay), target + SENTENCE_SNAP) + 1)
    ends = [c for c in candidates if tokenizer.decode([int(hay[c - 1])]).rstrip(" ").endswith((".", "!", "?", "\n"))]
    return min(ends, key=lambda c: (abs(c - target), c)) if ends else target


def _filler_ids(tokenizer: Any, n_tokens: int) -> np.ndarray:
    """At least `n_tokens` tokens of PASSKEY_FILLER repeated (the repeat count doubles until it suffices)."""
    repeats = 1
    while len(ids := _encoded_filler(tokenizer, repeats)) < n_tokens:
        repeats *= 2
    return ids


@functools.lru_cache(maxsize=32)
def _encoded_filler(tokenizer: Any, repeats: int) -> np.ndarray:
    ids = encode(tokenizer, " ".join([PASSKEY_FILLER] * repeats))
    ids.setflags(write=False)  # cached and shared
    return ids


def _check_depth(depth: float) -> None:
    if not 0.0 <= depth <= 1.0:  # also rejects NaN
        raise DataError(f"depth must be a fraction in [0, 1], got {depth}")


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())

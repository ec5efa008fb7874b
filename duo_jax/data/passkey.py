"""DuoAttention's training data: multi-passkey retrieval samples in a long haystack.

`make_sample` builds one sample of exactly `context_len` token ids: n needles, each a passkey of `passkey_words`
NATO-alphabet words, inserted at sorted random depths in [min_depth, max_depth] of a haystack wrapped as "the
book" (`BOOK_PREFIX` / `BOOK_SUFFIX`), then one question and answer per passkey (`QUESTION_TEMPLATE`). Its
`supervise` mask marks the positions whose hidden states the distillation loss compares: `"qa"` (default) every
token after the context, `"answers"` the answer tokens only. `SampleStream` makes sample i a function of (seed, i)
only. The exact format: docs/training.md, "The training samples".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from duo_jax.data.haystack import DataError, encode

NATO_ALPHABET = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliett",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
)
ORDINALS = (
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "eleventh",
    "twelfth",
    "thirteenth",
    "fourteenth",
    "fifteenth",
    "sixteenth",
    "seventeenth",
    "eighteenth",
    "nineteenth",
    "twentieth",
)
NEEDLE_TEMPLATE = "\n\nRemember this sequence of words, it's the {ordinal} passkey to the vault: {passkey}\n\n"
QUESTION_TEMPLATE = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey:"
ANSWER_SEPARATOR = "\n\n"
BOOK_PREFIX = "This is a very long story book: <book> "
BOOK_SUFFIX = " </book>.\n\n"
SUPERVISE_MODES = ("answers", "qa")


@dataclass
class Sample:
    """One training sample.

    tokens: int32 [T] token ids, T == context_len.
    supervise: bool [T], True at the positions whose hidden states the distillation loss compares (see
        the module docstring and docs/training.md, "The training samples").
    context_len: the requested total length, equal to T.
    passkeys: the passkeys in insertion (and question) order.
    depths: their sorted depths, each the fraction of the sample's haystack tokens that precede it.
    """

    tokens: np.ndarray
    supervise: np.ndarray
    context_len: int
    passkeys: list[str]
    depths: list[float]


def make_sample(
    tokenizer: Any,
    haystack_ids: Sequence[int],
    context_len: int,
    rng: np.random.Generator,
    *,
    num_passkeys: int = 10,
    passkey_words: int = 32,
    min_depth: float = 0.05,
    max_depth: float = 0.95,
    bos_id: int | None = None,
    supervise: str = "qa",
) -> Sample:
    """A multi-passkey sample of exactly `context_len` tokens built from the start of `haystack_ids`.

    Draws the passkeys, then the depths, from `rng`. Raises DataError when `context_len` cannot hold the
    passkeys and questions plus at least one haystack token, or when `haystack_ids` is too short.
    """
    check_sample_options(num_passkeys, passkey_words, min_depth, max_depth, supervise)
    passkeys = [
        " ".join(NATO_ALPHABET[i] for i in rng.integers(len(NATO_ALPHABET), size=passkey_words))
        for _ in range(num_passkeys)
    ]
    depths = np.sort(rng.uniform(min_depth, max_depth, size=num_passkeys))

    parts = _Parts(tokenizer, passkeys, bos_id, supervise)
    hay_len = context_len - parts.num_tokens
    if hay_len < 1:
        raise DataError(
            f"context_len={context_len} tokens cannot hold {num_passkeys} passkeys of "
            f"{passkey_words} words: their needles and questions alone take {parts.num_tokens} "
            "tokens; use a longer context or fewer / shorter passkeys"
        )
    if len(haystack_ids) < hay_len:
        raise DataError(
            f"the haystack has {len(haystack_ids)} tokens but this sample needs {hay_len}: "
            f"pass haystack_tokens(tokenizer, source, {context_len})"
        )
    hay = np.asarray(haystack_ids[:hay_len], dtype=np.int32)

    cuts = np.round(depths * hay_len).astype(int)
    context = [parts.head]
    for start, end, needle in zip(np.concatenate([[0], cuts]), cuts, parts.needles):
        context += [hay[start:end], needle]
    context += [hay[cuts[-1] :], parts.tail]
    context_ids = np.concatenate(context)

    tokens = np.concatenate([context_ids, parts.qa_ids]).astype(np.int32)
    mask = np.concatenate([np.zeros(len(context_ids), dtype=bool), parts.qa_mask])
    return Sample(tokens=tokens, supervise=mask, context_len=context_len, passkeys=passkeys, depths=depths.tolist())


def min_context_len(
    tokenizer: Any, *, num_passkeys: int = 10, passkey_words: int = 32, bos_id: int | None = None
) -> int:
    """A context_len that holds any sample: the worst-case passkeys (the NATO word with the most tokens,
    repeated) plus one haystack token. Exact when the tokenizer does not merge tokens across spaces."""
    check_sample_options(num_passkeys, passkey_words, 0.0, 1.0, "answers")
    longest = max(
        (" ".join([word] * passkey_words) for word in NATO_ALPHABET),
        key=lambda passkey: len(encode(tokenizer, passkey)),
    )
    return _Parts(tokenizer, [longest] * num_passkeys, bos_id, "answers").num_tokens + 1


def context_lengths(min_len: int = 1000, max_len: int = 32000, num: int = 50) -> list[int]:
    """`num` evenly spaced context lengths from `min_len` to `max_len` (both included), rounded to ints."""
    if not 1 <= min_len <= max_len or num < 1:
        raise DataError(
            f"need 1 <= min_len <= max_len and num >= 1, got min_len={min_len}, max_len={max_len}, num={num}"
        )
    return np.round(np.linspace(min_len, max_len, num)).astype(int).tolist()


class SampleStream:
    """Deterministic, resumable training samples: ``stream[i]`` is the sample for step ``i``.

    Sample i depends only on (seed, i): it uses ``np.random.default_rng([seed, i])``, which first picks the
    length ``lengths[rng.integers(len(lengths))]`` (uniform over the list, as the original's shuffled data
    loader does) and then draws the sample with `make_sample`. Training can thus resume at any step.
    The constructor checks up front that the shortest length holds the worst-case sample
    (`min_context_len`) and that the haystack covers the longest.
    """

    def __init__(
        self,
        tokenizer: Any,
        haystack_ids: Sequence[int],
        lengths: Sequence[int],
        seed: int,
        *,
        num_passkeys: int = 10,
        passkey_words: int = 32,
        min_depth: float = 0.05,
        max_depth: float = 0.95,
        bos_id: int | None = None,
        supervise: str = "qa",
    ):
        self.lengths = [int(n) for n in lengths]
        if not self.lengths:
            raise DataError("SampleStream needs at least one context length")
        check_sample_options(num_passkeys, passkey_words, min_depth, max_depth, supervise)
        shortest = min_context_len(tokenizer, num_passkeys=num_passkeys, passkey_words=passkey_words, bos_id=bos_id)
        if min(self.lengths) < shortest:
            raise DataError(
                f"context length {min(self.lengths)} is too short for {num_passkeys} passkeys of "
                f"{passkey_words} words with this tokenizer: use lengths >= {shortest}"
            )
        if len(haystack_ids) < max(self.lengths):
            raise DataError(
                f"the haystack has {len(haystack_ids)} tokens, fewer than the longest context "
                f"({max(self.lengths)}): pass haystack_tokens(tokenizer, source, {max(self.lengths)})"
            )
        self.tokenizer = tokenizer
        self.haystack_ids = haystack_ids
        self.seed = seed
        self.options = dict(
            num_passkeys=num_passkeys,
            passkey_words=passkey_words,
            min_depth=min_depth,
            max_depth=max_depth,
            bos_id=bos_id,
            supervise=supervise,
        )

    def __getitem__(self, step: int) -> Sample:
        if step < 0:
            raise DataError(f"steps are numbered from 0, got {step}")
        rng = np.random.default_rng([self.seed, step])
        length = self.lengths[rng.integers(len(self.lengths))]
        return make_sample(self.tokenizer, self.haystack_ids, length, rng, **self.options)


class _Parts:
    """The token pieces of a sample other than its haystack, for given passkeys."""

    def __init__(self, tokenizer: Any, passkeys: list[str], bos_id: int | None, supervise: str):
        ordinals = ORDINALS[: len(passkeys)]
        self.head = np.concatenate(
            [np.asarray([] if bos_id is None else [bos_id], dtype=np.int32), encode(tokenizer, BOOK_PREFIX)]
        )
        self.needles = [
            encode(tokenizer, NEEDLE_TEMPLATE.format(ordinal=o, passkey=p)) for o, p in zip(ordinals, passkeys)
        ]
        self.tail = encode(tokenizer, BOOK_SUFFIX)
        separator = encode(tokenizer, ANSWER_SEPARATOR)
        qa_ids, qa_mask = [], []
        for ordinal, passkey in zip(ordinals, passkeys):
            question = QUESTION_TEMPLATE.format(ordinal=ordinal)
            line = encode(tokenizer, f"{question} {passkey}")
            answer_start = _common_prefix_len(encode(tokenizer, question), line)
            is_answer = np.arange(len(line)) >= answer_start
            qa_ids += [line, separator]
            qa_mask += [is_answer, np.zeros(len(separator), dtype=bool)]
        self.qa_ids = np.concatenate(qa_ids)
        self.qa_mask = np.concatenate(qa_mask) if supervise == "answers" else np.ones(len(self.qa_ids), bool)
        self.num_tokens = len(self.head) + sum(map(len, self.needles)) + len(self.tail) + len(self.qa_ids)


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def check_sample_options(
    num_passkeys: int, passkey_words: int, min_depth: float, max_depth: float, supervise: str
) -> None:
    """DataError unless the sample options are valid (checked again wherever samples are made)."""
    if not 1 <= num_passkeys <= len(ORDINALS):
        raise DataError(f"num_passkeys must be between 1 and {len(ORDINALS)}, got {num_passkeys}")
    if passkey_words < 1:
        raise DataError(f"passkey_words must be >= 1, got {passkey_words}")
    if not 0.0 <= min_depth <= max_depth <= 1.0:
        raise DataError(
            f"depths must satisfy 0 <= min_depth <= max_depth <= 1, got min_depth={min_depth}, max_depth={max_depth}"
        )
    if supervise not in SUPERVISE_MODES:
        raise DataError(f"supervise must be one of {SUPERVISE_MODES}, got {supervise!r}")

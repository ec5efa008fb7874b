"""DuoAttention's needle in a haystack (its paper's Figure 6), built and scored as its script does.

The source is mit-han-lab/duo-attention, `eval/needle/needle_in_haystack.py` (adapted there from gkamradt's
LLMTest_NeedleInAHaystack), run by `scripts/niah.sh`, scored by `eval/needle/visualize.py`. Text, not token ids,
passes between its steps: the haystack is cut to the length by decoding its first tokens, the needle inserted among
the cut text's tokens and the result decoded again, and the whole prompt encoded once more. `context_ids` and
`make_prompt` do the same with the model's tokenizer; `score` is visualize.py's. How it differs from this
repository's own NIAH (`duo_jax.data.niah`), and what is not reproduced: docs/evaluation.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from duo_jax.data.haystack import DataError, decode, encode
from duo_jax.data.niah import NeedlePrompt

NEEDLE = (
    "\n\nRemember, the best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n\n"
)
QUESTION = "what is the best thing to do in San Francisco?\n\nAnswer: The best thing to do in San Francisco is"
PROMPT = (
    "<|im_start|> This is a very long story book: <book> {context} </book>.\n\n"
    "Question: Based on the content of the book, {question}"
)
BUFFER = 200  # final_context_length_buffer: tokens of the length left to the question and the answer
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day."  # visualize.py's expected answer
MAX_NEW_TOKENS = 51  # the first token, then `for _ in range(50)`


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return encode(tokenizer, text, special=special).tolist()


def repeated(tokenizer: Any, haystack: str, longest: int) -> str:
    """`read_context_files`: the haystack text repeated until it has `longest` tokens (the grid's longest length)."""
    if not haystack:
        raise DataError("the haystack is empty")
    text = haystack
    while len(_encode(tokenizer, text, True)) < longest:
        text += haystack
    return text


def context_ids(tokenizer: Any, text: str, length: int) -> list[int]:
    """The haystack's tokens (no special tokens) for prompts of `length` from `repeated`'s text: `encode_and_trim`
    keeps the text of its first `length` tokens (special ones counted), and `insert_needle` encodes that text
    again and keeps `length` - BUFFER - the needle's tokens of it."""
    tokens = _encode(tokenizer, text, True)
    if len(tokens) > length:
        text = decode(tokenizer, tokens[:length])
    ids = _encode(tokenizer, text, False)
    room = length - BUFFER - len(_encode(tokenizer, NEEDLE, False))
    if room < 1:
        raise DataError(f"a length of {length} tokens leaves no room for the haystack after the needle and {BUFFER}")
    return ids[:room] if len(ids) > room else ids


def make_prompt(tokenizer: Any, context: list[int], length: int, depth: float) -> NeedlePrompt:
    """The prompt of `length` at `depth` in [0, 1] (the script's percent / 100) from `context_ids`: the needle's tokens
    at int(len(context) x depth) (at the end for depth 1), the text decoded, put in PROMPT and encoded with the
    tokenizer's special tokens. Shorter than `length`: BUFFER tokens less the question's are left."""
    if not 0 <= depth <= 1:
        raise DataError(f"depth must lie in [0, 1], got {depth}")
    needle = _encode(tokenizer, NEEDLE, False)
    point = len(context) if depth == 1 else int(len(context) * depth)
    text = decode(tokenizer, context[:point] + needle + context[point:])
    prefix = _encode(tokenizer, PROMPT.split("{context}")[0] + decode(tokenizer, context[:point]), True)
    tokens = np.asarray(_encode(tokenizer, PROMPT.format(context=text, question=QUESTION), True), np.int32)
    if len(tokens) > length:
        raise DataError(f"the prompt has {len(tokens)} tokens, more than the length {length}: a longer length")
    # needle_start: where the needle's text begins, as the prompt's prefix alone tokenizes (re-encoding may move it)
    return NeedlePrompt(tokens, min(len(prefix), len(tokens) - 1), ANSWER, QUESTION, length, float(depth))


def score(generated: str) -> float:
    """visualize.py's score: the share of the expected answer's 12 words (lowercased, split on whitespace, "day."
    with its period) that are words of the lowercased answer, counting a word that the expected answer holds twice
    ("a") once in the numerator, so that a perfect answer scores 11/12."""
    expected = ANSWER.lower().split()
    return len(set(generated.lower().split()) & set(expected)) / len(expected)

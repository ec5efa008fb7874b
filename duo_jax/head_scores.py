"""HeadKV's head importance scores: how much attention each head pays to a needle's answer while the model
produces that answer, averaged over needle-in-a-haystack prompts (`score_heads`).

Per prompt the answer is teacher-forced; at each answer step each query head adds attention / N for each of its N
most attended positions inside the answer span (`needle_attention_score`), so a prompt's score lies in [0, 1]; a
KV head scores the mean of its query heads, averaged over the prompts the model answers well enough
(`min_accuracy`), on the calibration haystack. Needles: `RETRIEVAL` (HeadKV-R) and `REASONING` (HeadKV-R2). Scores
are saved like a pattern (`Pattern.save`) and read back with `load_scores`. Design: docs/training.md, "HeadKV head
scores".

    python -m duo_jax.head_scores MODEL OUT_DIR [--needle reasoning|retrieval] [--lengths 1000 8000 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from duo_jax import attention
from duo_jax.attention import masked_softmax
from duo_jax.config import ModelConfig
from duo_jax.data import CALIBRATION_HAYSTACK, DataError, encode, haystack_tokens, make_needle_prompt
from duo_jax.data.niah import NEEDLE, NEEDLE_TEMPLATE, QUESTION
from duo_jax.errors import DuoJaxError, check_output_folder
from duo_jax.model import Params, apply_rotary, decoder_layer, embed, rope_inv_freq, rotary, scan_layers, unembed
from duo_jax.pattern import SCORES_KIND, Pattern
from duo_jax.sampling import check_number

DEFAULT_DEPTHS = tuple(np.linspace(0.0, 1.0, 10).round(4).tolist())


@dataclasses.dataclass(frozen=True)
class ScoringNeedle:
    """A needle, the question about it, and the part of it that answers the question."""

    name: str
    needle: str  # inserted into the haystack
    answer: str  # the correct answer: a substring of the needle, teacher-forced and scored
    question: str
    template: str  # a prompt with {context} and {question}, ending where the answer starts
    distractor: str | None = None  # a wrong answer inside the needle (R2), never scored

    def __post_init__(self):
        if self.answer not in self.needle:
            raise DataError(f"the answer {self.answer!r} is not part of the needle {self.needle!r}")
        if self.distractor is not None and (self.distractor not in self.needle or self.distractor in self.answer):
            raise DataError(f"the distractor {self.distractor!r} must be in the needle and not in the answer")


RETRIEVAL = ScoringNeedle(
    "retrieval", NEEDLE, "eat a sandwich and sit in Dolores Park on a sunny day.", QUESTION, NEEDLE_TEMPLATE
)
REASONING = ScoringNeedle(
    "reasoning",
    needle=(
        "Lena moved from Lisbon to Oslo last spring. In Lisbon she ate grilled sardines every Friday; "
        "in Oslo she eats smoked salmon on rye bread every Friday."
    ),
    answer="smoked salmon on rye bread",
    question="What does Lena eat every Friday now?",
    template=(
        "This is a very long story book: <book> {context} </book>.\n\n"
        "Question: {question}\n\nAnswer: Every Friday Lena now eats"
    ),
    distractor="grilled sardines",
)
NEEDLES = {n.name: n for n in (RETRIEVAL, REASONING)}


def answer_span(tokenizer: Any, needle: ScoringNeedle) -> tuple[int, int]:
    """[start, end) of the needle's tokens (tokenized on their own) that cover its answer's characters."""
    ids = encode(tokenizer, needle.needle)
    ends = [len(tokenizer.decode([int(t) for t in ids[:i]])) for i in range(len(ids) + 1)]  # chars after i tokens
    first = needle.needle.index(needle.answer)
    last = first + len(needle.answer)
    inside = [i for i in range(len(ids)) if ends[i + 1] > first and ends[i] < last]
    if not inside or needle.answer not in tokenizer.decode([int(t) for t in ids[inside[0] : inside[-1] + 1]]):
        raise DataError(f"cannot find the answer {needle.answer!r} among the needle's tokens")
    return inside[0], inside[-1] + 1


def needle_attention_score(probs: jax.Array, start, end) -> jax.Array:
    """HeadKV's score from the attention of N answer steps: probs [..., N, S] -> [...].

    At each step, the N most attended keys (ties: the earlier key) that lie in [start, end) add attention / N.
    """
    n = probs.shape[-2]
    top, keys = jax.lax.top_k(probs, n)  # [..., N, N]
    inside = (keys >= start) & (keys < end)
    return jnp.sum(jnp.where(inside, top, 0.0), axis=(-2, -1)) / n


@functools.partial(jax.jit, static_argnames=("config", "n", "impl"))
def prompt_scores(params: Params, tokens: jax.Array, start, end, *, config: ModelConfig, n: int, impl: str = "auto"):
    """One teacher-forced prompt: tokens int32 [1, T] (the prompt, then its n answer tokens), the answer's
    span [start, end) in the prompt -> (scores float32 [L, H] per query head, predicted int32 [n]: the model's
    own next token at each answer step).

    A dense causal forward over the layers (`duo_jax.model.scan_layers`, the attention through the dispatch;
    within each layer's sliding window on a model that has one) that also scores the attention
    probabilities of the n answer-step queries."""
    T = tokens.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    steps = T - 1 - n + jnp.arange(n)  # positions of the queries that predict the answer tokens
    keys = jnp.arange(T)[None, :]
    rope = rotary(positions, rope_inv_freq(config))

    def make_body(window):  # the layers of one sliding-window run (`scan_layers`)
        visible = keys <= steps[:, None]  # [n, T]
        if window is not None:
            visible = visible & (steps[:, None] - keys < window)

        def attend(q, k, v, h):  # causal attention, plus the needle score of the answer-step queries
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            K, E = k.shape[2], k.shape[3]
            answer_q = q[0, T - 1 - n : T - 1].reshape(n, K, -1, E)  # [n, K, G, E]
            scores = jnp.einsum("nkge,ske->kgns", answer_q, k[0], preferred_element_type=jnp.float32) / math.sqrt(E)
            needle = needle_attention_score(masked_softmax(scores, visible), start, end).reshape(-1)  # [H]
            return attention.flash_attention(q, k, v, causal=True, window=window, impl=impl), needle

        return lambda x, layer: decoder_layer(x, layer, config, attend)

    x, scores = scan_layers(make_body, embed(params, tokens), config, params.layers)
    logits = unembed(params, config, x[:, T - 1 - n : T - 1])  # [1, n, V]
    return scores, jnp.argmax(logits[0], axis=-1).astype(jnp.int32)


def check_options(lengths: Sequence[int] | None, min_accuracy: float) -> None:
    """The scoring's own options, before any model runs: lengths of at least one token, min_accuracy in [0, 1]."""
    check_number("min_accuracy", min_accuracy, minimum=0, maximum=1, hint=" (a share of the answer's tokens)")
    for length in lengths or ():
        check_number("lengths", length, integer=True, minimum=1, hint=" (context lengths in tokens)")


def default_lengths(config: ModelConfig, longest: int = 32000, count: int = 5) -> list[int]:
    """`count` context lengths evenly spaced from 1000 tokens (or less on a short model) to `longest`, capped
    so the prompt and a short answer fit the model's context."""
    top = min(longest, config.max_position_embeddings - 64)
    return sorted({int(x) for x in np.linspace(min(1000, top), top, count).round()})


def score_heads(
    params: Params,
    config: ModelConfig,
    tokenizer: Any,
    *,
    needle: ScoringNeedle = REASONING,
    haystack: str = CALIBRATION_HAYSTACK,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    min_accuracy: float = 0.5,
    bos_id: int | None = None,
    impl: str = "auto",
    progress: bool = True,
) -> Pattern:
    """Head scores [layers, kv_heads] averaged over the prompts of `lengths` x `depths` (see the module
    docstring), as a `Pattern` whose meta records the settings. Raises DataError when no prompt passes
    `min_accuracy`."""
    check_options(lengths, min_accuracy)
    lengths = default_lengths(config) if lengths is None else [int(x) for x in lengths]
    start, end = answer_span(tokenizer, needle)
    needle_ids = encode(tokenizer, needle.needle)
    answer = needle_ids[start:end]
    n = len(answer)
    if max(lengths) + n > config.max_position_embeddings:
        raise DataError(
            f"a {max(lengths)}-token prompt and its {n}-token answer exceed the model's context of "
            f"{config.max_position_embeddings} tokens"
        )
    hay = haystack_tokens(tokenizer, haystack, max(lengths))
    total, used = np.zeros((config.num_layers, config.num_heads)), 0
    cells = [(length, depth) for length in lengths for depth in depths]
    for length, depth in tqdm(cells, desc="scoring heads", unit="prompt", disable=not progress):
        prompt = make_needle_prompt(
            tokenizer,
            hay,
            length,
            depth,
            needle=needle.needle,
            question=needle.question,
            template=needle.template,
            bos_id=bos_id,
        )
        tokens = np.concatenate([prompt.tokens, answer])[None]
        scores, predicted = prompt_scores(
            params,
            jnp.asarray(tokens),
            prompt.needle_start + start,
            prompt.needle_start + end,
            config=config,
            n=n,
            impl=impl,
        )
        if np.mean(np.asarray(predicted) == answer) >= min_accuracy:
            total += np.asarray(scores, np.float64)
            used += 1
    if used == 0:
        raise DataError(
            f"no prompt reached min_accuracy={min_accuracy} (the share of answer tokens the model "
            "predicts under teacher forcing); lower it, or score a model that can answer"
        )
    per_kv_head = (total / used).reshape(config.num_layers, config.num_kv_heads, config.group_size).mean(-1)
    meta = dict(
        kind=SCORES_KIND,
        needle=needle.name,
        lengths=lengths,
        depths=[float(d) for d in depths],
        haystack=haystack,
        min_accuracy=min_accuracy,
        prompts=len(lengths) * len(depths),
        prompts_used=used,
    )
    return Pattern(per_kv_head, meta)


def load_scores(path: str | Path, config: ModelConfig | None = None) -> Pattern:
    """A saved score grid (a folder written by `Pattern.save`, or its TSV file), checked against `config`."""
    scores = Pattern.load(path, "HeadKV scores", SCORES_KIND)
    if config is not None:
        scores.validate(config)
    return scores


def main(argv: Sequence[str] | None = None) -> int:
    from duo_jax.loading import load

    parser = argparse.ArgumentParser(prog="python -m duo_jax.head_scores", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model name (configs/) or a Hugging Face folder / .gguf file")
    parser.add_argument("out", type=Path, help="folder to write full_attention_heads.tsv and config.json into")
    parser.add_argument(
        "--needle",
        choices=sorted(NEEDLES),
        default="reasoning",
        help="reasoning: HeadKV-R2 (default); retrieval: HeadKV-R",
    )
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths (default: 5 from 1000 to 32000)")
    parser.add_argument("--depths", type=int, default=len(DEFAULT_DEPTHS), help="needle depths from 0 to 1")
    parser.add_argument(
        "--haystack",
        default=CALIBRATION_HAYSTACK,
        help="text the needles hide in (default: the essays' calibration half, which evaluations do not use)",
    )
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.5,
        help="a prompt counts when the model predicts at least this share of the answer's tokens (teacher-forced)",
    )
    args = parser.parse_args(argv)
    try:
        check_output_folder(args.out, "OUT")  # before the scoring, which writes only at its end
        if args.depths < 1:
            raise DuoJaxError(f"--depths is a number of needle depths >= 1, got {args.depths}")
        check_options(args.lengths, args.min_accuracy)  # before the model loads and every prompt is scored
        model = load(args.model, layout="stacked")  # scanned: one compiled layer
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise DuoJaxError(f"{args.model} has no tokenizer; head scoring needs one")
        scores = score_heads(
            model.params,
            model.config,
            tokenizer,
            needle=NEEDLES[args.needle],
            haystack=args.haystack,
            lengths=args.lengths,
            depths=np.linspace(0.0, 1.0, args.depths).round(4).tolist(),
            min_accuracy=args.min_accuracy,
            bos_id=tokenizer.bos_id if tokenizer.add_bos else None,
        )
    except DuoJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{scores.meta['prompts_used']}/{scores.meta['prompts']} prompts scored; wrote {scores.save(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

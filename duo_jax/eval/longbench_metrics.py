"""LongBench (v1) metrics, as THUDM/LongBench defines them (``metrics.py`` and ``eval.py`` of the v1 code).

Every metric takes ``(prediction, ground_truth, all_classes)`` and returns a float in [0, 1]: `qa_f1`,
`qa_f1_zh`, `rouge_l`, `rouge_zh`, `classification`, `retrieval`, `retrieval_zh`, `count` and `code_sim`
(``fuzzy="difflib"``, the default, or ``"rapidfuzz"``). `sample_score` applies eval.py's first-line rule (and under
DuoAttention's fork of LongBench its cuts, `duoattention_cuts`) and takes the best score over the answers;
`task_score` is LongBench's 100 x mean rounded to 2 decimals and `length_bucket_scores` LongBench-E's split by
length. Each metric's rule and the libraries: docs/longbench.md.
"""

from __future__ import annotations

import functools
import operator
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from duo_jax.errors import DuoJaxError

_CHINESE_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟"
    "〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ASCII_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _CHINESE_PUNCTUATION)
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")  # eval.py keeps only the first line of these


def normalize_answer(text: str) -> str:
    """Lowercase, drop ASCII punctuation, drop the articles a / an / the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ASCII_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Lowercase, drop ASCII and Chinese punctuation, drop all whitespace."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION).split())


def f1_tokens(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when nothing is shared)."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def _jieba_words(text: str) -> list[str]:
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)  # no "Building prefix dict" chatter on stderr
    return list(jieba.cut(text, cut_all=False))


def qa_f1(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Token F1 after SQuAD-style normalisation (`normalize_answer`)."""
    return f1_tokens(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh(prediction: str, ground_truth: str, all_classes=None) -> float:
    """F1 over jieba words, each normalised by `normalize_zh_answer`, empty words dropped."""

    def words(text):
        return [w for w in (normalize_zh_answer(t) for t in _jieba_words(text)) if w]

    return f1_tokens(words(prediction), words(ground_truth))


def rouge_l(prediction: str, ground_truth: str, all_classes=None) -> float:
    """ROUGE-L F of the `rouge` package (LongBench's); 0 for whatever the package rejects."""
    from rouge import Rouge

    try:
        return float(Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"])
    except Exception:  # noqa: BLE001  (LongBench catches everything: empty hypothesis or reference, ...)
        return 0.0


def rouge_zh(prediction: str, ground_truth: str, all_classes=None) -> float:
    """`rouge_l` over jieba words joined with spaces."""
    return rouge_l(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(ground_truth)))


def classification(prediction: str, ground_truth: str, all_classes=None) -> float:
    """1/n when the ground truth is among the n classes the prediction names, minus those that are a proper
    substring of the ground truth (removed as LongBench removes them); else 0."""
    if all_classes is None:
        raise DuoJaxError("classification scoring needs the sample's all_classes (LongBench's field)")
    named = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(named):  # the reference removes while iterating: each removal skips the next candidate
        if named[i] in ground_truth and named[i] != ground_truth:
            del named[i]
        i += 1
    return 1.0 / len(named) if ground_truth in named else 0.0


def _share_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(target) for n in numbers) / len(numbers) if numbers else 0.0


def count(prediction: str, ground_truth: str, all_classes=None) -> float:
    """The share of the numbers in the prediction that equal the ground truth (0 when there is none)."""
    return _share_equal(prediction, ground_truth)


def _retrieval(pattern: str, prediction: str, ground_truth: str) -> float:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise DuoJaxError(f"a retrieval answer must name its paragraph ({pattern!r}), got {ground_truth!r}")
    return _share_equal(prediction, found[0])


def retrieval(prediction: str, ground_truth: str, all_classes=None) -> float:
    """`count` against the paragraph number of the ground truth's ``Paragraph N``."""
    return _retrieval(r"Paragraph (\d+)", prediction, ground_truth)


def retrieval_zh(prediction: str, ground_truth: str, all_classes=None) -> float:
    """`count` against the paragraph number of the ground truth's ``段落N``."""
    return _retrieval(r"段落(\d+)", prediction, ground_truth)


FUZZY = ("difflib", "rapidfuzz")


def fuzz_ratio(a: str, b: str, fuzzy: str = "difflib") -> int:
    """fuzzywuzzy's fuzz.ratio: the similarity of `a` and `b` in whole percent; as its checks run, 100 for equal
    strings (two empty ones too), then 0 when either is empty; fuzzy="difflib": SequenceMatcher's ratio
    (fuzzywuzzy without python-Levenshtein, as LongBench installs it), "rapidfuzz": the Indel ratio (fuzzywuzzy
    with python-Levenshtein)."""
    if fuzzy not in FUZZY:
        raise DuoJaxError(f"unknown fuzzy matcher {fuzzy!r}: choose from {', '.join(FUZZY)}")
    if a == b:
        return 100
    if not a or not b:
        return 0
    if fuzzy == "difflib":
        from difflib import SequenceMatcher

        return int(round(100 * SequenceMatcher(None, a, b).ratio()))
    from rapidfuzz import fuzz

    return int(round(fuzz.ratio(a, b)))


def code_sim(prediction: str, ground_truth: str, all_classes=None, fuzzy: str = "difflib") -> float:
    """`fuzz_ratio` / 100 of the prediction's first line (after leading newlines) without a backtick, ``#`` or
    ``//``, against the ground truth."""
    line = next(
        (ln for ln in prediction.lstrip("\n").split("\n") if "`" not in ln and "#" not in ln and "//" not in ln), ""
    )
    return fuzz_ratio(line, ground_truth, fuzzy) / 100


METRICS: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1,
    "qasper": qa_f1,
    "multifieldqa_en": qa_f1,
    "multifieldqa_zh": qa_f1_zh,
    "hotpotqa": qa_f1,
    "2wikimqa": qa_f1,
    "musique": qa_f1,
    "dureader": rouge_zh,
    "gov_report": rouge_l,
    "qmsum": rouge_l,
    "multi_news": rouge_l,
    "vcsum": rouge_zh,
    "trec": classification,
    "triviaqa": qa_f1,
    "samsum": rouge_l,
    "lsht": classification,
    "passage_retrieval_en": retrieval,
    "passage_count": count,
    "passage_retrieval_zh": retrieval_zh,
    "lcc": code_sim,
    "repobench-p": code_sim,
}


# DuoAttention's fork of LongBench (mit-han-lab/duo-attention, eval/LongBench/eval.py `scorer`) cuts every prediction
# at these strings, in this order, and strips it, before the first-line rule; then the Chinese tasks' own cuts.
DUOATTENTION_CUTS = (".assistant", "\n\nQuestion", "</s>", "(Document", "\n\nQuestion", "\n\nAnswer", "(Passage")
DUOATTENTION_ZH_CUTS = {
    "multifieldqa_zh": ("问题：",),
    "dureader": ("问题：",),
    "lsht": ("新闻内容：",),
    "passage_retrieval_zh": ("请问", "提示"),
}


def _cut(text: str, at: Sequence[str]) -> str:
    for mark in at:
        text = text.split(mark)[0]
    return text.strip()


def sample_score(
    task: str, prediction: str, answers: Sequence[str], all_classes=None, fuzzy: str = "difflib", *, cuts: bool = False
) -> float:
    """A sample's score in [0, 1]: the first-line rule of FIRST_LINE_TASKS, then the best over `answers`;
    `fuzzy`: code_sim's matcher (`fuzz_ratio`); `cuts`: DuoAttention's fork, the prediction cut at
    DUOATTENTION_CUTS first and at the Chinese tasks' marks after the first-line rule, in its order."""
    if task not in METRICS:
        raise DuoJaxError(f"unknown LongBench task {task!r}: choose from {', '.join(METRICS)}")
    if cuts:
        prediction = _cut(prediction, DUOATTENTION_CUTS)
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    if cuts and task in DUOATTENTION_ZH_CUTS:
        prediction = _cut(prediction, DUOATTENTION_ZH_CUTS[task])
    best = 0.0
    for answer in answers:
        options = dict(fuzzy=fuzzy) if METRICS[task] is code_sim else {}
        best = max(best, METRICS[task](prediction, answer, all_classes=all_classes, **options))
    return best


def task_score(scores: Sequence[float]) -> float:
    """LongBench's task score (`eval.py`'s `scorer`): the sample scores summed in order, x 100 / their number,
    rounded to 2 decimals, in that order of operations, since another order rounds a tie the other way
    (NaN for no samples)."""
    if not len(scores):
        return float("nan")
    total = functools.reduce(operator.add, scores, 0.0)  # left to right, as Python's sum before 3.12
    return round(100 * total / len(scores), 2)


LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int) -> str:
    """LongBench-E's bucket of a sample's `length` field."""
    return LENGTH_BUCKETS[0] if length < 4000 else LENGTH_BUCKETS[1] if length < 8000 else LENGTH_BUCKETS[2]


def length_bucket_scores(scores: Sequence[float], lengths: Sequence[int]) -> dict[str, float]:
    """{bucket: task_score of its samples} (NaN for an empty bucket, where LongBench's mean is NaN too)."""
    groups: dict[str, list[float]] = {b: [] for b in LENGTH_BUCKETS}
    for score, length in zip(scores, lengths):
        groups[length_bucket(length)].append(score)
    # LongBench-E's `scorer_e` takes numpy's mean, not `scorer`'s sum
    return {b: round(100 * float(np.mean(v)), 2) if v else float("nan") for b, v in groups.items()}

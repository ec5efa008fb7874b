"""How far the maintained libraries duo-jax scores LongBench with are from the ones LongBench pinned.

- code similarity (lcc, repobench-p): LongBench calls fuzzywuzzy's fuzz.ratio, which without the optional
  python-Levenshtein (not in LongBench's requirements) is difflib.SequenceMatcher's ratio; duo-jax computes
  that with the standard library by default (--fuzzy difflib) and offers the Indel ratio of rapidfuzz
  (--fuzzy rapidfuzz: what fuzzywuzzy computes with python-Levenshtein). Compared on line pairs
  of this repository's Python files (a prediction line vs the next line, and vs itself with a few characters
  changed), the kind of strings the metric sees.
- ROUGE-L (gov_report, qmsum, multi_news, samsum; dureader / vcsum after jieba): duo-jax calls LongBench's
  own `rouge` package, so nothing differs; Google's maintained `rouge-score` is measured to show why it is
  not used (its tokenizer keeps only [a-z0-9], so Chinese text scores 0, and its LCS is per text, not the
  `rouge` package's summary-level union LCS).

    pip install fuzzywuzzy rouge-score   # only for this comparison
    python benchmarks/longbench_metric_libraries.py
"""

from __future__ import annotations

import pathlib
import random
import sys
import warnings

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import parser  # noqa: E402


def code_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    lines = [
        ln.strip()
        for f in sorted((REPO / "duo_jax").rglob("*.py"))
        for ln in f.read_text().splitlines()
        if len(ln.strip()) > 8
    ]
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        i = rng.randrange(len(lines) - 1)
        mutated = list(lines[i])
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.choice("abcxyz_()0123 ")
        pairs += [(lines[i], lines[i + 1]), ("".join(mutated), lines[i])]
    return pairs


def main(argv=None) -> int:
    p = parser(__doc__, "longbench_metric_libraries")
    p.add_argument("--pairs", type=int, default=2000)
    args = p.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fuzzywuzzy import fuzz as fuzzywuzzy
    from duo_jax.eval.longbench_metrics import fuzz_ratio, rouge_l, rouge_zh

    pairs = code_pairs(args.pairs)
    exact = sum(fuzzywuzzy.ratio(a, b) == fuzz_ratio(a, b, "difflib") for a, b in pairs)
    print(f"fuzzywuzzy (as LongBench installs it) == duo-jax's difflib matcher on {exact} of {len(pairs)} pairs")
    diffs = [abs(fuzzywuzzy.ratio(a, b) - fuzz_ratio(a, b, "rapidfuzz")) / 100 for a, b in pairs]
    print(
        f"code similarity on {len(pairs)} line pairs: |fuzzywuzzy (difflib) - rapidfuzz| mean "
        f"{sum(diffs) / len(diffs):.4f}, max {max(diffs):.2f}, "
        f"identical in {sum(d == 0 for d in diffs) / len(diffs):.1%}"
        f"; mean score {sum(fuzzywuzzy.ratio(a, b) for a, b in pairs) / len(pairs) / 100:.4f} vs "
        f"{sum(fuzz_ratio(a, b, 'rapidfuzz') for a, b in pairs) / len(pairs) / 100:.4f}"
    )

    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    english = [
        ("the cat sat on the mat", "the cat is on the mat"),
        ("cat sat on mat", "cat is on mat"),
        ("Founders should talk to users. Then they build.", "Talk to users, then build what they want."),
    ]
    for hyp, ref in english:
        print(
            f"rouge-L {hyp!r} vs {ref!r}: rouge {rouge_l(hyp, ref):.4f}, "
            f"rouge-score {scorer.score(ref, hyp)['rougeL'].fmeasure:.4f}"
        )
    hyp, ref = "我爱北京天安门", "我爱北京"
    import jieba

    segmented = " ".join(jieba.cut(hyp)), " ".join(jieba.cut(ref))
    print(
        f"rouge-L (Chinese, jieba) {hyp} vs {ref}: rouge {rouge_zh(hyp, ref):.4f}, "
        f"rouge-score {scorer.score(segmented[1], segmented[0])['rougeL'].fmeasure:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

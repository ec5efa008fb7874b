"""Write small LongBench-format files (one JSON object per line, LongBench's fields) for an end-to-end run
without LongBench's data: one task per metric family, contexts cut from the essays' evaluation half.

    python benchmarks/longbench_fixtures.py --out results/longbench_fixtures --words 1500
    python -m duo_jax.eval longbench --data results/longbench_fixtures --tasks hotpotqa multifieldqa_zh \\
        gov_report trec passage_count passage_retrieval_en lcc --modes full duo --kv-budget 0.25 0.5

The answers are simple facts planted in the text, so the scores say whether the pipeline works, not how good a
model is at LongBench; the real files come from huggingface.co/datasets/THUDM/LongBench (data.zip).
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import parser  # noqa: E402


def essay_words(n_words: int, start: int = 0) -> str:
    from duo_jax.data.ruler import essay_words as words

    return " ".join(words()[start : start + n_words])


def samples(n_words: int) -> dict[str, list[dict]]:
    """{task: samples}: LongBench's fields, one sample per task (two for the QA task)."""

    def sample(i, context, question, answers, all_classes=None, language="en"):
        return dict(
            input=question,
            context=context,
            answers=answers,
            length=len(context.split()),
            dataset="fixture",
            language=language,
            all_classes=all_classes,
            _id=f"fixture-{i}",
        )

    half = n_words // 2
    planted = essay_words(half) + " The secret ingredient of the founders' soup is cardamom. " + essay_words(half, half)
    paragraphs = [essay_words(60, 200 * k) for k in range(8)]
    retrieval = "\n\n".join(f"Paragraph {k + 1}: {p}" for k, p in enumerate(paragraphs))
    duplicates = "\n\n".join(f"Paragraph {k + 1}: {p}" for k, p in enumerate(paragraphs[:5] + paragraphs[:2]))
    chinese = (
        "创业公司的成长速度决定了它的命运。" * (n_words // 20)
        + "会议决定把总部搬到杭州。"
        + "投资人更看重团队。" * (n_words // 20)
    )
    code = "\n".join(f"def step_{k}(x):\n    return x + {k}\n" for k in range(n_words // 12))
    trec = "\n".join(
        f"Question: {q}\nType: {t}"
        for q, t in [
            ("Where is Boston?", "Location"),
            ("How many states are there?", "Number of something"),
            ("Who wrote Hamlet?", "Individual"),
        ]
        * (n_words // 30)
    )
    return {
        "hotpotqa": [
            sample(0, "Passage 1:\n" + planted, "What is the secret ingredient of the founders' soup?", ["cardamom"]),
            sample(1, "Passage 1:\n" + essay_words(n_words, 1000), "Who wrote these essays?", ["Paul Graham"]),
        ],
        "multifieldqa_zh": [sample(0, chinese, "总部搬到哪里？", ["杭州"], language="zh")],
        "gov_report": [sample(0, essay_words(n_words, 3000), "", [essay_words(120, 3000)])],
        "trec": [
            sample(
                0,
                trec,
                "Question: Where is Paris?\nType:",
                ["Location"],
                all_classes=["Location", "Number of something", "Individual"],
            )
        ],
        "passage_count": [sample(0, duplicates, "", ["5"])],
        "passage_retrieval_en": [sample(0, retrieval, paragraphs[3][:200], ["Paragraph 4"])],
        "lcc": [sample(0, code, "", [f"def step_{n_words // 12}(x):"])],
    }


def main(argv=None) -> int:
    p = parser(__doc__, "longbench_fixtures")
    p.add_argument("--words", type=int, default=1500, help="words of essay text per context")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for task, rows in samples(args.words).items():
        (args.out / f"{task}.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )
    print(f"wrote {len(samples(args.words))} LongBench-format files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""RULER's synthetic tasks (NVIDIA/RULER), generated as its scripts generate them, at a length in model tokens.

`make_sample(task, tokenizer, length, index, seed=..., chat=...)` returns a `RulerSample`: the prompt's token ids
(at most `length` tokens with the task's tokens to generate, the largest haystack that fits), the reference
answers and the metadata (needle depths, haystack size). A sample depends only on (seed, task, length, index).
`TASKS` and `TEMPLATES` are RULER's task configurations and templates; QA tasks read RULER's input files from
`qa_data`. What is reproduced from which of RULER's files, and the deviations: docs/ruler.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duo_jax.data.haystack import EVALUATION_HAYSTACK, DataError, encode, load_haystack
from duo_jax.errors import read_user_text

TEMPLATES = {
    "niah": dict(
        tokens_to_generate=128,
        template="Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
        "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
        "magic {type_needle_v} for {query} mentioned in the provided text?",
        answer_prefix=" The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "variable_tracking": dict(
        tokens_to_generate=30,
        template="Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        answer_prefix=" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: ",
    ),
    "common_words_extraction": dict(
        tokens_to_generate=120,
        template="Below is a numbered list of words. In these words, some appear more often than others. Memorize "
        "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
        "above list?",
        answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
    ),
    "freq_words_extraction": dict(
        tokens_to_generate=50,
        template="Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
        "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",
        answer_prefix=" Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
    "qa": dict(
        tokens_to_generate=32,
        template="Answer the question based on the given documents. Only give me the answer and do not output any "
        "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
        "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        answer_prefix=" Answer:",
    ),
}


def _niah(haystack, k, v, num_k=1, num_v=1, num_q=1):
    return (
        "niah",
        dict(
            type_haystack=haystack,
            type_needle_k=k,
            type_needle_v=v,
            num_needle_k=num_k,
            num_needle_v=num_v,
            num_needle_q=num_q,
        ),
    )


TASKS = {  # scripts/synthetic.yaml
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", num_v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", num_q=4),
    "vt": ("variable_tracking", dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}
QA_TASKS = ("qa_1", "qa_2")
QA_FILES = {"squad": "squad.json", "hotpotqa": "hotpotqa.json"}
GET_QA = (
    "RULER's scripts/data/synthetic/json/download_qa_dataset.sh fetches them: SQuAD v2.0 dev-v2.0.json as "
    "squad.json, HotpotQA hotpot_dev_distractor_v1.json as hotpotqa.json"
)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
DOCUMENT_PROMPT = "Document {i}:\n{document}"


@dataclasses.dataclass
class RulerSample:
    """One RULER sample: `ids` the whole prompt (what the model receives, answer prefix included), `outputs`
    the references, `length` = len(ids) + tokens_to_generate (RULER's length), `meta` what was drawn."""

    task: str
    index: int
    ids: list[int]
    outputs: list[str]
    length: int
    tokens_to_generate: int
    input: str
    answer_prefix: str
    meta: dict


def check_task(task: str) -> tuple[str, dict]:
    if task not in TASKS:
        raise DataError(f"unknown RULER task {task!r}: choose from {', '.join(TASKS)}")
    return TASKS[task]


# --- word lists and haystacks ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _wonderwords() -> tuple[list[str], list[str], list[str]]:
    try:
        from wonderwords import random_word
    except ImportError as e:
        raise DataError(
            "RULER's word keys come from the wonderwords package: pip install wonderwords "
            "(or pip install duo-jax[eval])"
        ) from e
    return tuple(random_word._get_words_from_text_file(f"{kind}list.txt") for kind in ("noun", "adjective", "verb"))


def random_key_word(rng: random.Random) -> str:
    """niah.py's word key: an adjective-noun pair drawn uniformly (niah.py draws from the sorted set of all
    pairs, the same distribution but for the rare pair spelled like another; the 6 million strings are not
    built here)."""
    nouns, adjectives, _ = _wonderwords()
    i = rng.randrange(len(adjectives) * len(nouns))
    return f"{adjectives[i // len(nouns)]}-{nouns[i % len(nouns)]}"


@functools.lru_cache(maxsize=4)
def common_words(seed: int) -> list[str]:
    """common_words_extraction.py's words: nouns + adjectives + verbs, deduplicated, sorted, shuffled by `seed`."""
    words = sorted(set(sum(_wonderwords(), [])))
    random.Random(seed).shuffle(words)
    return words


@functools.lru_cache(maxsize=4)
def essay_words(source: str = EVALUATION_HAYSTACK) -> list[str]:
    """The essay haystack as niah.py splits it: whitespace runs to one space, split on spaces."""
    return re.sub(r"\s+", " ", load_haystack(source)).split(" ")


def sentences(text: str) -> list[str]:
    """Sentences: `text` split at the whitespace after ``.``, ``!`` or ``?`` (a closing quote or bracket stays
    with its sentence)."""
    return [s for s in re.split(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+", text.strip()) if s]


# --- random values ----------------------------------------------------------------------------------------


def random_value(rng: random.Random, kind: str) -> str:
    """niah.py's generate_random: a 7-digit number, an adjective-noun word or a version-4 UUID."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return random_key_word(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise DataError(f"unknown needle type {kind!r}: numbers, words or uuids")


# --- generators: (rng, haystack size) -> (task text with {answer prefix}, answers, meta) ----------------------


def _niah_text(rng: random.Random, size: int, args: dict, seed: int, haystack_source: str):
    needles, keys, values = [], [], []
    num_k = max(args["num_needle_k"], args["num_needle_q"])
    for _ in range(num_k):
        keys.append(random_value(rng, args["type_needle_k"]))
        values.append([])
        for _ in range(args["num_needle_v"]):
            values[-1].append(random_value(rng, args["type_needle_v"]))
            needles.append(NEEDLE.format(type_needle_v=args["type_needle_v"], key=keys[-1], value=values[-1][-1]))
    random.Random(seed).shuffle(needles)
    meta: dict[str, Any] = {}
    if args["type_haystack"] == "essay":
        words = essay_words(haystack_source)
        words = (words * -(-size // len(words)))[:size]
        sents = sentences(" ".join(words))
        depths = rng.sample(DEPTHS, len(needles))
        cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in depths) + [len(sents)]
        pieces = []
        for i in range(1, len(cuts)):
            pieces.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
            if i - 1 < len(needles):
                pieces.append(needles[i - 1])
        context = " ".join(pieces)
        meta.update(depths=sorted(depths), sentences=len(sents), needle_sentence_index=cuts[1:-1])
    else:
        if args["type_haystack"] == "noise":
            lines = [NOISE] * size
        else:  # "needle": distractor needles with their own random keys and values
            lines = [
                NEEDLE.format(
                    type_needle_v=args["type_needle_v"],
                    key=random_value(rng, args["type_needle_k"]),
                    value=random_value(rng, args["type_needle_v"]),
                )
                for _ in range(size)
            ]
        for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        context = "\n".join(lines)
    chosen = rng.sample(range(num_k), args["num_needle_q"])
    queries = [keys[i] for i in chosen]
    answers = [a for i in chosen for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template = TEMPLATES["niah"]["template"] + "{answer_prefix}"
    prefix = TEMPLATES["niah"]["answer_prefix"]
    type_v = args["type_needle_v"]
    if args["num_needle_q"] * args["num_needle_v"] == 1:  # niah.py's singular wording, prefix included
        template, prefix = (_singular(t) for t in (template, prefix))
        type_v = type_v[:-1]
    meta.update(keys=keys, queries=queries, needles=needles)
    return (
        template.format(type_needle_v=type_v, context=context, query=query, answer_prefix="{answer_prefix}"),
        prefix.format(type_needle_v=type_v, query=query),
        answers,
        meta,
    )


def _singular(text: str) -> str:
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, icl: bool):
    letters = 3 if icl else 5
    names = ["".join(rng.choices(string.ascii_uppercase, k=letters)) for _ in range((num_hops + 1) * num_chains)]
    while len(set(names)) < num_chains * (num_hops + 1):  # variable_tracking.py's uniqueness rule
        names.append("".join(rng.choices(string.ascii_uppercase, k=letters)))
    variables, chains = [], []
    for i in range(0, len(names), num_hops + 1):
        chain_vars = names[i : i + num_hops + 1]
        variables.append(chain_vars)
        first = "12345" if icl else str(rng.randint(10000, 99998))  # numpy's randint(10000, 99999): high exclusive
        chains.append(
            [f"VAR {chain_vars[0]} = {first}"]
            + [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(num_hops)]
        )
    return variables, chains


def _vt_text(rng: random.Random, size: int, args: dict, icl: bool):
    variables, chains = _vt_chains(rng, args["num_chains"], args["num_hops"], icl)
    value = chains[0][0].split("=")[-1].strip()
    lines = [NOISE] * size
    for chain in chains:
        for j, position in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
            lines.insert(position + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    spec = TEMPLATES["variable_tracking"]
    fields = dict(context=context, query=value, num_v=args["num_hops"] + 1)
    return spec["template"].format(**fields), spec["answer_prefix"].format(**fields), variables[0]


def _randomize_icl(rng: random.Random, example: str, num_hops: int) -> str:
    """variable_tracking.py's randomize_icl: new names for the example's answer variables, a new value."""
    for name in example.strip().split()[-num_hops - 1 :]:
        example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(rng.randint(10000, 99998)))


def _cwe_example(
    rng: random.Random, seed: int, num_words: int, common_repeats: int, uncommon_repeats: int, num_common: int
):
    words = common_words(seed)
    if num_words > len(words):
        raise DataError(
            f"common words extraction needs {num_words} distinct words, more than wonderwords' "
            f"{len(words)} (RULER falls back to its english_words.json here): use a shorter length"
        )
    full = rng.sample(words, num_words)
    common, uncommon = full[:num_common], full[num_common:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    random.Random(seed).shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common


def _cwe_text(rng: random.Random, size: int, args: dict, seed: int, length: int):
    spec = TEMPLATES["common_words_extraction"]
    if length < 4096:
        shot_args, main_repeats = (20, 3, 1), (6, 1)
    else:
        shot_args, main_repeats = (40, 10, 3), (args["freq_cw"], args["freq_ucw"])
    shot_context, shot_answer = _cwe_example(rng, seed, *shot_args, args["num_cw"])
    shot = (
        spec["template"].format(context=shot_context)
        + spec["answer_prefix"]
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
    )
    context, answer = _cwe_example(rng, seed, size, *main_repeats, args["num_cw"])
    return shot + "\n" + spec["template"].format(context=context), spec["answer_prefix"], answer


def _fwe_text(rng: random.Random, size: int, args: dict, seed: int, length: int):
    from scipy.special import zeta

    spec = TEMPLATES["freq_words_extraction"]
    vocab_size = (length - spec["tokens_to_generate"]) // 50
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:  # freq_words_extraction.py's uniqueness rule
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."  # the most frequent word is noise
    ranks = np.arange(1, len(vocab) + 1)
    counts = (size * ranks ** -args["alpha"] / zeta(args["alpha"])).astype(int)
    words = [w for w, n in zip(vocab, counts) for _ in range(n)]
    random.Random(seed).shuffle(words)
    return spec["template"].format(context=" ".join(words)), spec["answer_prefix"], vocab[1:4]


@functools.lru_cache(maxsize=2)
def read_qa(folder: str, dataset: str) -> tuple[list[dict], list[str]]:
    """qa.py's read_squad / read_hotpotqa: (questions with their documents' indices, all documents sorted)."""
    path = Path(folder) / QA_FILES[dataset]
    if not path.is_file():
        raise DataError(f"no {path.name} in {folder}: {GET_QA}")
    try:
        data = json.loads(read_user_text(path, DataError, f": {GET_QA}"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not JSON ({e}): {GET_QA}") from None
    if dataset == "squad":
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        questions = []
        for d in data["data"]:
            more = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        own = index[p["context"]]
                        questions.append(
                            dict(
                                query=qa["question"],
                                outputs=[a["text"] for a in qa["answers"]],
                                context=[own],
                                more_context=[i for i in more if i != own],
                            )
                        )
        return questions, docs
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    return [
        dict(query=d["question"], outputs=[d["answer"]], context=[index[f"{t}\n{''.join(p)}"] for t, p in d["context"]])
        for d in data
    ], docs


def _qa_text(rng: random.Random, size: int, args: dict, seed: int, index: int, qa_data: str):
    questions, docs = read_qa(qa_data, args["dataset"])
    if index >= len(questions):
        raise DataError(
            f"{QA_FILES[args['dataset']]} has {len(questions)} answerable questions, sample {index} asked for"
        )
    q = questions[index]
    own, more = q["context"], q.get("more_context", [])
    if size < len(docs):
        if size - len(own) > len(more):
            others = [i for i in range(len(docs)) if i not in own + more]
            chosen = own + more + rng.sample(others, max(0, size - len(own) - len(more)))
        else:
            chosen = own + rng.sample(more, size - len(own))
        chosen_docs = [docs[i] for i in chosen]
    else:
        chosen_docs = (docs * -(-size // len(docs)))[:size]
    random.Random(seed).shuffle(chosen_docs)
    context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(chosen_docs))
    spec = TEMPLATES["qa"]
    return spec["template"].format(context=context, query=q["query"]), spec["answer_prefix"], q["outputs"]


# --- assembling and fitting -----------------------------------------------------------------------------


def prompt_ids(tokenizer: Any, text: str, answer_prefix: str, chat: bool) -> list[int]:
    """The ids the model receives: `text` (for a chat model: as the user message of its chat template), then
    the answer prefix; with the tokenizer's special tokens (the template writes its own)."""
    if chat:
        from duo_jax.chat import render

        rendered = render(tokenizer.chat_template, [{"role": "user", "content": text}], **tokenizer.special_tokens)
        return encode(tokenizer, rendered + answer_prefix).tolist()
    return list(tokenizer.encode(text + answer_prefix))


def fit(build: Callable[[int], tuple[list[int], Any]], budget: int, low: int, high: int) -> tuple[int, list[int], Any]:
    """The largest haystack size in [low, high] whose prompt has at most `budget` tokens (binary search, as
    RULER's); (size, ids, extra) of it. Raises DataError when even `low` does not fit."""
    best = None
    while low <= high:
        mid = (low + high) // 2
        ids, extra = build(mid)
        if len(ids) <= budget:
            best, low = (mid, ids, extra), mid + 1
        else:
            high = mid - 1
    if best is None:
        raise DataError(
            f"the prompt does not fit in {budget} tokens even with the smallest haystack: use a longer length"
        )
    return best


def make_sample(
    task: str,
    tokenizer: Any,
    length: int,
    index: int,
    *,
    seed: int = 42,
    chat: bool = False,
    haystack: str = EVALUATION_HAYSTACK,
    qa_data: str | Path | None = None,
) -> RulerSample:
    """Sample `index` of RULER task `task` at `length` tokens (prompt + tokens to generate; docs/ruler.md,
    "Length"). chat: wrap the task text in the tokenizer's chat template (the answer prefix follows it)."""
    kind, args = check_task(task)
    spec = TEMPLATES[kind]
    budget = length - spec["tokens_to_generate"]
    if budget < 1:
        raise DataError(
            f"length {length} leaves no room for a prompt beside {task}'s {spec['tokens_to_generate']} "
            "tokens to generate"
        )
    if kind == "qa" and qa_data is None:
        raise DataError(f"RULER's {task} needs its QA data: pass --qa-data DIR ({GET_QA})")

    def rng(stream: str = "sample"):  # independent streams: the one-shot example never shares draws with the sample
        return random.Random(f"{seed}/{task}/{length}/{index}/{stream}")

    icl = ""
    if kind == "variable_tracking":  # a one-shot example of at most 500 tokens, as variable_tracking.py builds

        def build_icl(size):
            text, prefix, answer = _vt_text(rng("example"), size, args, icl=True)
            return list(tokenizer.encode(text + prefix)), text + prefix + " " + " ".join(answer) + "\n"

        icl = _randomize_icl(rng("example names"), fit(build_icl, 500, args["num_hops"] + 1, 500)[2], args["num_hops"])

    def build(size):
        r = rng()
        meta = {}
        if kind == "niah":
            text, prefix, answers, meta = _niah_text(r, size, args, seed, haystack)
            text = text.replace("{answer_prefix}", "")
        elif kind == "variable_tracking":
            text, prefix, answers = _vt_text(r, size, args, icl=False)
            text = icl + "\n" + text  # variable_tracking.py: the example (ending in a newline), a newline, the task
        elif kind == "common_words_extraction":
            text, prefix, answers = _cwe_text(r, size, args, seed, length)
        elif kind == "freq_words_extraction":
            text, prefix, answers = _fwe_text(r, size, args, seed, length)
        else:
            text, prefix, answers = _qa_text(r, size, args, seed, index, str(qa_data))
        return prompt_ids(tokenizer, text, prefix, chat), (text, prefix, answers, meta)

    high = max(16, 3 * budget)  # no haystack unit is shorter than a third of a token
    low = {
        "niah": max(args.get("num_needle_k", 1), args.get("num_needle_q", 1)) * args.get("num_needle_v", 1),
        "variable_tracking": args.get("num_hops", 0) + 1,
        "common_words_extraction": args.get("num_cw", 0) + 1,
    }.get(kind, 1)  # what the generator needs at least
    size, ids, (text, prefix, answers, meta) = fit(build, budget, low, high)
    if kind == "niah":
        meta["needle_token_positions"] = _needle_positions(tokenizer, text, meta["needles"])
    return RulerSample(
        task=task,
        index=index,
        ids=ids,
        outputs=[str(a) for a in answers],
        length=len(ids) + spec["tokens_to_generate"],
        tokens_to_generate=spec["tokens_to_generate"],
        input=text,
        answer_prefix=prefix,
        meta=dict(meta, haystack_size=size),
    )


def _needle_positions(tokenizer: Any, text: str, needles: Sequence[str]) -> list[float]:
    """Each needle's start as a fraction of the task text's tokens (a depth as NIAH heat maps draw it)."""
    total = max(1, len(encode(tokenizer, text)))
    return [len(encode(tokenizer, text[: text.index(n)])) / total for n in needles]

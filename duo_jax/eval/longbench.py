"""LongBench (v1) on any model duo-jax loads, in every KV-cache mode at every KV budget.

Reproduces THUDM/LongBench's v1 ``pred.py`` (prompts, middle truncation, chat rule, generation lengths: `PROMPTS`,
`MAX_NEW_TOKENS`, `build_prompt`) and ``eval.py`` (post-processing and metrics: `duo_jax.eval.longbench_metrics`)
over LongBench's own ``<task>.jsonl`` files (`load_task`; nothing is downloaded). `run_longbench` generates every
sample greedily in every run, resumably (`duo_jax.eval.samples`), and writes ``longbench.json``, ``longbench.md``
and ``longbench_budget.png``. What is reproduced from where, the deviations and the outputs: docs/longbench.md.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from duo_jax.chat import chat_prompts, is_chat_model
from duo_jax.data.haystack import DataError, decode
from duo_jax.errors import DuoJaxError, read_user_text
from duo_jax.eval import report
from duo_jax.eval.longbench_metrics import (
    FUZZY,
    LENGTH_BUCKETS,
    METRICS,
    length_bucket_scores,
    sample_score,
    task_score,
)
from duo_jax.eval.samples import (
    PredictionStore,
    Run,
    Sample,
    Settings,
    budget_panel,
    check_duo_budget,
    generate_missing,
    make_runs,
    mean_score,
    protocol_legend,
    seconds_per_1k_tokens,
    settings_record,
    write_results,
)
from duo_jax.loading import Model

DATA_URL = "https://huggingface.co/datasets/THUDM/LongBench"
GET_DATA = (
    f"download data.zip from {DATA_URL} (resolve/main/data.zip), unzip it and pass its data/ folder as --data DIR"
)

PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',  # noqa: E501
    "passage_retrieval_zh": '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
MAX_NEW_TOKENS = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}
TASKS = tuple(PROMPTS)  # LongBench's 21 tasks, in pred.py's order
E_TASKS = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)  # LongBench-E's 13
NO_CHAT_TASKS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
# LongBench's leaderboard (its README): an English and a Chinese table, each of six categories of that language's
# tasks (code completion in both), "Avg" the mean of the six category scores.
CATEGORIES = {
    "en": {
        "Single-Doc QA": ("narrativeqa", "qasper", "multifieldqa_en"),
        "Multi-Doc QA": ("hotpotqa", "2wikimqa", "musique"),
        "Summarization": ("gov_report", "qmsum", "multi_news"),
        "Few-shot Learning": ("trec", "triviaqa", "samsum"),
        "Code Completion": ("lcc", "repobench-p"),
        "Synthetic Tasks": ("passage_count", "passage_retrieval_en"),
    },
    "zh": {
        "Single-Doc QA": ("multifieldqa_zh",),
        "Multi-Doc QA": ("dureader",),
        "Summarization": ("vcsum",),
        "Few-shot Learning": ("lsht",),
        "Code Completion": ("lcc", "repobench-p"),
        "Synthetic Tasks": ("passage_retrieval_zh",),
    },
}
FIELDS = ("input", "context", "answers", "length", "all_classes", "language", "_id")
# Room left beside the default --max-length: the largest MAX_NEW_TOKENS plus a chat template.
DEFAULT_MARGIN = 600


class LongBenchDataError(DataError):
    """LongBench data that is missing or not in LongBench's format; the message says where to get it."""


assert set(PROMPTS) == set(MAX_NEW_TOKENS) == set(METRICS)


def check_tasks(tasks: Sequence[str] | None, longbench_e: bool = False) -> list[str]:
    """The task names (default: every task of LongBench, or LongBench-E), validated, in the order given."""
    allowed = E_TASKS if longbench_e else TASKS
    tasks = list(dict.fromkeys(tasks or allowed))
    unknown = [t for t in tasks if t not in allowed]
    if unknown:
        raise DuoJaxError(
            f"unknown LongBench{'-E' if longbench_e else ''} task(s) {', '.join(unknown)}: choose "
            f"from {', '.join(allowed)}"
        )
    return tasks


def task_file(data_dir: str | Path, task: str, longbench_e: bool = False) -> Path:
    return Path(data_dir) / f"{task}{'_e' if longbench_e else ''}.jsonl"


def predictions_file(out_dir: str | Path, run: str, task: str, longbench_e: bool = False) -> Path:
    """Where a run's predictions of a task are kept: LongBench-E's apart from LongBench's (LongBench's own `pred/`
    and `pred_e/`), so that runs of both into one folder do not take turns overwriting each other's."""
    return Path(out_dir) / f"predictions{'_e' if longbench_e else ''}" / run / f"{task}.jsonl"


def load_task(data_dir: str | Path, task: str, *, longbench_e: bool = False, limit: int | None = None) -> list[dict]:
    """The samples of `task` from LongBench's file in `data_dir` (the first `limit` when given), checked."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise LongBenchDataError(f"LongBench data folder {data_dir} does not exist: {GET_DATA}")
    path = task_file(data_dir, task, longbench_e)
    if not path.is_file():
        raise LongBenchDataError(f"no {path.name} in {data_dir}: {GET_DATA} (or leave {task} out with --tasks)")
    samples = []
    for number, line in enumerate(read_user_text(path, LongBenchDataError, f": {GET_DATA}").splitlines(), 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except json.JSONDecodeError as e:
            raise LongBenchDataError(
                f"{path}:{number} is not JSON ({e}): LongBench files hold one JSON object per line; {GET_DATA}"
            ) from None
        if not isinstance(sample, dict):
            raise LongBenchDataError(
                f"{path}:{number} holds a JSON {type(sample).__name__}, not an object: LongBench files hold one "
                f"JSON object per line; {GET_DATA}"
            )
        missing = [f for f in FIELDS if f not in sample]
        if missing:
            raise LongBenchDataError(
                f"{path}:{number} lacks field(s) {', '.join(missing)} (LongBench's fields: "
                f"{', '.join(FIELDS)}); {GET_DATA}"
            )
        if not isinstance(sample["answers"], list) or not all(isinstance(a, str) for a in sample["answers"]):
            raise LongBenchDataError(f"{path}:{number}: 'answers' must be a list of strings")
        if isinstance(sample["length"], bool) or not isinstance(sample["length"], int):  # LongBench-E's buckets
            raise LongBenchDataError(
                f"{path}:{number}: 'length' must be a whole number of words, got {sample['length']!r}"
            )
        samples.append(sample)
        if limit is not None and len(samples) >= limit:
            break
    if not samples:
        raise LongBenchDataError(f"{path} holds no samples; {GET_DATA}")
    ids = [str(s["_id"]) for s in samples]
    if len(set(ids)) != len(ids):
        raise LongBenchDataError(f"{path}: the _id of each sample must be unique (it keys resumed runs)")
    return samples


def truncate_middle(tokenizer: Any, text: str, max_length: int) -> str:
    """pred.py's truncation: `text` itself when its token ids (special tokens included) fit in `max_length`,
    else the text of its first int(max_length / 2) tokens followed by that of its last as many."""
    ids = list(tokenizer.encode(text))
    if len(ids) <= max_length:
        return text
    half = int(max_length / 2)
    return decode(tokenizer, ids[:half]) + decode(tokenizer, ids[-half:])


def uses_chat(task: str, chat: bool) -> bool:
    """Whether pred.py wraps `task`'s prompt in the chat template (never for NO_CHAT_TASKS)."""
    return chat and task not in NO_CHAT_TASKS


def check_max_length(max_length: int) -> None:
    """The prompt tokens kept after middle truncation: at least one from each end."""
    if max_length < 2:
        raise DuoJaxError(f"max_length must be at least 2 tokens, got {max_length}")


def build_prompt(model: Model, task: str, sample: dict, max_length: int, *, chat: bool) -> list[int]:
    """The token ids LongBench feeds the model for `sample` of `task` (docs/longbench.md); `chat`: whether the
    model is treated as a chat model (`duo_jax.chat.chat_prompts` then wraps the prompt)."""
    check_max_length(max_length)
    text = truncate_middle(model.tokenizer, PROMPTS[task].format(**sample), max_length)
    if uses_chat(task, chat):
        return chat_prompts(model, [text], True)[0]
    return list(model.tokenizer.encode(text))


PROTOCOLS = ("longbench", "duoattention")
# DuoAttention's fork of LongBench (mit-han-lab/duo-attention, eval/LongBench): its config/model2maxlen.json, and
# pred.py's --decoding_simulation_length (the prompt's last tokens decoded one at a time, every method)
DUOATTENTION_MAX_LENGTH = {
    "Mistral-7B-Instruct-v0.2": 31500,
    "Mistral-7B-Instruct-v0.3": 31500,
    "Llama-3-8B-Instruct-Gradient-1048k": 1047500,
    "Llama-2-7B-32K-Instruct": 31500,
    "Meta-Llama-3.1-8B-Instruct": 127500,
}
DUOATTENTION_DECODE_LAST = 50


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise DuoJaxError(f"unknown LongBench protocol {protocol!r}: choose from {', '.join(PROTOCOLS)}")
    return protocol


def model_name(model: Model) -> str:
    """The name DuoAttention's fork knows `model` by (a key of DUOATTENTION_MAX_LENGTH, matched by the last part of
    any of the model's names, "Meta-" optional), else the last part of its first name, else its config's name."""
    names = [n.rstrip("/").split("/")[-1] for n in model.names if n]
    for name in names:
        for key in DUOATTENTION_MAX_LENGTH:
            if name.lower() in (key.lower(), key.lower().removeprefix("meta-")):
                return key
    return names[0] if names else model.config.name


def duoattention_post_process(prediction: str, name: str) -> str:
    """pred.py's `post_process` in DuoAttention's fork: what it stores of a prediction, by the model's name."""
    if "xgen" in name:
        return prediction.strip().replace("Assistant:", "")
    if "internlm" in name:
        return prediction.split("<eoa>")[0]
    if "llama-3" in name.lower():
        return prediction.split(".assistant")[0].split("\n\nQuestion")[0].split("</s>")[0].strip()
    if "Llama-2-7B-32K-Instruct" in name:
        for mark in ("(Document", "\n\nQuestion", "\n\nAnswer", "(Passage"):
            prediction = prediction.split(mark)[0]
        return prediction.strip()
    return prediction


def default_max_length(model: Model, protocol: str = "longbench") -> int:
    """The prompt tokens kept: the model's context less DEFAULT_MARGIN; under DuoAttention's fork, its
    model2maxlen.json (a model it does not list needs an explicit max_length)."""
    if check_protocol(protocol) == "duoattention":
        name = model_name(model)
        if name not in DUOATTENTION_MAX_LENGTH:
            raise DuoJaxError(
                f"DuoAttention's LongBench gives a max length only for {', '.join(DUOATTENTION_MAX_LENGTH)}, not "
                f"{name!r}: pass --max-length N"
            )
        return DUOATTENTION_MAX_LENGTH[name]
    return max(2, model.config.max_position_embeddings - DEFAULT_MARGIN)


def longbench_model(model: Model) -> Model:
    """`model` with the tokenizer that LongBench's `pred.py` decodes with (prompts cut in the middle, predictions):
    transformers 4.31, as its requirements pin, cleaned up the spaces (" ," -> ",") where the tokenizer's config
    does not say (`Tokenizer.cleaning_up_unless_set`); transformers since 4.45 does not."""
    cleaning = getattr(model.tokenizer, "cleaning_up_unless_set", None)
    return model if cleaning is None else dataclasses.replace(model, tokenizer=cleaning())


def run_longbench(
    model: Model,
    modes: Sequence[str],
    *,
    data_dir: str | Path,
    kv_budgets: Sequence[float] | None,
    settings: Settings,
    tasks: Sequence[str] | None = None,
    longbench_e: bool = False,
    max_length: int | None = None,
    limit: int | None = None,
    chat: bool | None = None,
    out_dir: str | Path,
    decode_last: int | None = None,
    fuzzy: str = "difflib",
    protocol: str = "longbench",
    progress: bool = True,
) -> dict:
    """Generate and score every sample of `tasks` in every run (`duo_jax.eval.samples.make_runs`), resuming
    from the predictions already in `out_dir`; the outputs: docs/longbench.md, "What the numbers mean".

    protocol: "longbench", THUDM's LongBench; "duoattention", DuoAttention's fork of it, whose defaults differ (no
    chat template, its max lengths, the last 50 prompt tokens decoded one at a time in every mode after a
    one-chunk prefill, duo's budget as its share of retrieval heads) and whose scoring cuts the predictions
    (docs/longbench.md, "DuoAttention's LongBench"). decode_last None: the protocol's (0, or 50)."""
    from tqdm.auto import tqdm

    if model.tokenizer is None:
        raise DuoJaxError("LongBench needs the model's tokenizer (none was found with the weights)")
    fork = check_protocol(protocol) == "duoattention"
    if fork and settings.streaming_chunk is not None:
        raise DuoJaxError(
            "the duoattention protocol prefills each prompt in one pass, every head seeing all of it, as DuoAttention's "
            "LongBench does; --streaming-chunk would cut what the streaming heads see: leave it out"
        )
    if not fork:
        model = longbench_model(model)
    tasks = check_tasks(tasks, longbench_e)
    if fuzzy not in FUZZY:
        raise DuoJaxError(f"unknown fuzzy matcher {fuzzy!r}: choose from {', '.join(FUZZY)}")
    if decode_last is None:
        decode_last = DUOATTENTION_DECODE_LAST if fork else 0
    settings = dataclasses.replace(settings, duo_budget=settings.duo_budget or ("heads" if fork else "fitted"))
    check_duo_budget(settings.duo_budget, kv_budgets)
    runs = make_runs(modes, kv_budgets, decode_last, every_mode=fork)
    max_length = default_max_length(model, protocol) if max_length is None else int(max_length)
    chat = (False if fork else is_chat_model(model)) if chat is None else chat
    name = model_name(model)

    def score(task: str, record: dict, cuts: bool | None = None) -> float:
        return record_score(task, record, fuzzy, protocol, name, cuts=cuts)

    data = {t: load_task(data_dir, t, longbench_e=longbench_e, limit=limit) for t in tasks}  # all checked first
    out_dir = Path(out_dir)
    start = time.perf_counter()
    prompts: dict[str, list[list[int]]] = {}
    context = model.config.max_position_embeddings
    # every prompt first (tokenized and cut to max_length): one that cannot fit fails before any generation
    for task in tqdm(tasks, desc="longbench prompts", unit="task", disable=not progress):
        prompts[task] = [build_prompt(model, task, s, max_length, chat=chat) for s in data[task]]
        for sample, ids in zip(data[task], prompts[task]):
            if len(ids) + MAX_NEW_TOKENS[task] > context:
                raise DuoJaxError(
                    f"{task} sample {sample['_id']}: its prompt ({len(ids)} tokens after "
                    f"truncation to --max-length {max_length}) + {MAX_NEW_TOKENS[task]} new tokens "
                    f"exceed the model's context of {context}: lower --max-length"
                )
    groups = {
        task: [
            Sample(
                str(sample["_id"]),
                ids,
                MAX_NEW_TOKENS[task],
                dict(answers=sample["answers"], all_classes=sample["all_classes"], length=sample["length"]),
            )
            for sample, ids in zip(data[task], prompts[task])
        ]
        for task in tasks
    }
    generate_missing(
        model,
        runs,
        groups,
        settings,
        file=lambda run, task: predictions_file(out_dir, run.name, task, longbench_e),
        score=score,
        desc="longbench",
        progress=progress,
    )
    results = score_runs(out_dir, runs, data, longbench_e, score)
    results.update(
        task="longbench",
        protocol=protocol,
        model_name=name,
        longbench_e=longbench_e,
        fuzzy=fuzzy,
        data_dir=str(data_dir),
        tasks=tasks,
        max_length=max_length,
        chat=chat,
        limit=limit,
        chat_tasks=[t for t in tasks if uses_chat(t, chat)],
        **settings_record(model, settings, kv_budgets),
        prompt_tokens={t: [len(p) for p in v] for t, v in prompts.items()},
        wall_s=time.perf_counter() - start,
        machine=report.machine_info(),
    )
    write_outputs(results, out_dir)
    return results


def score_runs(
    out_dir: str | Path, runs: Sequence[Run], data: dict[str, list[dict]], longbench_e: bool, score=None
) -> dict:
    """The scores of every run from its stored predictions (`score(task, record)`: `record_score` under the
    evaluation's protocol; None, THUDM's): {"runs": {name: {...}}}."""
    score = record_score if score is None else score
    results = {}
    for run in runs:
        tasks, records = {}, {}
        for task, samples in data.items():
            store = PredictionStore(predictions_file(out_dir, run.name, task, longbench_e))
            done = store.ordered(str(s["_id"]) for s in samples)
            # The tables rescore each prediction with the current metric code. A line's own "score" is what the
            # metric gave when it was generated, kept for reading the lines; nothing reads it back.
            scores = [score(task, r) for r in done]
            tasks[task] = dict(score=task_score(scores), samples=len(done), s_per_1k_tokens=seconds_per_1k_tokens(done))
            if longbench_e:  # DuoAttention's scorer_e cuts nothing: its buckets score the stored prediction
                by_length = scores if score is record_score else [score(task, r, cuts=False) for r in done]
                tasks[task]["by_length"] = length_bucket_scores(by_length, [r["length"] for r in done])
            records[task] = done
        results[run.name] = dict(
            mode=run.mode,
            kv_budget=run.kv_budget,
            decode_last=run.decode_last,
            protocol=run.protocol,
            tasks=tasks,
            categories=category_scores({t: v["score"] for t, v in tasks.items()}),
            average=mean_score([v["score"] for v in tasks.values()]),
            predictions=records,
        )
    return dict(runs=results)


def record_score(
    task: str, record: dict, fuzzy: str = "difflib", protocol: str = "longbench", name: str = "", cuts=None
) -> float:
    """A stored prediction's score (`sample_score` of its "pred", "answers", "all_classes"): when it is made, and
    when the tables rescore it. Under DuoAttention's fork (`protocol` "duoattention") its pred.py post-processes the
    prediction by the model's `name` first and its eval.py cuts it (`sample_score`'s `cuts`; False: not, as its
    LongBench-E `scorer_e`); the stored "pred" is the generation's text either way."""
    pred, fork = record["pred"], check_protocol(protocol) == "duoattention"
    if fork:
        pred = duoattention_post_process(pred, name)
    cuts = fork if cuts is None else cuts
    return sample_score(task, pred, record["answers"], record["all_classes"], fuzzy, cuts=cuts)


def category_scores(task_scores: dict[str, float]) -> dict[str, dict]:
    """LongBench's leaderboard per language: {"en" / "zh": {"categories": {category: mean score of its evaluated
    tasks}, "avg": the mean of the six categories, or None unless every task of the language was evaluated (a
    mean over some categories is no leaderboard "Avg")}}. Chinese only where a Chinese task ran (the code tasks
    are on both boards)."""
    out = {}
    for language, categories in CATEGORIES.items():
        members = [t for group in categories.values() for t in group]
        if not any(
            t in task_scores for t in members if language == "en" or t not in CATEGORIES["en"]["Code Completion"]
        ):
            continue
        scores = {
            name: mean_score([task_scores[t] for t in group if t in task_scores])
            for name, group in categories.items()
            if any(t in task_scores for t in group)
        }
        complete = all(t in task_scores for t in members)
        out[language] = dict(categories=scores, avg=mean_score(list(scores.values())) if complete else None)
    return out


def tables(results: dict) -> str:
    """Markdown: per-task scores and their mean, then LongBench's leaderboard tables (per language: "Avg" and the
    categories evaluated), one row per run."""
    runs = results["runs"]
    tasks = results["tasks"]
    task_rows = [[name, *[r["tasks"][t]["score"] for t in tasks], r["average"]] for name, r in runs.items()]
    text = report.markdown_table(["run", *tasks, "mean over tasks"], task_rows)
    first = next(iter(runs.values()), {"categories": {}})
    for language, board in first["categories"].items():
        names = list(board["categories"])
        rows = [
            [name, r["categories"][language]["avg"], *[r["categories"][language]["categories"][c] for c in names]]
            for name, r in runs.items()
        ]
        title = {"en": "English", "zh": "Chinese"}[language]
        text += f"\n\n{title} (LongBench's leaderboard; Avg only when all its tasks ran):\n\n"
        text += report.markdown_table(["run", "Avg", *names], rows)
    if results.get("longbench_e"):
        rows = [
            [name, t, *(r["tasks"][t]["by_length"][b] for b in LENGTH_BUCKETS)]
            for name, r in runs.items()
            for t in tasks
        ]
        text += "\n\n" + report.markdown_table(["run", "task", *LENGTH_BUCKETS], rows)
    return text + protocol_legend(runs, results.get("duo_budget"))


def budget_figure(results: dict, path: str | Path) -> Path:
    """Score vs KV budget, one line per method (full: a dashed level), one panel per task plus the average."""
    runs = results["runs"].values()
    budgets = sorted({r["kv_budget"] for r in runs if r["kv_budget"] is not None})
    panels = {
        title: budget_panel(
            runs, budgets, lambda r, t=title: r["average"] if t == "average" else r["tasks"][t]["score"]
        )
        for title in [*results["tasks"], "average"]
    }
    return report.budget_panels(path, budgets, panels, title=f"LongBench, {results['model']}")


def write_outputs(results: dict, out_dir: str | Path) -> list[Path]:
    """longbench_budget.png, longbench.md and longbench.json into `out_dir`."""
    return write_results(results, out_dir, "longbench", tables, budget_figure)

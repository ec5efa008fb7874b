"""RULER (duo_jax.data.ruler, duo_jax.eval.ruler): sample lengths in model tokens within RULER's tolerance,
needle placement by depth, RULER's uniqueness rules, seeds, QA data, the metrics on hand-made cases, and an
end-to-end run on a tiny random model."""

import collections
import json
import re

import jax
import numpy as np
import pytest

import duo_jax
from duo_jax.data import ruler as data
from duo_jax.data.haystack import DataError
from duo_jax.errors import DuoJaxError
from duo_jax.eval import ruler, samples
from duo_jax.loading import Model
from duo_jax.pattern import Pattern
from tests.conftest import tiny_config

CONFIG = tiny_config(vocab_size=2000, max_position_embeddings=1024)
SYNTHETIC = [t for t in data.TASKS if t not in data.QA_TASKS]


# --- metrics -------------------------------------------------------------------------------------------------


def test_string_match_metrics():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("ABC-def", ["abc-DEF"]) == 1.0  # case-insensitive
    assert ruler.string_match_all("", ["1"]) == 0.0
    assert ruler.string_match_part("Paris or London", ["Rome", "london"]) == 1.0
    assert ruler.string_match_part("Berlin", ["Rome", "London"]) == 0.0
    assert ruler.postprocess("  12\x0034\t56 \n") == "12\n34\n56"
    # RULER's score of a task: summed, / n, x 100, rounded, in that order; x 100 first rounds this tie up (14.38)
    values = [0.25] * 23 + [0.0] * 17
    assert ruler.task_score(values) == round(sum(values) / len(values) * 100, 2) == 14.37
    assert round(sum(100 * v for v in values) / len(values), 2) == 14.38
    assert ruler.metric("qa_1") is ruler.string_match_part and ruler.metric("vt") is ruler.string_match_all
    with pytest.raises(DataError, match="unknown RULER task"):
        ruler.metric("niah_single_9")


# --- generation ----------------------------------------------------------------------------------------------

# At most this many tokens short of the length: one haystack unit (a noise sentence, a distractor needle of
# UUIDs, a noise line of variable tracking; an essay word or a listed word otherwise), under the test tokenizer.
TOLERANCE = collections.defaultdict(lambda: 16, niah_single_1=32, niah_multikey_2=48, niah_multikey_3=120, vt=32)


@pytest.mark.slow
@pytest.mark.parametrize("task", SYNTHETIC)
def test_length_within_tolerance_and_seeded(tokenizer, task):
    length = 1024 if task in ("vt", "cwe") else 640  # vt's one-shot example alone takes up to 500 tokens
    sample = data.make_sample(task, tokenizer, length, 0)
    assert sample.length == len(sample.ids) + data.TEMPLATES[data.TASKS[task][0]]["tokens_to_generate"]
    assert length - TOLERANCE[task] <= sample.length <= length
    assert sample.ids == list(tokenizer.encode(sample.input + sample.answer_prefix))
    text = tokenizer.decode(sample.ids)
    for answer in sample.outputs:
        assert answer in text  # every reference is somewhere in the prompt
    assert data.make_sample(task, tokenizer, length, 0).ids == sample.ids  # seeded
    assert data.make_sample(task, tokenizer, length, 1).ids != sample.ids
    assert data.make_sample(task, tokenizer, length, 0, seed=7).ids != sample.ids


def test_templates_and_answer_prefix(tokenizer):
    single = data.make_sample("niah_single_2", tokenizer, 512, 0)
    assert single.input.startswith("A special magic number is hidden within the following text.")
    assert single.input.endswith(
        f"What is the special magic number for {single.meta['queries'][0]} mentioned in the provided text?"
    )
    assert single.answer_prefix == (
        f" The special magic number for {single.meta['queries'][0]} mentioned in the provided text is"
    )
    multi = data.make_sample("niah_multiquery", tokenizer, 512, 0)
    q = multi.meta["queries"]
    assert multi.answer_prefix == (
        f" The special magic numbers for {q[0]}, {q[1]}, {q[2]}, and {q[3]} mentioned in the provided text are"
    )
    assert len(multi.outputs) == 4
    assert data.make_sample("niah_single_3", tokenizer, 512, 0).outputs[0].count("-") == 4  # a UUID
    vt = data.make_sample("vt", tokenizer, 1024, 0)
    assert vt.answer_prefix.startswith(
        " Answer: According to the chain(s) of variable assignment in the text "
        "above, 5 variables are assigned the value "
    )


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_1", "niah_multivalue"])
def test_needles_sit_at_their_depths(tokenizer, task):
    sample = data.make_sample(task, tokenizer, 1024, 3)
    depths, positions = sample.meta["depths"], sample.meta["needle_token_positions"]
    assert all(d in data.DEPTHS for d in depths) and len(set(depths)) == len(depths)  # sampled without repeats
    # Each needle follows int(sentences * depth / 100) haystack sentences (RULER's depth: a share of sentences),
    # which puts it near its depth in tokens too.
    cuts = sorted(int(sample.meta["sentences"] * d / 100) for d in depths)
    assert sample.meta["needle_sentence_index"] == cuts
    context = sample.input.split("afterwards.\n", 1)[1]
    for needle in sample.meta["needles"]:
        before = context[: context.index(needle)]
        for other in sample.meta["needles"]:
            before = before.replace(other, "")
        assert len(data.sentences(before)) in cuts
    for depth, position in zip(sorted(depths), sorted(positions)):
        assert abs(position - depth / 100) < 0.15, (depth, position)
    # The needle sentences are verbatim and each key maps to its value.
    for needle in sample.meta["needles"]:
        assert needle in sample.input and needle.startswith("One of the special magic number")


def test_sentences_split():
    assert data.sentences('One. "Two!" Three? four a.b') == ["One.", '"Two!"', "Three?", "four a.b"]


def test_variable_tracking_chain_and_uniqueness(tokenizer):
    sample = data.make_sample("vt", tokenizer, 1024, 2)
    names = sample.outputs
    assert len(names) == 5 and len(set(names)) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    value = re.search(rf"VAR {names[0]} = (\d{{5}})", sample.input).group(1)
    for previous, name in zip(names, names[1:]):
        assert f"VAR {name} = VAR {previous} " in sample.input
    assert sample.answer_prefix.endswith(f"assigned the value {value}, they are: ")
    # The one-shot example comes first, with its own (3-letter) names and value, and its answer.
    example = sample.input[: sample.input.index("Memorize and track", 1)]
    assert re.search(r"VAR [A-Z]{3} = \d{5}", example) and value not in example
    assert not any(n in example for n in names)


def test_word_extraction_answers(tokenizer):
    cwe = data.make_sample("cwe", tokenizer, 1024, 0)
    main = cwe.input.split("\n")[-2]  # the numbered list of the question (after the one-shot example)
    counts = collections.Counter(re.findall(r"\d+\. (\S+)", main))
    assert len(set(cwe.outputs)) == 10 and all(counts[w] == 6 for w in cwe.outputs)  # length < 4096: 6 repeats
    assert all(n == 1 for w, n in counts.items() if w not in cwe.outputs)
    fwe = data.make_sample("fwe", tokenizer, 1024, 0)
    words = collections.Counter(fwe.input.split("coded words. ")[1].split("\nQuestion")[0].split())
    top = [w for w, _ in words.most_common() if w != "..."][:3]
    assert fwe.outputs == top and words.most_common(1)[0][0] == "..."
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in fwe.outputs)


def test_qa_from_ruler_files(tokenizer, tmp_path):
    paragraphs = [
        dict(
            context=f"Paragraph {i} says the code word is w{i}.",
            qas=[dict(question=f"What is code word {i}?", answers=[dict(text=f"w{i}")], is_impossible=False)],
        )
        for i in range(40)
    ]
    (tmp_path / "squad.json").write_text(
        json.dumps(dict(data=[dict(paragraphs=paragraphs[:20]), dict(paragraphs=paragraphs[20:])]))
    )
    sample = data.make_sample("qa_1", tokenizer, 512, 5, qa_data=tmp_path)
    assert sample.outputs == ["w5"] and "Paragraph 5 says the code word is w5." in sample.input
    assert sample.input.endswith("Question: What is code word 5?") and sample.answer_prefix == " Answer:"
    assert 512 - 40 <= sample.length <= 512
    with pytest.raises(DataError, match="pass --qa-data"):
        data.make_sample("qa_2", tokenizer, 512, 0)
    with pytest.raises(DataError, match="no hotpotqa.json"):
        data.make_sample("qa_2", tokenizer, 512, 0, qa_data=tmp_path)
    (tmp_path / "hotpotqa.json").write_text("<html>a download that failed</html>")  # a JSONDecodeError before
    with pytest.raises(DataError, match="hotpotqa.json is not JSON .*download_qa_dataset.sh"):
        data.make_sample("qa_2", tokenizer, 512, 0, qa_data=tmp_path)
    (tmp_path / "hotpotqa.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(DataError, match=r"hotpotqa.json is not UTF-8 text \(invalid start byte at byte 0\)"):
        data.make_sample("qa_2", tokenizer, 512, 0, qa_data=tmp_path)
    tasks, notes = ruler.check_tasks(None, None)
    assert tasks == SYNTHETIC and "qa_1, qa_2" in notes[0] and "--qa-data" in notes[0]


def test_generation_errors(tokenizer):
    with pytest.raises(DataError, match="unknown RULER task"):
        data.make_sample("niah", tokenizer, 512, 0)
    with pytest.raises(DataError, match="no room"):
        data.make_sample("niah_single_1", tokenizer, 100, 0)
    with pytest.raises(DataError, match="does not fit"):
        data.make_sample("cwe", tokenizer, 200, 0)


# --- end to end ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_end_to_end(tokenizer, tmp_path, monkeypatch):
    model = Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2), tokenizer, "tiny")
    pattern = Pattern(np.random.default_rng(0).random((CONFIG.num_layers, CONFIG.num_kv_heads)))
    settings = samples.Settings(pattern=pattern, sink=4, recent=16, chunk_size=64)
    kwargs = dict(
        lengths=[320],
        samples=1,
        kv_budgets=[0.5],
        settings=settings,
        tasks=["niah_single_1", "qa_1"],
        out_dir=tmp_path,
        progress=False,
    )
    results = ruler.run_ruler(model, ["full", "duo"], **kwargs)
    assert results["tasks"] == ["niah_single_1"] and "qa_1" in results["notes"][0]
    assert list(results["runs"]) == ["full", "duo@0.5"]
    for run in results["runs"].values():
        assert set(run["scores"]) == {"niah_single_1"} and 0 <= run["average"][320] <= 100
        record = run["predictions"]["niah_single_1_320"][0]
        assert isinstance(record["pred"], str) and record["score"] in (0.0, 1.0)
    assert all(p["length"] <= 320 for v in results["prompts"].values() for p in v)
    assert (tmp_path / "ruler_budget.png").stat().st_size > 1000
    assert "Note: skipped" in (tmp_path / "ruler.md").read_text()
    calls = []
    monkeypatch.setattr(samples, "generate_sample", lambda *a: calls.append(a) or {})
    ruler.run_ruler(model, ["full", "duo"], **kwargs)  # everything is stored: nothing is generated again
    assert calls == []


# --- merging runs -------------------------------------------------------------------------------------------


def _part(lengths, runs, *, samples=2, sink=64, pattern="a1b2"):
    """A ruler.json as `run_ruler` writes it (read back from JSON: per-length keys are strings), tasks a and b;
    runs {name: (mode, budget, {length: (score a, score b)})}; each prediction took 1 s for 500 prompt tokens."""
    part = dict(
        model="tiny", dtype="float32", tasks=["a", "b"], seed=42, chat=True, haystack="h", sparsity=0.5,
        pattern=pattern, scores=None, sink=sink, recent=256, chunk_size=256, kv_dtype=None, notes=[], lengths=lengths,
        prompts={f"{t}_{n}": [dict(length=n, outputs=[str(i)]) for i in range(samples)] for t in "ab" for n in lengths},
        runs={},
    )  # fmt: skip
    for name, (mode, budget, scores) in runs.items():
        record = dict(prompt_tokens=500, prefill_s=0.75, decode_s=0.25)
        part["runs"][name] = dict(
            mode=mode, kv_budget=budget, decode_last=0, protocol="prefill",
            scores={t: {n: scores[n][i] for n in lengths} for i, t in enumerate("ab")},
            average={n: sum(scores[n]) / 2 for n in lengths},
            predictions={f"{t}_{n}": [record] * samples for t in "ab" for n in lengths},
        )  # fmt: skip
    return json.loads(json.dumps(part))


def test_merge_results_reads_a_grid_run_in_pieces():
    one_k = _part([1024], {"full": ("full", None, {1024: (100, 50)}), "duo@0.5": ("duo", 0.5, {1024: (80, 40)})})
    two_k = _part([2048], {"duo@0.5": ("duo", 0.5, {2048: (60, 20)})}, samples=3)
    two_k["duo_budget"] = "fitted"  # recorded since; a piece from before ran the same rule
    snap = _part([1024], {"snapkv@0.25": ("snapkv", 0.25, {1024: (10, 0)})})
    merged = ruler.merge_results([("1k.json", one_k), ("2k.json", two_k), ("snap.json", snap)])
    assert merged["lengths"] == [1024, 2048] and merged["samples"] == {1024: 2, 2048: 3}
    assert list(merged["runs"]) == ["full", "snapkv@0.25", "duo@0.5"]  # full, then by budget
    duo, full = merged["runs"]["duo@0.5"], merged["runs"]["full"]
    assert duo["average"] == {1024: 60, 2048: 40} and duo["overall"] == 50
    assert duo["scores"] == {"a": {1024: 80, 2048: 60}, "b": {1024: 40, 2048: 20}}
    assert full["average"] == {1024: 75, 2048: None} and full["overall"] is None
    assert duo["s_per_1k_tokens"] == pytest.approx(2.0) and "predictions" not in duo
    assert merged["sources"] == ["1k.json", "2k.json", "snap.json"]
    text = ruler.tables(merged)
    assert "| full " in text and "Samples per task at each length: 1024: 2, 2048: 3" in text
    assert not re.search(r"\| full +\| 2048", text)  # no row for a length the run lacks


def test_merge_results_refuses_what_is_not_comparable():
    one_k = _part([1024], {"full": ("full", None, {1024: (100, 50)}), "duo@0.5": ("duo", 0.5, {1024: (1, 1)})})
    cases = [
        (_part([2048], {"x": ("duo", 0.5, {2048: (1, 2)})}, sink=4), "sink=4"),
        (_part([2048], {"x": ("duo", 0.5, {2048: (1, 2)})}, pattern="ffff"), "pattern='ffff'"),  # merged before
        ({k: v for k, v in _part([2048], {}).items() if k != "pattern"}, "pattern=.not recorded: a result from an"),
        (_part([1024], {"full": ("full", None, {1024: (100, 50)})}), "full at 1024 tokens is in both"),
        (_part([1024], {"x": ("duo", 0.5, {1024: (1, 2)})}, samples=3), "different prompts for a_1024"),
        (_part([2048], {"snapkv@128": ("snapkv", 128, {2048: (1, 2)})}), "other.json: KV budgets 0.5, 128 mix"),
        (dict(_part([2048], {}), duo_budget="heads"), "duo_budget='heads', 1k.json with 'fitted'"),
    ]
    changed = _part([2048], {"duo@0.5": ("duo", 0.5, {2048: (1, 2)})})
    changed["runs"]["duo@0.5"]["protocol"] = "prefill in one chunk"  # a run of the same name, run otherwise
    cases.append((changed, "other.json ran duo@0.5 as 'prefill in one chunk', an earlier file as 'prefill'"))
    for other, message in cases:
        with pytest.raises(DuoJaxError, match=message):
            ruler.merge_results([("1k.json", one_k), ("other.json", other)])
    with pytest.raises(DuoJaxError, match="nothing to merge"):
        ruler.merge_results([])
    # files of another form: AttributeError / TypeError tracebacks before
    for other, message in [
        ([1, 2], "holds a list, not an object"),
        (dict(one_k, runs="x"), "its 'runs' is str, not an object"),
        (dict(one_k, lengths=None), "its 'lengths' is NoneType, not list"),
        (dict(one_k, lengths=["long"]), "its 'lengths' are not token counts"),
        (dict(one_k, runs={"full": {"scores": {}}}), "its run 'full' lacks the 'scores' and 'average'"),
    ]:
        with pytest.raises(DuoJaxError, match=f"other.json is not a ruler.json .*{message}"):
            ruler.merge_results([("1k.json", one_k), ("other.json", other)])


def test_ruler_merge_cli(tmp_path, capsys):
    from duo_jax.eval.__main__ import main as eval_main

    files = []
    for n in (1024, 2048):
        files.append(tmp_path / f"{n}.json")
        files[-1].write_text(json.dumps(_part([n], {"duo@0.5": ("duo", 0.5, {n: (60, 20)})})))
    assert eval_main(["ruler-merge", *map(str, files), "--out", str(tmp_path / "merged")]) == 0
    written = json.loads((tmp_path / "merged" / "ruler.json").read_text())
    assert written["runs"]["duo@0.5"]["average"] == {"1024": 40, "2048": 40}
    assert (tmp_path / "merged" / "ruler_budget.png").stat().st_size > 1000
    assert "| duo@0.5" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert eval_main(["ruler-merge", str(tmp_path / "bad.json")]) == 2
    assert "bad.json is not a ruler.json of " in capsys.readouterr().err  # its 'runs' is missing
    # the merged file has no predictions: writing it over a part would lose the part's (it was overwritten)
    piece = tmp_path / "piece"
    piece.mkdir()
    (piece / "ruler.json").write_text(files[0].read_text())
    assert eval_main(["ruler-merge", str(piece / "ruler.json"), str(files[1]), "--out", str(piece)]) == 2
    assert "would write over" in capsys.readouterr().err and "predictions" in (piece / "ruler.json").read_text()
    assert eval_main(["ruler-merge", *map(str, files), "--out", str(tmp_path / "bad.json")]) == 2  # a traceback
    assert "is a file, not a folder" in capsys.readouterr().err


def test_cli_rejects_bad_options(capsys):
    from duo_jax.eval.__main__ import main as eval_main

    for argv, message in [
        (["ruler", "--decode-last", "-1"], "--decode-last"),
        (["ruler", "--kv-budget", "0.25", "0"], "--kv-budget: a KV budget is a fraction"),
    ]:
        with pytest.raises(SystemExit):
            eval_main(argv)
        assert message in capsys.readouterr().err


def test_a_task_that_cannot_fit_a_length_fails_before_any_generation(tokenizer, tmp_path, monkeypatch):
    """It failed after the other tasks' samples were generated, without naming the task."""
    model = Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2), tokenizer, "tiny")
    monkeypatch.setattr(samples, "generate_sample", lambda *a: pytest.fail("generated before every prompt was made"))
    with pytest.raises(DataError, match="cwe at 320 tokens: the prompt does not fit"):
        ruler.run_ruler(
            model,
            ["full"],
            lengths=[320],
            samples=1,
            kv_budgets=None,
            settings=samples.Settings(),
            tasks=["niah_single_1", "cwe"],
            out_dir=tmp_path,
            progress=False,
        )

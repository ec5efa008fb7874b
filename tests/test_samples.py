"""The per-sample evaluations' loop (duo_jax.eval.samples): which runs share compiled steps across prompt lengths,
what a record reports of the cache, and the steps compiled ahead in threads, on a tiny random model."""

import jax
import numpy as np
import pytest

import duo_jax
from duo_jax import engine
from duo_jax.eval import samples
from duo_jax.loading import Model
from duo_jax.pattern import Pattern
from tests.conftest import tiny_config

CONFIG = tiny_config(vocab_size=2000, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model(tokenizer):
    return Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2), tokenizer, "tiny")


def compiled() -> int:
    return engine._compiled_extend.cache_info().misses + engine._compiled_decode.cache_info().misses


def generate_counting_compiles(model, run, prompts, settings):
    """(each prompt's record from `generate_sample` with 4 new tokens, the steps each compiled), in order."""
    records, compiles = [], []
    for prompt in prompts:
        before = compiled()
        records.append(samples.generate_sample(model, run, prompt, 4, settings))
        compiles.append(compiled() - before)
    return records, compiles


@pytest.mark.slow
def test_full_and_duo_share_compiled_steps_across_lengths(model):
    """Samples of 520 and 660 prompt tokens (own capacities 640 and 768, one capacity bucket, 768) compile once under
    full attention, duo at a budget (its sparsity fitted to each sample, the capacity only holding it), and streaming
    and streaming_llm at a budget (their windows, 260 and 330 tokens, runtime data in one ring of 384 slots). Each
    record gives the tokens and the cache bytes of a run at the sample's own capacity and window."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (520, 660)]
    pattern = Pattern(rng.random((CONFIG.num_layers, CONFIG.num_kv_heads)))
    settings = samples.Settings(pattern=pattern, sink=4, recent=16, chunk_size=128)
    for run in samples.make_runs(["full", "duo", "streaming", "streaming_llm"], [0.5]):
        records, compiles = generate_counting_compiles(model, run, prompts, settings)
        assert compiles[1] == 0, (run.name, compiles)
        for prompt, record in zip(prompts, records):
            mode = samples._mode(model, run, len(prompt), 4, settings)
            if run.mode in ("streaming", "streaming_llm"):
                assert samples.ring_bucket(mode, settings) == 384 and mode.sink + mode.recent == len(prompt) // 2
            own = duo_jax.generate(
                model, [prompt], max_new_tokens=4, context=len(prompt) + 4, chat=False, chunk_size=128,
                **mode.generate_kwargs(),
            )  # fmt: skip
            assert record["pred"] == model.tokenizer.decode(own.tokens[0]), run.name
            assert record["cache_bytes"] == own.stats["cache_bytes"] <= record["reserved_cache_bytes"], run.name
    assert records[0]["reserved_cache_bytes"] == records[1]["reserved_cache_bytes"] > records[0]["cache_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.25, 0.5, 64])
def test_snapkv_family_shares_compiled_steps_across_lengths(model, budget):
    """SnapKV, PyramidKV and HeadKV over prompts of 520 and 700 tokens (own capacities 640 and 768) run at the
    capacity bucket (768) with a room of 128 for the 4 new tokens, and at a quarter of each prompt (budgets 130 and
    175) their budgets are runtime data in the slots of a kv_budget of 256 (`budget_slots`): the second sample
    compiles nothing, under a fraction as under a budget in tokens. At half of each prompt (slots of 384) PyramidKV
    caps its bottom layer and HeadKV its strongest heads at the prompt, each at its own length (640 and 768 tokens
    held, rounded): the decode shapes follow the prompts' length bucket (both 768), and the second compiles nothing
    either (it compiled its own before). Each record gives the tokens of a generation with the budgets compiled in
    at the sample's own capacity, and the cache bytes of that compressed cache with the same room (the slots of the
    budget bucket reserve more; a budget in tokens keeps what it reserves)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (520, 700)]
    grid = (CONFIG.num_layers, CONFIG.num_kv_heads)
    settings = samples.Settings(scores=Pattern(rng.random(grid)), chunk_size=128)
    for run in samples.make_runs(["snapkv", "pyramidkv", "headkv"], [budget]):
        records, compiles = generate_counting_compiles(model, run, prompts, settings)
        assert compiles[0] > 0 and compiles[1] == 0, (run.name, compiles)
        for prompt, record in zip(prompts, records):
            mode = samples._mode(model, run, len(prompt), 4, settings)
            kwargs = samples._request(model, run, prompt, 4, settings)[1]
            assert kwargs["room"] == 128 and kwargs["context"] is None
            assert kwargs.get("budget_slots") == {0.25: 256, 0.5: 384}.get(budget)
            own = duo_jax.generate(
                model, [prompt], max_new_tokens=4, context=len(prompt) + 4, chat=False, chunk_size=128, room=128,
                **mode.generate_kwargs(),
            )  # fmt: skip
            assert record["pred"] == model.tokenizer.decode(own.tokens[0]), run.name
            assert record["cache_bytes"] == own.stats["cache_bytes"], run.name
            assert (record["cache_bytes"] < record["reserved_cache_bytes"]) == (budget < 1), run.name


@pytest.mark.slow
def test_a_snapkv_record_under_decode_last_counts_the_cache_it_decodes_with(model):
    """DuoAttention's LongBench runs every mode with the prompt's last tokens decoded one at a time: SnapKV compresses
    after the prefill of the rest, and its record's cache_bytes is that cache's (it was sized for the whole prompt,
    more than the run reserved)."""
    prompt = np.random.default_rng(6).integers(3, CONFIG.vocab_size, 140).tolist()  # 90 prefilled: 128 slots
    run = samples.make_runs(["snapkv"], [1.0], decode_last=50, every_mode=True)[0]
    record = samples.generate_sample(model, run, prompt, 4, samples.Settings(chunk_size=128))
    mode = samples._mode(model, run, len(prompt), 4, samples.Settings(chunk_size=128))
    own = duo_jax.generate(
        model, [prompt], max_new_tokens=4, context=len(prompt) + 4, chat=False, chunk_size=len(prompt), room=128,
        prompt_tail_steps=50, **mode.generate_kwargs(),
    )  # fmt: skip
    assert record["pred"] == model.tokenizer.decode(own.tokens[0])
    assert record["cache_bytes"] == own.stats["cache_bytes"] <= record["reserved_cache_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("mode, decode_last", [("h2o", 0), ("tova", 0), ("h2o", 50)])
def test_eviction_budgets_in_one_bucket_share_compiled_steps(model, mode, decode_last):
    """H2O and TOVA at a quarter of prompts of 520 and 600 tokens (budgets 130 and 150: runtime data in 256 slots,
    `budget_slots`; the prompt in one chunk padded to 768) compile once between them, with the prompt's last 50
    tokens decoded one at a time too. Each record gives the tokens and the cache bytes of a generation with the
    budget compiled in and a chunk of the prompt's own length."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (520, 600)]
    settings = samples.Settings(chunk_size=128)
    run = samples.make_runs([mode], [0.25], decode_last)[0]
    records, compiles = generate_counting_compiles(model, run, prompts, settings)
    assert compiles[0] > 0 and compiles[1] == 0, compiles
    for prompt, record in zip(prompts, records):
        m = samples._mode(model, run, len(prompt), 4, settings)
        assert samples.budget_bucket(m) == 256 and m.kv_budget == len(prompt) // 4
        # the paper's last 50: a chunk ending with the first of them (H2O scored from it on), then 49 steps
        assert dict(m.options).get("scores_from") == ("newest" if decode_last and mode == "h2o" else None)
        own = duo_jax.generate(
            model, [prompt], max_new_tokens=4, context=len(prompt) + 4, chat=False, chunk_size=len(prompt),
            prompt_tail_steps=49 if decode_last == 50 else 0, **m.generate_kwargs(),
        )  # fmt: skip
        assert record["pred"] == model.tokenizer.decode(own.tokens[0])
        assert record["cache_bytes"] == own.stats["cache_bytes"] < record["reserved_cache_bytes"]


@pytest.mark.slow
def test_infinigen_budgets_in_one_bucket_share_compiled_steps(model):
    """InfiniGen at a quarter of prompts of 520 and 600 tokens (budgets 130 and 150: runtime data fetching 256 rows,
    `budget_slots`) runs at the capacity bucket (768) and compiles once between them. Each record gives the tokens
    and the cache bytes of a generation with the budget compiled in at the sample's own capacity."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (520, 600)]
    settings = samples.Settings(chunk_size=128)
    run = samples.make_runs(["infinigen"], [0.25])[0]
    records, compiles = generate_counting_compiles(model, run, prompts, settings)
    assert compiles[0] > 0 and compiles[1] == 0, compiles
    for prompt, record in zip(prompts, records):
        m = samples._mode(model, run, len(prompt), 4, settings)
        kwargs = samples._request(model, run, prompt, 4, settings)[1]
        assert kwargs["budget_slots"] == 256 and kwargs["context"] is None and m.kv_budget == len(prompt) // 4
        own = duo_jax.generate(
            model, [prompt], max_new_tokens=4, context=len(prompt) + 4, chat=False, chunk_size=128,
            **m.generate_kwargs(),
        )  # fmt: skip
        assert record["pred"] == model.tokenizer.decode(own.tokens[0])
        assert record["cache_bytes"] == own.stats["cache_bytes"] < record["reserved_cache_bytes"]


def test_only_budgets_fitted_to_the_sample_take_buckets(model):
    """A quarter of the prompt (a budget fitted to the sample) runs h2o / tova in a budget bucket and ``streaming``
    in a ring bucket; a budget in tokens, the same for every sample, takes neither (it would only reserve memory)."""
    prompt = list(range(3, 603))
    settings = samples.Settings(pattern=Pattern(np.ones((CONFIG.num_layers, CONFIG.num_kv_heads))), sink=4, recent=16)
    for mode, option, fitted in [
        ("h2o", "budget_slots", 256),
        ("tova", "budget_slots", 256),
        ("infinigen", "budget_slots", 256),
        ("streaming", "ring_slots", 256),
    ]:
        for budget, slots in ((0.25, fitted), (64, None)):
            kwargs = samples._request(model, samples.make_runs([mode], [budget])[0], prompt, 4, settings)[1]
            assert kwargs.get(option) == slots, (mode, budget)
            assert "ring_slots" not in kwargs or "budget_slots" not in kwargs


def test_a_group_key_of_any_kind_and_a_missing_decode_last_are_handled():
    """The progress label took a key that is neither a task name nor a tuple as a tuple (an int key crashed the loop
    with progress off); make_runs compared decode_last=None, an unset CLI option, with 0 (a bare TypeError)."""
    assert [samples._group_label(k) for k in ("qa", ("qa", 4096), 7)] == ["qa", "qa @ 4096", "7"]
    for bad in (None, -1, 1.5, True):
        with pytest.raises(duo_jax.DuoJaxError, match="decode_last is a number of prompt tokens >= 0"):
            samples.make_runs(["full"], None, bad)
    assert type(samples.make_runs(["h2o"], [0.5], np.int64(3))[0].decode_last) is int  # a JSON number


def _loop(model, tmp_path, settings, group):
    runs = samples.make_runs(["duo", "streaming"], [0.5])
    samples.generate_missing(
        model,
        runs,
        {"task": group},
        settings,
        file=lambda run, key: tmp_path / run.name / f"{key}.jsonl",
        score=lambda key, record: 0.0,
        desc="test",
        progress=False,
    )
    return {run.name: samples.PredictionStore(tmp_path / run.name / "task.jsonl").records for run in runs}


def test_steps_compiled_ahead_change_no_output(model, tmp_path, monkeypatch):
    """With compile_ahead 2, the threads compile every sample after the first, once each, across runs, and the
    predictions are those of a loop that compiles nothing ahead (compile_ahead 0). A sample whose compile fails
    ahead (here: all of them) is generated all the same."""
    rng = np.random.default_rng(2)
    group = [
        samples.Sample(str(i), rng.integers(3, CONFIG.vocab_size, n).tolist(), 3) for i, n in enumerate((90, 200, 330))
    ]
    pattern = Pattern(rng.random((CONFIG.num_layers, CONFIG.num_kv_heads)))
    sent, compile_sample = [], samples.compile_sample
    monkeypatch.setattr(
        samples,
        "compile_sample",
        lambda m, run, ids, *a: sent.append((run.name, len(ids))) or compile_sample(m, run, ids, *a),
    )
    plain = _loop(
        model, tmp_path / "plain", samples.Settings(pattern=pattern, sink=4, recent=16, compile_ahead=0), group
    )
    assert sent == []  # 0: nothing compiled ahead

    settings = samples.Settings(pattern=pattern, sink=4, recent=16, compile_ahead=2)
    ahead = _loop(model, tmp_path / "ahead", settings, group)
    order = [(run, len(s.prompt_ids)) for run in ("duo@0.5", "streaming@0.5") for s in group]
    assert sorted(sent) == sorted(order[1:])  # the threads may finish in any order
    assert {k: {i: r["pred"] for i, r in v.items()} for k, v in ahead.items()} == {
        k: {i: r["pred"] for i, r in v.items()} for k, v in plain.items()
    }

    def broken(*args):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(samples, "compile_sample", broken)
    again = _loop(model, tmp_path / "broken", settings, group)
    assert {k: len(v) for k, v in again.items()} == {"duo@0.5": 3, "streaming@0.5": 3}
    with pytest.raises(duo_jax.DuoJaxError, match="compile_ahead is a number of samples >= 0"):
        _loop(model, tmp_path / "bad", samples.Settings(pattern=pattern, compile_ahead=-1), group)

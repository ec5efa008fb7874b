"""The evaluation harness (duo_jax.eval) on a tiny random model: scoring aggregation, the streaming mode's
budget matching, the NIAH / passkey loops end to end, and perplexity against an independent computation."""

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.cache import round_capacity
from duo_jax.data import CalibrationOverlapWarning
from duo_jax.eval import report
from duo_jax.eval.__main__ import main as eval_main
from duo_jax.eval.modes import (
    MODES,
    budget_tokens,
    check_kv_budgets,
    check_modes,
    fit_window,
    is_token_budget,
    mode_settings,
    num_retrieval_heads,
    streaming_budget,
    warn_if_calibrated_on,
)
from duo_jax.eval.niah import accuracy_table, aggregate, run_niah, score_matrix
from duo_jax.eval.passkey import passkey_depths, run_passkey
from duo_jax.eval.perplexity import bucket_edges, bucket_stats, evaluate_perplexity
from duo_jax.loading import Model
from duo_jax.pattern import Pattern
from tests.conftest import tiny_config

VOCAB = 2000  # the shared test tokenizer's (tests/conftest.py)
CONFIG = tiny_config(vocab_size=VOCAB, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model(tokenizer):
    params = duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2)
    return Model(CONFIG, params, tokenizer, "tiny")


@pytest.fixture(scope="module")
def pattern():
    return Pattern(np.random.default_rng(0).random((CONFIG.num_layers, CONFIG.num_kv_heads)))


def _layout_bytes(settings, config, context):
    return settings.build(config, context).expected_cache_bytes(1, 4)


# --- scoring aggregation ---------------------------------------------------------------------------------


def test_aggregate_and_score_matrix():
    cells = [
        dict(length=100, depth=0.0, correct=True, score=1.0),
        dict(length=100, depth=1.0, correct=False, score=0.25),
        dict(length=200, depth=0.0, correct=True, score=0.75),
        dict(length=200, depth=0.0, correct=False, score=0.25),
    ]  # the same cell twice: averaged
    assert aggregate(cells) == 0.5
    assert aggregate(cells, "length") == {100: 0.5, 200: 0.5}
    assert aggregate(cells, "depth") == {0.0: 2 / 3, 1.0: 0.0}
    assert np.isnan(aggregate([]))
    matrix = score_matrix(cells, [100, 200], [0.0, 1.0])  # [depths, lengths]
    np.testing.assert_allclose(matrix, [[1.0, 0.5], [0.25, np.nan]])
    np.testing.assert_allclose(score_matrix(cells, [100, 200], [0.0, 1.0], "correct"), [[1.0, 0.5], [0.0, np.nan]])


def test_passkey_depths():
    assert passkey_depths(1) == [0.5]
    assert passkey_depths(3) == [0.0, 0.5, 1.0]
    with pytest.raises(duo_jax.DuoJaxError):
        passkey_depths(0)


# --- the modes and the streaming budget -------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        tiny_config(num_layers=5, num_kv_heads=3, num_heads=6),
        duo_jax.get_config("smollm2-135m"),
        duo_jax.get_config("llama3-8b"),
    ],
    ids=["tiny", "odd", "smollm2", "llama3"],
)
@pytest.mark.parametrize("sparsity", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("context", [300, 1000, 4096])
def test_streaming_budget_matches_duo_bytes(config, sparsity, context):
    sink, recent = 4, 60
    gates = Pattern(np.random.default_rng(1).random((config.num_layers, config.num_kv_heads)))
    duo = mode_settings("duo", config, gates, sparsity=sparsity, sink=sink, recent=recent, context=context)
    streaming = mode_settings("streaming", config, gates, sparsity=sparsity, sink=sink, recent=recent, context=context)
    assert streaming.sink == sink and streaming.retrieval_mask().sum() == 0
    heads = config.num_layers * config.num_kv_heads
    r = num_retrieval_heads(config, sparsity) / heads
    capacity = round_capacity(context)
    # The documented formula: per head, r * C + (1 - r) * (sink + recent), rounded down to a token.
    budget = r * capacity + (1 - r) * (sink + recent)
    assert streaming.sink + streaming.recent == streaming_budget(config, sparsity, context, sink=sink, recent=recent)
    assert budget - 1 < streaming.sink + streaming.recent <= budget + 1e-9
    duo_bytes = _layout_bytes(duo, config, context)
    streaming_bytes = _layout_bytes(streaming, config, context)
    slot_bytes = 2 * config.head_dim * 4  # one token of one head, K and V, fp32
    assert 0 <= duo_bytes - streaming_bytes < heads * slot_bytes
    retrieval = num_retrieval_heads(config, sparsity)
    if (retrieval * capacity + (heads - retrieval) * (sink + recent)) % heads == 0:
        assert duo_bytes == streaming_bytes


def test_smollm2_budget_is_exact():
    config = duo_jax.get_config("smollm2-135m")
    for context in (1024 + 32, 2048 + 32, 4096 + 32):
        duo = mode_settings("duo", config, Pattern.full(30, 3), sparsity=0.5, sink=64, recent=256, context=context)
        streaming = mode_settings("streaming", config, None, sparsity=0.5, sink=64, recent=256, context=context)
        assert _layout_bytes(duo, config, context) == _layout_bytes(streaming, config, context)
        assert streaming.sink + streaming.recent == (round_capacity(context) + 320) // 2


def test_mode_errors(pattern):
    with pytest.raises(duo_jax.DuoJaxError, match="needs a head pattern"):
        mode_settings("duo", CONFIG, None, sparsity=0.5, sink=4, recent=8, context=100)
    with pytest.raises(duo_jax.DuoJaxError, match="unknown mode"):
        check_modes(["full", "h2o2"])
    with pytest.raises(duo_jax.PatternError):
        mode_settings("duo", CONFIG, Pattern.full(3, 2), sparsity=0.5, sink=4, recent=8, context=100)
    assert check_modes(["duo", "full", "duo"]) == ["duo", "full"]
    full = mode_settings("full", CONFIG, pattern, sparsity=0.5, sink=4, recent=8, context=100)
    assert full.retrieval_mask() is None and full.generate_kwargs() == {"method": "full"}


def test_kv_budget_fraction_and_duo_window():
    assert budget_tokens(None, 1000) is None and budget_tokens(0.25, 1000) == 250
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(duo_jax.DuoJaxError, match="fraction"):
            budget_tokens(bad, 1000)
    assert fit_window(1024, 64, 256) == (64, 256)  # fits in half the budget: unchanged
    assert fit_window(256, 64, 256) == (25, 102)  # scaled to half of 256
    # A budget too small for any retrieval head at half of it (40 tokens of 4,096: 0.4 of SmolLM2's 90 heads):
    # every head streams with the whole budget, where it kept half (duo's cache was half the others')
    config = duo_jax.get_config("smollm2-135m")
    duo = mode_settings(
        "duo", config, Pattern.full(30, 3), sparsity=0.5, sink=64, recent=256, context=4128, kv_budget=40
    )
    assert (duo.sink, duo.recent, duo.sparsity) == (8, 32, 1.0)


def test_kv_budget_in_tokens(monkeypatch):
    """A budget above 1 is a number of tokens per KV head, the same for every prompt (the KV size of the SnapKV /
    PyramidKV / HeadKV papers): whole numbers >= 2 only, never mixed with fractions in one evaluation, drawn on a
    token axis."""
    from duo_jax.eval import samples

    assert budget_tokens(128, 1000) == budget_tokens(128.0, 50) == 128 and budget_tokens(2, 10) == 2
    assert is_token_budget(128.0) and not is_token_budget(1.0) and not is_token_budget(None)
    for bad in (1.5, 2.5, -3, 0):
        with pytest.raises(duo_jax.DuoJaxError, match="fraction in \\(0, 1\\] of the evaluated tokens or a whole"):
            budget_tokens(bad, 1000)
    check_kv_budgets([None, 64, 128.0])
    with pytest.raises(duo_jax.DuoJaxError, match="0.25, 128 mix fractions of the prompt with token counts"):
        check_kv_budgets([0.25, 128])
    assert [r.name for r in samples.make_runs(["full", "snapkv"], [64.0, 1024])] == ["full", "snapkv@64", "snapkv@1024"]
    drawn = []
    monkeypatch.setattr(report, "_save", lambda figure, path: drawn.append(figure))
    cases = (([64, 256], "KV budget (tokens per KV head)", "log"), ([0.25], "KV budget (%)", "linear"))
    for budgets, label, scale in cases:
        report.budget_panels("unused.png", budgets, {"task": ({"snapkv": [1.0] * len(budgets)}, {})}, title="t")
        axes = drawn[-1].axes[0]
        assert axes.get_xlabel() == label and axes.get_xscale() == scale
        assert list(axes.lines[0].get_xdata()) == (budgets if scale == "log" else [25.0])


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_duo_and_duo_headkv_meet_the_budget(fraction):
    """With --kv-budget, duo's and duo_headkv's caches hold the budget: N * budget token slots, up to one
    retrieval head's worth (duo rounds to whole heads) and the rounding of the retrieval heads' budgets."""
    config = duo_jax.get_config("smollm2-135m")
    gates = Pattern(np.random.default_rng(1).random((config.num_layers, config.num_kv_heads)))
    length = 4096
    budget = budget_tokens(fraction, length)
    context = length + 32
    heads, capacity = config.num_layers * config.num_kv_heads, round_capacity(context)
    slot_bytes = 2 * config.head_dim * 4  # one token of one head, K and V, fp32
    duo = mode_settings("duo", config, gates, sparsity=0.5, sink=64, recent=256, context=context, kv_budget=budget)
    assert duo.kv_budget == budget and duo.sink + duo.recent <= budget // 2
    duo_slots = _layout_bytes(duo, config, context) / slot_bytes
    assert abs(duo_slots - heads * budget) <= capacity - (duo.sink + duo.recent)
    scores = Pattern(np.random.default_rng(2).random((config.num_layers, config.num_kv_heads)))
    composed = mode_settings(
        "duo_headkv", config, gates, sparsity=0.5, sink=64, recent=256, context=context, kv_budget=budget, scores=scores
    )
    retrieval = num_retrieval_heads(config, 0.5)
    per_head = dict(composed.options)["kv_budget"]
    window = composed.sink + composed.recent
    assert window == duo.sink + duo.recent  # the same fitted window
    assert heads * budget - retrieval < retrieval * per_head + (heads - retrieval) * window <= heads * budget


def test_every_mode_needs_what_it_uses():
    with pytest.raises(duo_jax.DuoJaxError, match="head scores"):
        mode_settings("headkv", CONFIG, None, sparsity=0.5, sink=4, recent=8, context=100, kv_budget=20)
    infinigen = mode_settings("infinigen", CONFIG, None, sparsity=0.5, sink=4, recent=8, context=100, kv_budget=20)
    assert infinigen.generate_kwargs() == {"method": "infinigen", "kv_budget": 20}  # it calibrates when built
    with pytest.raises(duo_jax.DuoJaxError, match="cannot meet"):
        mode_settings(
            "duo_headkv",
            CONFIG,
            Pattern.full(2, 2),
            sparsity=1.0,
            sink=4,
            recent=8,
            context=100,
            kv_budget=40,
            scores=Pattern.full(2, 2),
        )  # no retrieval head to hold the rest


# --- the evaluation loops ----------------------------------------------------------------------------------


def test_calibration_overlap_warnings():
    grid = np.full((CONFIG.num_layers, CONFIG.num_kv_heads), 0.5)
    trained = Pattern(grid, {"dataset_name": "paul_graham"})  # the shipped SmolLM2 pattern's text: all essays
    scores = Pattern(grid, {"haystack": "paul_graham:calibration"})
    with pytest.warns(CalibrationOverlapWarning, match="DuoAttention pattern was calibrated on 'paul_graham'"):
        found = warn_if_calibrated_on("paul_graham:evaluation", ["full", "duo", "headkv"], trained, scores)
    assert len(found) == 1  # the scores are held out, the pattern is not
    with pytest.warns(CalibrationOverlapWarning) as caught:
        found = warn_if_calibrated_on("paul_graham:calibration", ["duo_headkv", "infinigen"], trained, scores)
    assert len(found) == len(caught) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: held-out text, or inputs the modes do not use
        assert warn_if_calibrated_on("paul_graham:evaluation", ["headkv", "infinigen"], trained, scores) == []
        assert warn_if_calibrated_on("paul_graham", ["full", "h2o"], trained, scores) == []
        assert warn_if_calibrated_on("austen", ["duo"], Pattern(grid), None) == []  # no recorded text


@pytest.mark.slow
def test_niah_end_to_end(model, pattern, tmp_path):
    results = run_niah(
        model,
        ["full", "duo", "streaming"],
        pattern=pattern,
        lengths=[256, 200],
        depths=[1.0, 0.0],
        sink=4,
        recent=16,
        max_new_tokens=6,
        chunk_size=64,
        out_dir=tmp_path,
        progress=False,
    )
    assert results["haystack"] == "paul_graham:evaluation" and results["calibration_overlap"] == []
    assert results["lengths"] == [200, 256] and results["depths"] == [0.0, 1.0]
    for mode, r in results["modes"].items():
        assert len(r["cells"]) == 4
        assert 0.0 <= r["accuracy"] <= 1.0
        assert all(0.0 <= c["score"] <= 1.0 and isinstance(c["generated"], str) for c in r["cells"])
        assert set(r["accuracy_by_length"]) == {200, 256}
        assert (tmp_path / f"niah_{mode}.png").stat().st_size > 1000
    assert (tmp_path / "niah_modes.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "niah.json").read_text())
    assert saved["task"] == "niah" and set(saved["modes"]) == {"full", "duo", "streaming"}
    # The caches generate allocated: streaming holds exactly duo's bytes (the budget matching), full more.
    assert saved["modes"]["duo"]["cache_bytes"]["256"] == saved["modes"]["streaming"]["cache_bytes"]["256"]
    assert saved["modes"]["duo"]["cache_bytes"]["256"] < saved["modes"]["full"]["cache_bytes"]["256"]
    assert str(tmp_path / "niah.json") in saved["files"]
    assert "acc @ 200" in accuracy_table(results, [200, 256])


@pytest.mark.slow
def test_niah_duoattention_protocol(model, pattern, tmp_path):
    """DuoAttention's NIAH: every essay, whole, as the haystack, its prompts (at most the length), 51 new tokens,
    visualize.py's score per cell, a cell correct at half of it or more, the heat maps of the score."""
    from duo_jax.data import niah_duoattention

    results = run_niah(
        model, ["full", "duo"], pattern=pattern, lengths=[320], depths=[0.0, 0.5, 1.0], sink=4, recent=16,
        chunk_size=64, protocol="duoattention", out_dir=tmp_path, progress=False,
    )  # fmt: skip
    assert results["protocol"] == "duoattention" and results["haystack"] == "paul_graham"
    assert results["max_new_tokens"] == niah_duoattention.MAX_NEW_TOKENS == 51
    for r in results["modes"].values():
        for cell in r["cells"]:
            assert cell["score"] == niah_duoattention.score(cell["generated"])
            assert cell["correct"] == (cell["score"] >= 0.5) and cell["answer"] == niah_duoattention.ANSWER
    assert (tmp_path / "niah_duo.png").stat().st_size > 1000
    with pytest.raises(duo_jax.DuoJaxError, match="unknown NIAH protocol"):
        run_niah(model, ["full"], pattern=pattern, lengths=[320], protocol="gkamradt")


@pytest.mark.slow
def test_niah_decode_last_runs_the_papers_baselines(model, pattern):
    """--decode-last 5: h2o's cell is the generation of an exact prefill of all but the last 5 tokens whose first
    query starts the eviction and H2O's scores (one chunk ending with it, then 4 steps); full attention unchanged."""
    from duo_jax.data.haystack import EVALUATION_HAYSTACK, haystack_tokens
    from duo_jax.data.niah import make_needle_prompt

    kwargs = dict(pattern=pattern, lengths=[128], depths=[0.5], sink=4, recent=16, max_new_tokens=3, progress=False)
    results = run_niah(model, ["full", "h2o"], kv_budget=0.25, decode_last=5, **kwargs)
    assert results["decode_last"] == 5
    hay = haystack_tokens(model.tokenizer, EVALUATION_HAYSTACK, 128)
    ids = make_needle_prompt(model.tokenizer, hay, 128, 0.5).tokens.tolist()
    common = dict(max_new_tokens=3, context=131, chat=False)
    own = duo_jax.generate(
        model, [ids], method="h2o", kv_budget=32, scores_from="newest", chunk_size=128, prompt_tail_steps=4, **common
    )
    assert results["modes"]["h2o"]["cells"][0]["generated"] == own.text[0]
    assert results["modes"]["full"]["cells"][0]["generated"] == duo_jax.generate(model, [ids], **common).text[0]
    with pytest.raises(duo_jax.DuoJaxError, match="decode_last is a number of prompt tokens >= 0"):
        run_niah(model, ["h2o"], kv_budget=0.25, decode_last=-1, **kwargs)


@pytest.mark.slow
def test_niah_every_mode_at_a_budget(model, pattern, tmp_path):
    scores = Pattern(np.random.default_rng(3).random((CONFIG.num_layers, CONFIG.num_kv_heads)))
    results = run_niah(
        model,
        MODES,
        pattern=pattern,
        scores=scores,
        kv_budget=0.5,
        lengths=[128],
        depths=[0.5],
        sink=4,
        recent=16,
        max_new_tokens=3,
        chunk_size=32,
        out_dir=tmp_path,
        progress=False,
    )
    assert list(results["modes"]) == list(MODES) and results["kv_budget"] == 0.5
    full_bytes = results["modes"]["full"]["cache_bytes"][128]
    for mode, r in results["modes"].items():
        assert len(r["cells"]) == 1 and (tmp_path / f"niah_{mode}.png").is_file()
        assert r["settings"][128]["kv_budget"] == (None if mode == "full" else 64)
        if mode not in ("full", "infinigen"):  # InfiniGen keeps the full cache (in host memory where it can)
            assert r["cache_bytes"][128] < full_bytes, mode


@pytest.mark.slow
def test_evaluations_with_a_quantized_kv_cache(model, pattern, monkeypatch):
    """kv_dtype (the CLI's --kv-dtype): each mode's cache quantized, in exactly the bytes of int8 codes + one
    bf16 scale per token and head; full attention's perplexity through an int8 cache moves a little from the
    dense forward pass's (independent), not much; a mode whose method has no quantized cache (every method has one
    now: infinigen's capability is taken away here) is refused before anything runs."""
    E = CONFIG.head_dim
    for mode in ("full", "duo", "streaming"):
        settings = mode_settings(mode, CONFIG, pattern, sparsity=0.5, sink=4, recent=16, context=131, kv_dtype="int8")
        assert settings.describe()["kv_dtype"] == "int8"
        plain = mode_settings(mode, CONFIG, pattern, sparsity=0.5, sink=4, recent=16, context=131)
        slots = plain.build(CONFIG, 131).expected_cache_bytes(1, 4) // (2 * E * 4)  # fp32: 2 E 4 bytes per slot
        assert settings.build(CONFIG, 131).expected_cache_bytes(1, 4) == 2 * slots * (E + 2), mode
    # (the generation loop of NIAH / passkey with kv_dtype: `test_passkey_end_to_end`)
    tokens = np.random.default_rng(5).integers(0, VOCAB, (1, 96)).astype(np.int32)
    kwargs = dict(pattern=None, chunk_size=32, edges=[0, 64, 96], prefix=64, progress=False)
    int8 = evaluate_perplexity(model, tokens, ["full"], kv_dtype="int8", **kwargs)["modes"]["full"]
    logits = np.asarray(duo_jax.forward(model.params, CONFIG, jnp.asarray(tokens)), np.float64)[:, :-1]
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, tokens[:, 1:, None].astype(int), axis=-1)[0, 63:, 0].mean()
    assert 1e-5 < abs(int8["decoded_nll"] - nll) < 0.01 * nll  # measured: 2e-3 of 9.14
    # The cache it filled, measured: one sequence's int8 codes + scales at capacity 128, vs float32's.
    assert int8["cache_bytes"] == 2 * CONFIG.num_layers * CONFIG.num_kv_heads * 128 * (E + 2)
    assert int8["full_cache_bytes"] == 128 * CONFIG.kv_bytes_per_token(4)
    from duo_jax.methods import entry, registry

    monkeypatch.setitem(registry._ENTRIES, "infinigen", dataclasses.replace(entry("infinigen"), quantized_kv=False))
    with pytest.raises(duo_jax.DuoJaxError, match="infinigen have no quantized KV cache"):
        evaluate_perplexity(model, tokens, ["full", "infinigen"], kv_dtype="int4", **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["streaming_llm", "h2o", "tova", "snapkv"])
def test_perplexity_with_prefix_equals_full_when_the_budget_covers_all(model, mode):
    """Prefill a prefix, decode the rest token by token: full attention matches the dense forward pass
    (independent), and a method whose budget covers the whole window matches full; at a quarter it differs."""
    tokens = np.random.default_rng(4).integers(0, VOCAB, (1, 144)).astype(np.int32)  # 1/4: snapkv's window 32
    kwargs = dict(pattern=None, sink=4, recent=8, chunk_size=32, edges=[0, 112, 144], prefix=112, progress=False)
    covered = evaluate_perplexity(model, tokens, ["full", mode], kv_budget=1.0, **kwargs)["modes"]
    logits = np.asarray(duo_jax.forward(model.params, CONFIG, jnp.asarray(tokens)), np.float64)[:, :-1]
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, tokens[:, 1:, None].astype(int), axis=-1)[..., 0]
    assert abs(covered["full"]["decoded_nll"] - nll[:, 111:].mean()) < 1e-4
    assert abs(covered["full"]["nll"] - nll.mean()) < 1e-4
    assert abs(covered[mode]["decoded_nll"] - covered["full"]["decoded_nll"]) < 1e-4
    quarter = evaluate_perplexity(model, tokens, [mode], kv_budget=0.25, **kwargs)["modes"][mode]
    assert abs(quarter["decoded_nll"] - covered["full"]["decoded_nll"]) > 1e-3


@pytest.mark.slow
def test_perplexity_with_a_streaming_chunk_scores_as_its_chunk_size(model, pattern):
    """--streaming-chunk: duo and streaming at chunks of 48 with streaming_chunk=16 give the NLL of chunks of 16 (and
    record it); without it, chunks of 48 give another."""
    tokens = np.random.default_rng(6).integers(0, VOCAB, (1, 96)).astype(np.int32)
    kwargs = dict(pattern=pattern, sparsity=0.5, sink=2, recent=6, edges=[0, 48, 96], progress=False)
    modes = ["duo", "streaming"]
    sixteens = evaluate_perplexity(model, tokens, modes, chunk_size=16, **kwargs)["modes"]
    streamed = evaluate_perplexity(model, tokens, modes, chunk_size=48, streaming_chunk=16, **kwargs)
    whole = evaluate_perplexity(model, tokens, modes, chunk_size=48, **kwargs)["modes"]
    assert [streamed["modes"][m]["settings"]["streaming_chunk"] for m in modes] == [16, 16]
    for mode in modes:
        assert abs(streamed["modes"][mode]["nll"] - sixteens[mode]["nll"]) < 1e-5, mode
        assert abs(whole[mode]["nll"] - sixteens[mode]["nll"]) > 1e-3, mode


@pytest.mark.slow
def test_passkey_end_to_end(model, tmp_path):
    """With an int8 KV cache (the grid loop NIAH shares; `test_niah_end_to_end` runs it unquantized)."""
    results = run_passkey(
        model,
        ["full", "streaming"],
        pattern=None,
        lengths=[200],
        depths_per_length=2,
        sink=4,
        recent=16,
        max_new_tokens=4,
        chunk_size=64,
        batch_size=1,
        out_dir=tmp_path,
        kv_dtype="int8",
        progress=False,
    )
    assert results["kv_dtype"] == "int8" and results["modes"]["streaming"]["settings"][200]["kv_dtype"] == "int8"
    L, K, E = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim  # int8: E codes + a 2-byte scale per slot
    assert results["modes"]["full"]["cache_bytes"][200] == 2 * L * K * 256 * (E + 2)  # capacity: 204 -> 256
    cells = results["modes"]["full"]["cells"]
    assert [c["depth"] for c in cells] == [0.0, 1.0] and all(c["answer"].isdigit() for c in cells)
    assert [c["answer"] for c in cells] == [c["answer"] for c in results["modes"]["streaming"]["cells"]]
    assert 0.0 <= results["modes"]["streaming"]["accuracy"] <= 1.0
    for name in ("passkey.json", "passkey_accuracy.png", "passkey_full.png", "passkey_modes.png"):
        assert (tmp_path / name).is_file()


# --- perplexity -------------------------------------------------------------------------------------------------


def test_bucket_edges_and_stats():
    assert bucket_edges(4096) == [0, 512, 1024, 2048, 4096]
    assert bucket_edges(3000) == [0, 512, 1024, 2048, 3000]
    assert bucket_edges(100, first=32) == [0, 32, 64, 100]
    nll = np.arange(2 * 9, dtype=float).reshape(2, 9)  # positions 1..9
    stats = bucket_stats(nll, [0, 4, 10])
    assert [s["tokens"] for s in stats] == [6, 12]
    assert stats[0]["nll"] == pytest.approx(np.mean([0, 1, 2, 9, 10, 11]))
    assert stats[1]["ppl"] == pytest.approx(np.exp(np.mean(nll[:, 3:])))


@pytest.mark.slow
def test_perplexity_full_matches_forward(model, pattern):
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 100)).astype(np.int32)
    edges = [0, 32, 64, 100]
    results = evaluate_perplexity(
        model,
        tokens,
        ["full", "duo", "streaming"],
        pattern=pattern,
        sink=4,
        recent=8,
        chunk_size=24,
        edges=edges,
        progress=False,
    )
    # Independently: the dense model's logits, log-softmax in numpy (float64), NLL of each next token.
    logits = np.asarray(duo_jax.forward(model.params, CONFIG, jnp.asarray(tokens)), np.float64)[:, :-1]
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, tokens[:, 1:, None].astype(int), axis=-1)[..., 0]  # token p at p - 1
    full = results["modes"]["full"]
    for bucket, (a, b) in zip(full["buckets"], zip(edges[:-1], edges[1:])):
        expected = nll[:, max(a, 1) - 1 : b - 1]
        assert bucket["tokens"] == expected.size
        assert abs(bucket["nll"] - expected.mean()) < 1e-4
    assert abs(full["nll"] - nll.mean()) < 1e-4
    # The other modes drop tokens from streaming heads: different, finite numbers.
    last = {m: r["buckets"][-1]["nll"] for m, r in results["modes"].items()}
    assert abs(last["full"] - last["streaming"]) > 1e-3 and abs(last["full"] - last["duo"]) > 1e-4
    assert all(np.isfinite(list(last.values())))


def test_perplexity_rejects_bad_edges(model):
    tokens = np.zeros((1, 50), np.int32)
    with pytest.raises(duo_jax.DuoJaxError, match="bucket edges"):
        evaluate_perplexity(model, tokens, ["full"], pattern=None, edges=[0, 60], progress=False)


# --- reports and the command line -------------------------------------------------------------------------------


def test_markdown_table_and_json(tmp_path):
    table = report.markdown_table(["mode", "acc"], [["full", 1.0], ["duo", float("nan")], ["x", None]])
    lines = table.splitlines()
    assert lines[0].startswith("| mode") and set(lines[1]) <= {"|", "-"} and "| -" in lines[3]
    assert len({len(line) for line in lines}) == 1
    path = report.write_json(tmp_path / "a" / "r.json", {"x": np.float32(0.5), 3: np.arange(2), "nan": float("nan")})
    assert json.loads(path.read_text()) == {"x": 0.5, "3": [0, 1], "nan": None}
    assert report.human_bytes(1536) == "1.5 KiB" and report.human_bytes(10) == "10 B"


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["niah", "--lengths", "160", "--depths", "0.5", "--max-new-tokens", "2", "--decode-last", "4"],
        ["niah", "--lengths", "400", "--depths", "0.5", "--max-new-tokens", "2", "--protocol", "duoattention"],
        ["passkey", "--lengths", "160", "--depths-per-length", "1", "--max-new-tokens", "2"],
        ["perplexity", "--length", "96", "--samples", "1"],
    ],
)
def test_every_task_runs_through_main(model, pattern, tmp_path, monkeypatch, capsys, argv):
    """Each task's whole command line, on the tiny model: passkey's once crashed on an option only niah has."""
    monkeypatch.setattr(duo_jax, "load", lambda *a, **kw: model)
    monkeypatch.setattr("duo_jax.pattern.resolve_pattern", lambda *a, **kw: pattern)
    out = tmp_path / argv[0]
    modes = ["--modes", "full", "h2o", "--kv-budget", "0.5"] if argv[0] == "niah" else ["--modes", "full"]
    assert eval_main([*argv, *modes, "--chunk-size", "32", "--out", str(out)]) == 0, capsys.readouterr().err
    assert (out / f"{argv[0]}.json").is_file()


def test_cli_errors_exit_2(tmp_path, capsys):
    assert eval_main(["niah", "--model", str(tmp_path / "missing.gguf"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["niah", "--kv-budget", "1.5"], "--kv-budget: a KV budget is a fraction"),
        (["ruler", "--kv-budget", "0.5", "128"], "--kv-budget: KV budgets 0.5, 128 mix fractions"),
        (["niah", "--modes", "full", "h2o2"], "invalid choice"),
        (["perplexity", "--length", "512", "--prefix", "512"], "--prefix must lie"),
        (["niah", "--kv-dtype", "int2"], "invalid choice"),
        (["longbench", "--data", "missing", "--max-length", "1"], "--max-length: max_length must be at least 2 tokens"),
        (["niah", "--batch-size", "0"], "--batch-size: must be an integer >= 1, got 0"),  # ran as "all" before
        (["ruler", "--lengths", "512", "-5"], "--lengths: must be an integer >= 1, got -5"),
        (["passkey", "--digits", "x"], "--digits: must be an integer >= 1, got 'x'"),
        # checked before any mode runs, whichever modes use them (they failed after a mode ran, or were ignored)
        (["passkey", "--seed", "-1"], "--seed / --digits: seed must be an integer >= 0, got -1"),
        (["passkey", "--digits", "19"], "--seed / --digits: digits must be an integer >= 1 and <= 18, got 19"),
        (["niah", "--modes", "full", "duo", "--sparsity", "7"], "--sparsity: sparsity must be a finite number >= 0"),
        (["niah", "--modes", "full", "--streaming-chunk", "-2"], "--streaming-chunk: streaming_chunk must be"),
        (["perplexity", "--recent", "0"], "--recent: recent must be an integer >= 1, got 0"),
        (["niah", "--modes", "full", "--pattern", "/nonexistent"], "--pattern: /nonexistent does not exist"),
    ],
)
def test_cli_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err

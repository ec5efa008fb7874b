"""Tests of duo_jax.pattern: reading the published DuoAttention patterns, binarisation, save / load, errors."""

import dataclasses
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from duo_jax.config import CONFIGS_DIR, get_config
from duo_jax.errors import DuoJaxError
from duo_jax.pattern import Pattern, PatternError

# The published patterns shipped in configs/patterns/ (copied from the DuoAttention repository's attn_patterns/,
# see configs/patterns/README.md): layers x KV heads.
PUBLISHED = {
    "llama2-7b-32k": (32, 32),
    "llama3-8b-1048k": (32, 8),
    "llama3.1-8b": (32, 8),
    "mistral-7b-v0.2": (32, 8),
    "mistral-7b-v0.3": (32, 8),
}
SHIPPED = ["llama2-7b-32k", "llama3-8b", "llama3-8b-1048k", "llama3.1-8b", "mistral-7b-v0.2", "mistral-7b-v0.3"]


def published_dir(model: str) -> Path:
    """The folder of a published pattern shipped in configs/patterns/."""
    return CONFIGS_DIR / "patterns" / model


def write(tmp_path: Path, text: str) -> Path:
    """Write `text` as the pattern TSV in `tmp_path` and return its path."""
    path = tmp_path / "full_attention_heads.tsv"
    path.write_text(text)
    return path


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_published_patterns_load(model):
    folder = published_dir(model)
    pattern = Pattern.load(folder)
    assert pattern.gates.shape == PUBLISHED[model]
    assert (pattern.num_layers, pattern.num_kv_heads) == PUBLISHED[model]
    assert pattern.gates.dtype == np.float32
    assert pattern.gates.min() >= 0.0 and pattern.gates.max() <= 1.0
    assert pattern.meta is not None and pattern.meta["reg_weight"] == 0.05
    raw = np.loadtxt(folder / "full_attention_heads.tsv", delimiter="\t", dtype=np.float32)
    np.testing.assert_array_equal(pattern.gates, np.clip(raw, 0.0, 1.0))
    # The TSV path itself loads the same gates.
    np.testing.assert_array_equal(Pattern.load(folder / "full_attention_heads.tsv").gates, pattern.gates)


def test_gates_are_read_only():
    pattern = Pattern.full(2, 2)
    with pytest.raises(ValueError):
        pattern.gates[0, 0] = 0.5


def test_constructor_clips_and_validates():
    pattern = Pattern([[-0.25, 0.5], [1.5, 1.0]])
    np.testing.assert_array_equal(pattern.gates, np.array([[0.0, 0.5], [1.0, 1.0]], dtype=np.float32))
    for bad in ([1.0, 0.5], [[[1.0]]], np.zeros((0, 8)), [[1.0, np.nan]], [[np.inf]], [["a", "b"]]):
        with pytest.raises(PatternError):
            Pattern(bad)
    assert issubclass(PatternError, DuoJaxError) and issubclass(PatternError, ValueError)


def test_llama3_half_sparsity_keeps_the_128_largest_gates():
    pattern = Pattern.load(published_dir("llama3-8b-1048k"))
    mask = pattern.retrieval_mask(0.5)
    assert mask.shape == (32, 8) and mask.dtype == bool
    assert mask.sum() == 128
    # Independent computation: stable argsort of -gate over the flattened (layer, head) order.
    flat = pattern.gates.ravel()
    expected = np.zeros(flat.size, dtype=bool)
    expected[np.argsort(-flat.astype(np.float64), kind="mergesort")[:128]] = True
    np.testing.assert_array_equal(mask.ravel(), expected)
    assert flat[mask.ravel()].min() >= flat[~mask.ravel()].max()


@pytest.mark.parametrize("shape", [(32, 8), (32, 32), (30, 3), (1, 1), (7, 5), (3, 1), (28, 32)])
def test_retrieval_heads_are_the_originals_quantile_rule(shape):
    """The original DuoAttention binarisation: alpha >= np.quantile(alpha, sparsity), threshold 2 at sparsity 1
    (distinct gates, where its 1e-6 of noise changes nothing). Where sparsity * (N - 1) is a whole number in exact
    arithmetic, float rounding decides the original's count: those are test_retrieval_count_exact_arithmetic's."""
    pattern = Pattern(np.random.default_rng(0).uniform(size=shape))
    N = pattern.gates.size
    for sparsity in (0, 0.0, 0.1, 0.25, 0.5, 0.6, 0.75, 0.8, 0.875, 0.9, 0.99, 1, 1.0):
        index = Fraction(str(float(sparsity))) * (N - 1)
        if index.denominator == 1 and 0 < index < N - 1:
            continue
        threshold = 2.0 if sparsity == 1 else np.quantile(pattern.gates.astype(np.float64), sparsity)
        np.testing.assert_array_equal(pattern.retrieval_mask(sparsity), pattern.gates >= threshold, f"{sparsity}")


def test_retrieval_count_exact_arithmetic():
    pattern = Pattern(np.random.default_rng(1).uniform(size=(30, 3)))
    assert pattern.retrieval_mask(0.25).sum() == 67  # 90 - ceil(22.25)
    assert pattern.retrieval_mask(0.75).sum() == 23  # 90 - ceil(66.75)
    assert pattern.retrieval_mask(0.5).sum() == 45
    # 0.14 * 50 is 7.000000000000001 in float64 (numpy's quantile keeps 43); the exact 7 keeps 51 - 7 heads.
    assert Pattern(np.ones((1, 51))).retrieval_mask(0.14).sum() == 44
    assert Pattern(np.ones((1, 51))).retrieval_mask(np.float32(0.14)).sum() == 44
    assert Pattern(np.ones((2, 5))).retrieval_mask(0.55).sum() == 5  # 10 - ceil(4.95)
    assert Pattern(np.ones((16, 16))).retrieval_mask(0.5).sum() == 128
    assert Pattern(np.ones((32, 8))).retrieval_mask(0.6).sum() == 103  # Llama-3-8B: 256 - ceil(153)


def test_ties_are_broken_by_gate_then_a_fixed_pseudo_random_order():
    pattern = Pattern(np.full((4, 3), 0.5))
    mask = pattern.retrieval_mask(0.5)
    rank = np.random.default_rng(0).permutation(12)  # the documented tie order
    np.testing.assert_array_equal(mask.ravel(), rank < 6)
    np.testing.assert_array_equal(mask, pattern.retrieval_mask(0.5))  # deterministic
    # A larger gate always wins, whatever the tie order.
    gates = np.array([[0.9, 0.2, 0.2], [0.2, 0.9, 0.1]])
    np.testing.assert_array_equal(
        Pattern(gates).retrieval_mask(0.5), np.array([[1, 1, 0], [0, 1, 0]], dtype=bool)
    )  # 0.9, 0.9, then one 0.2 of three
    for sparsity in (0.3, 0.5, 0.7):
        mask = Pattern(gates).retrieval_mask(sparsity)
        assert gates[mask].min() >= gates[~mask].max()


def test_zero_gate_ties_are_not_given_to_the_first_layers():
    """SmolLM2's shipped gates: 43 of 90 are exactly 0, so at sparsity 0.25 (67 retrieval heads) 20 zero-gate
    heads must be retrieval heads. They follow the tie order, not the layer order (which would give them the
    first layers)."""
    pattern = Pattern.for_model("smollm2-135m")
    gates, mask = pattern.gates.ravel(), pattern.retrieval_mask(0.25).ravel()
    assert mask.sum() == 67 and (gates > 0).sum() == 47 and mask[gates > 0].all()
    tied = np.flatnonzero(gates == 0)
    chosen = tied[np.argsort(pattern.tie_order()[tied])[:20]]
    np.testing.assert_array_equal(np.flatnonzero(mask & (gates == 0)), np.sort(chosen))
    assert max(chosen // 3) > 12  # in layer order they would all sit in layers 0-9


@pytest.mark.parametrize("sparsity", [-0.1, 1.5, float("nan"), float("inf"), "0.5", None, True, [0.5]])
def test_bad_sparsity(sparsity):
    with pytest.raises(PatternError, match=r"\[0, 1\]"):
        Pattern.full(2, 2).retrieval_mask(sparsity)


def test_save_load_round_trip_is_bit_identical(tmp_path):
    gates = np.random.default_rng(2).uniform(size=(30, 3)).astype(np.float32)
    gates[0, 0], gates[1, 1] = 0.0, 1.0
    meta = {"lr": 0.02, "sink_size": 128}
    pattern = Pattern(gates, meta=meta)
    loaded = Pattern.load(pattern.save(tmp_path / "new" / "pattern"))
    assert loaded.gates.tobytes() == gates.tobytes()
    assert loaded.meta == meta
    assert Pattern.load(Pattern(gates).save(tmp_path / "bare")).meta is None


def test_the_pattern_of_an_unfinished_training_run_says_so_when_loaded(tmp_path):
    """train_gates writes the gates at every checkpoint; config.json's steps_done tells a stopped run's from a
    finished one's, which loads silently."""
    import warnings

    gates = np.full((2, 2), 0.5)
    with pytest.warns(UserWarning, match="unfinished training run .step 4 of 10"):
        Pattern.load(Pattern(gates, {"num_steps": 10, "steps_done": 4}).save(tmp_path / "stopped"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pattern.load(Pattern(gates, {"num_steps": 10, "steps_done": 10}).save(tmp_path / "done"))


def test_saving_without_meta_over_a_config_json_is_refused(tmp_path):
    """Saving gates without meta over an earlier save left its config.json, so load returned the old meta (and
    warned of an unfinished run); removing it could delete a model's own config.json: refused, nothing written."""
    folder = Pattern(np.full((2, 2), 0.5), {"num_steps": 10, "steps_done": 4}).save(tmp_path)
    with pytest.raises(PatternError, match="config.json exists, and a pattern saved there without meta"):
        Pattern(np.full((2, 2), 0.25)).save(folder)
    assert (np.loadtxt(folder / "full_attention_heads.tsv") == 0.5).all()
    assert Pattern(np.full((2, 2), 0.25), {"note": "new"}).save(folder) == folder  # with meta: replaced


def test_meta_is_serialised_before_anything_is_written(tmp_path):
    """numpy scalars are written as Python numbers; a value JSON cannot hold is refused naming its key, with
    nothing written (it was a bare TypeError after the TSV)."""
    meta = {"num_steps": np.int64(10), "lr": np.float32(0.5), "resume": np.bool_(False)}
    loaded = Pattern.load(Pattern(np.full((2, 2), 0.5), meta).save(tmp_path / "numpy"))
    assert loaded.meta == {"num_steps": 10, "lr": 0.5, "resume": False}
    assert type(loaded.meta["num_steps"]) is int
    with pytest.raises(PatternError, match="pattern meta 'dataset' cannot be written to config.json.*drop the key"):
        Pattern(np.full((2, 2), 0.5), {"lr": 0.1, "dataset": object()}).save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(PatternError, match="meta keys must be strings"):
        Pattern(np.full((2, 2), 0.5), {3: "x"}).save(tmp_path / "bad")


def test_save_matches_the_original_format(tmp_path):
    folder = published_dir("llama3.1-8b")  # its published gates are already in [0, 1]
    Pattern.load(folder).save(tmp_path)
    assert (tmp_path / "full_attention_heads.tsv").read_text() == (folder / "full_attention_heads.tsv").read_text()


def test_validate_against_model_config():
    config = get_config("smollm2-135m")
    Pattern.full(config.num_layers, config.num_kv_heads).validate(config)
    with pytest.raises(PatternError, match=r"32x8 \(layers x kv_heads\) but model 'smollm2-135m' has 30x3"):
        Pattern.full(32, 8).validate(config)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        ("0.1\t0.2\n0.3\n", "line 2: ragged rows"),
        ("0.1\t0.2\n0.3\tabc\n", r"line 2, column 2: 'abc' is not a number"),
        ("0.1\t0.2\n\n0.3\t0.4\n", "line 2: empty line"),
        ("0.1\tnan\n", "is not finite"),
    ],
)
def test_malformed_tsv(tmp_path, text, problem):
    path = write(tmp_path, text)
    with pytest.raises(PatternError, match=problem) as info:
        Pattern.load(tmp_path)
    assert str(path) in str(info.value)


def test_trailing_newlines_and_spaces_are_accepted(tmp_path):
    write(tmp_path, "0.1\t0.2\n0.3\t-0.0002\n\n")
    np.testing.assert_array_equal(Pattern.load(tmp_path).gates, np.array([[0.1, 0.2], [0.3, 0.0]], dtype=np.float32))


def test_missing_paths(tmp_path):
    with pytest.raises(PatternError, match="does not exist"):
        Pattern.load(tmp_path / "nowhere")
    with pytest.raises(PatternError, match="holds no full_attention_heads.tsv"):
        Pattern.load(tmp_path)


def test_bad_metadata(tmp_path):
    write(tmp_path, "0.5\n")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PatternError, match="config.json"):
        Pattern.load(tmp_path)


def test_for_model():
    pattern = Pattern.for_model("llama3.1-8b")
    assert pattern is not None
    pattern.validate(get_config("llama3.1-8b"))
    smol = Pattern.for_model("smollm2-135m")  # trained here (train_gates.py), shipped in configs/patterns
    assert smol.gates.shape == (30, 3)


def test_for_model_without_a_pattern(tmp_path, monkeypatch):
    import json

    import duo_jax.config as config_lib

    entry = config_lib.read_named("smollm2-135m")
    del entry["pattern"]
    (tmp_path / "nopattern.json").write_text(json.dumps(entry))
    monkeypatch.setattr(config_lib, "CONFIGS_DIR", tmp_path)
    assert Pattern.for_model("nopattern") is None


def test_a_model_loaded_from_a_path_has_no_default_pattern():
    """Its config takes the folder's name, which is no named config: "default" said "unknown model name ... (or
    pass a path to a Hugging Face directory ...)" to a user who had passed one."""
    from duo_jax.pattern import resolve_pattern

    config = dataclasses.replace(get_config("smollm2-135m"), name="my-llama")
    assert Pattern.for_model("my-llama") is None
    with pytest.raises(PatternError, match="'my-llama' ships no default pattern .* pass pattern=PATH, a folder"):
        resolve_pattern("default", config)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_patterns_fit_their_models(name):
    pattern = Pattern.for_model(name)
    assert pattern is not None
    config = get_config(name)
    assert pattern.gates.shape == (config.num_layers, config.num_kv_heads)


def test_full():
    pattern = Pattern.full(3, 2)
    assert pattern.gates.shape == (3, 2) and (pattern.gates == 1.0).all()
    assert pattern.retrieval_mask(0.5).sum() == 3


def test_repr():
    assert repr(Pattern(np.array([[1.0, 0.0], [1.0, 1.0]]))) == "Pattern(2x2, mean gate 0.750, 75% of gates > 0.5)"


def test_heatmap(tmp_path):
    path = Pattern.load(published_dir("llama2-7b-32k")).heatmap(tmp_path / "plots" / "map.png", title="x")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_headkv_scores_files_are_named_so_in_errors(tmp_path):
    """HeadKV scores are saved in the pattern format; a bad scores file was reported as a "pattern file"."""
    from duo_jax.config import get_config as config_of
    from duo_jax.methods.headkv import resolve_scores

    (tmp_path / "scores.tsv").write_text("x\ty\n")
    with pytest.raises(DuoJaxError, match="HeadKV scores file .*scores.tsv, line 1, column 1: 'x' is not a number"):
        resolve_scores(tmp_path / "scores.tsv", config_of("smollm2-135m"))
    with pytest.raises(PatternError, match="pattern file .*scores.tsv, line 1"):
        Pattern.load(tmp_path / "scores.tsv")


def test_head_scores_and_gate_patterns_are_not_taken_for_each_other(tmp_path):
    """The two share a format: HeadKV scores given as a pattern were binarised as gates (31% of SmolLM2's heads
    chose differently at sparsity 0.5), and a gate pattern passed as scores (its config.json names no kind)."""
    from duo_jax.head_scores import load_scores
    from duo_jax.methods.headkv import resolve_scores
    from duo_jax.pattern import resolve_pattern

    config = get_config("smollm2-135m")
    scores, gates = CONFIGS_DIR / "scores" / "smollm2-135m", CONFIGS_DIR / "patterns" / "smollm2-135m"
    with pytest.raises(PatternError, match="holds HeadKV head scores .*not pattern: pass a folder written by train_g"):
        resolve_pattern(scores, config)
    for load in (lambda p: resolve_scores(p, config), load_scores):
        with pytest.raises(PatternError, match="holds a gate pattern .*not HeadKV scores: .*duo_jax.head_scores"):
            load(gates)
    assert resolve_scores(scores, config).meta["kind"] == "headkv_head_scores"
    assert resolve_pattern(gates, config) is not None
    bare = np.loadtxt(scores / "full_attention_heads.tsv", ndmin=2)
    Pattern(bare).save(tmp_path / "bare")  # no config.json: taken for what it is asked to be
    assert resolve_pattern(tmp_path / "bare", config) is not None and resolve_scores(tmp_path / "bare", config)

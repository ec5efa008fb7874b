"""The train_gates.py command line: help, missing weights, and SIGKILL + restart giving bit-identical gates."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import transformers

from duo_jax.pattern import Pattern
from tests.test_model import write_random_hf_model
from tests.test_training import REPO, VOCAB, tiny_tokenizer, write_haystack

SCRIPT = str(REPO / "train_gates.py")


def run_cli(*args, env=None, **kwargs):
    return subprocess.run(
        [sys.executable, SCRIPT, *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        **kwargs,
    )


def test_help_lists_the_flags():
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in (
        "--model",
        "--out",
        "--steps",
        "--max-len",
        "--mesh",
        "--resume",
        "--dtype",
        "--haystack",
        "--num-passkeys",
        "--passkey-words",
        "--save-every",
        "--distributed",
    ):
        assert flag in result.stdout


def test_help_gives_each_default_once():
    """--help showed no defaults (docs/cli.md says it lists them); options without one, or whose help already
    gives it, get no "(default: None)" or a second one."""
    import train_gates

    text = " ".join(train_gates.build_parser().format_help().split())  # unwrapped
    for shown in ("--steps STEPS optimiser steps (default: 2000)", "(default: 0.02)", "(default: bf16)"):
        assert shown in text
    assert "paul_graham:calibration)" in text and "(default: qa)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("default: runs/gates/<model name>") == 1 and text.count("seq=all devices") == 1
    # the docstring's examples keep their lines
    assert "\n    python train_gates.py --model smollm2-135m --out runs/gates/smollm2-135m\n" in (
        train_gates.build_parser().format_help()
    )


def test_a_coordinator_that_is_not_host_port_exits_2(tmp_path, capsys, monkeypatch):
    """It was JAX's IndexError: list index out of range."""
    import jax

    import train_gates

    called = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args: called.append(args))
    args = ["--model", str(tmp_path / "m"), "--coordinator", "nonsense", "--num-processes", "1", "--process-id", "0"]
    assert train_gates.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --coordinator 'nonsense' is not HOST:PORT") and "host0:1234" in err, err
    assert not called


def test_impl_offers_every_attention_implementation():
    import train_gates
    from duo_jax.attention import IMPLS

    (impl,) = [a for a in train_gates.build_parser()._actions if a.dest == "impl"]
    assert tuple(impl.choices) == IMPLS


def test_dtype_takes_the_other_commands_spelling_too():
    """infer.py and the evaluations spell dtypes bfloat16 / float32: the same words name the same run here (the run's
    metadata, which a resume compares, keeps one spelling)."""
    import train_gates

    parse = lambda *args: train_gates.build_parser().parse_args(["--model", "m", *args]).dtype  # noqa: E731
    assert parse() == parse("--dtype", "bfloat16") == "bf16"
    assert parse("--dtype", "float32") == parse("--dtype", "fp32") == "fp32"
    with pytest.raises(SystemExit):
        parse("--dtype", "float16")


def test_missing_weights_exit_2_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DUO_JAX_MODELS", "HF_HUB_CACHE")}
    env["HF_HOME"] = str(tmp_path / "hf")
    result = run_cli("--model", "llama3-8b", "--out", tmp_path / "out", env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: weights for 'llama3-8b'"), result.stderr
    assert "looked in" in lines[0] and "To provide them" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random tiny Llama saved by transformers, with a BPE tokenizer.json, and a haystack folder."""
    root = tmp_path_factory.mktemp("tiny")
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    write_random_hf_model(root / "model", transformers.LlamaConfig, fields)
    tiny_tokenizer().save(str(root / "model" / "tokenizer.json"))
    return root / "model", write_haystack(root / "hay")


@pytest.mark.slow
def test_killed_run_resumes_to_bit_identical_gates(tmp_path, tiny_checkpoint):
    model, haystack = tiny_checkpoint
    args = [
        "--model",
        model,
        "--dtype",
        "fp32",
        "--steps",
        30,
        "--save-every",
        5,
        "--sink",
        8,
        "--recent",
        16,
        "--min-len",
        1,
        "--max-len",
        512,
        "--num-lengths",
        1,
        "--num-passkeys",
        2,
        "--passkey-words",
        4,
        "--haystack",
        haystack,
    ]
    killed, straight = tmp_path / "killed", tmp_path / "straight"

    command = [sys.executable, SCRIPT, *map(str, args), "--out", str(killed)]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (killed / "checkpoints" / "10").is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL  # killed mid-run, not finished
    partial = json.loads((killed / "loss.json").read_text())
    assert 10 <= len(partial) < 30

    resumed = run_cli(*args, "--out", killed)  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stderr
    assert "per-device memory of a 512-token step: weights" in resumed.stderr  # printed before the first step
    uninterrupted = run_cli(*args, "--out", straight)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]

    assert (killed / "full_attention_heads.tsv").read_bytes() == (straight / "full_attention_heads.tsv").read_bytes()
    np.testing.assert_array_equal(Pattern.load(killed).gates, Pattern.load(straight).gates)
    assert Pattern.load(straight).gates.min() < 1.0
    drop_timing = lambda h: {k: v for k, v in h.items() if k not in ("seconds", "tokens_per_s")}
    histories = [json.loads((d / "loss.json").read_text()) for d in (killed, straight)]
    assert [drop_timing(h) for h in histories[0]] == [drop_timing(h) for h in histories[1]]
    assert len(histories[0]) == 30
    assert (straight / "gates.png").is_file() and Pattern.load(straight).meta["num_steps"] == 30


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-len", "0"], "max_len must be an integer >= 1"),  # was the model's context, silently
        (["--num-passkeys", "0"], "num_passkeys must be between 1"),  # these were refused after the model loaded
        (["--min-depth", "0.9", "--max-depth", "0.1"], "min_depth <= max_depth"),
        (["--lr", "inf"], "finite lr"),
        # finite in float64 but inf in float32: the run trained with an inf lr, wrote a meaningless pattern, exit 0
        (["--lr", "1e39"], "lr (--lr) must be a finite number of size at most 3.403e+38 (float32's largest"),
        (["--reg-weight", "1e300"], "reg_weight (--reg-weight) must be a finite"),  # was 'the loss is not finite'
        (["--seed", "-1"], "seed must be an integer >= 0"),
        # after the weights and the memory report, as 'need 1 <= min_len <= max_len'
        (["--min-len", "600", "--max-len", "256"], "--min-len 600 exceeds --max-len 256"),
        (["--haystack", "no-such-folder"], "unknown haystack source 'no-such-folder'"),
        (["--min-len", "1", "--max-len", "300", "--recent", "256"], "covers every training context (max_len 300)"),
        (["--max-len", "300"], "--min-len 1000 (its default) exceeds --max-len 300"),
        (["--min-len", "1000", "--max-len", "300"], "--min-len 1000 exceeds --max-len 300"),  # typed: not 'its default'
        (["--lr", "1e-50"], "lr (--lr) 1e-50 is 0 in float32"),  # positive in float64: trained nothing, exit 0
    ],
)
def test_bad_options_exit_2_before_the_weights_load(tmp_path, capsys, args, message):
    import train_gates

    assert train_gates.main(["--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "weights" not in err, err
    assert "(its default)" not in err or "--min-len" not in args, err


@pytest.mark.parametrize(
    "args, message",
    [
        # was 'need 1 <= min_len <= max_len ... max_len=512' after the weights loaded, a number never typed
        (["--min-len", "2000"], "--min-len 2000 exceeds --max-len, which defaults to the model's context of 512"),
        (["--min-len", "1", "--max-len", "600"], "max_len 600 exceeds the model's context of 512 tokens"),
    ],
)
def test_lengths_past_the_models_context_exit_2_before_the_weights_load(
    tmp_path, tiny_checkpoint, capsys, monkeypatch, args, message
):
    import duo_jax
    import train_gates

    def load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(duo_jax, "load", load)
    model, haystack = tiny_checkpoint
    argv = ["--model", model, "--out", tmp_path / "out", "--haystack", haystack, *args]
    assert train_gates.main(list(map(str, argv))) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_a_haystack_of_empty_files_exits_2_before_the_weights_load(tmp_path, capsys):
    """It trained on blank lines, exit 0."""
    import train_gates

    (tmp_path / "hay").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "hay" / name).write_text(" \n")
    args = ["--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "out"), "--haystack", tmp_path / "hay"]
    assert train_gates.main(list(map(str, args))) == 2
    err = capsys.readouterr().err
    assert f"the .txt files in {tmp_path / 'hay'} hold no text" in err and "weights" not in err, err


def test_a_step_larger_than_the_free_device_memory_exits_2_before_training(
    tmp_path, tiny_checkpoint, capsys, monkeypatch
):
    import train_gates
    from duo_jax import device_memory
    from tests.conftest import FakeDevice

    model, haystack = tiny_checkpoint
    args = ["--model", model, "--dtype", "fp32", "--steps", 2, "--sink", 8, "--recent", 16, "--min-len", 1]
    args += ["--max-len", 256, "--num-lengths", 1, "--num-passkeys", 2, "--passkey-words", 4, "--haystack", haystack]
    # a device with 1 KiB free: less than any train step needs
    monkeypatch.setattr(device_memory, "free_bytes", lambda devices: (1024, FakeDevice(2**30), 2**30))
    assert train_gates.main([*map(str, args), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "a train step on 1 x 256 tokens needs" in err and "--max-len" in err and "--mesh seq=N" in err, err
    assert not (tmp_path / "out" / "checkpoints").exists()

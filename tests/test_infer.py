"""infer.py: the CLI's output and its one-line errors (exit status 2, no traceback)."""

import functools
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import duo_jax
import infer

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "infer.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )


def test_infer_generate_is_duo_jax_generate():
    import duo_jax

    assert infer.generate is duo_jax.generate


@pytest.mark.slow
def test_generates_and_prints_stats(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is")
    result = run_cli(
        "--prompt-file",
        str(prompt),
        "--max-new-tokens",
        "4",
        "--pattern",
        "default",
        "--sparsity",
        "0.5",
        "--sink",
        "4",
        "--recent",
        "8",
        "--no-chat",
    )
    if "ships no default pattern" in result.stderr:  # before the SmolLM2 pattern is trained
        result = run_cli("--prompt-file", str(prompt), "--max-new-tokens", "4", "--no-chat")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is")
    assert "KV cache" in result.stderr and "tok/s" in result.stderr


_LOAD = duo_jax.load


@functools.cache
def _load_once(name, dtype=None, weights=None, shardings=None):
    return _LOAD(name, dtype=dtype, weights=weights, shardings=shardings)


@pytest.fixture(autouse=True)
def _each_model_loaded_once(monkeypatch):
    """`infer.main` in this process loads each (model, dtype) once for the file: the same arrays, so `generate`'s
    engine and its compiled steps are reused too (loading the GGUF took ~5 s of each error test)."""
    monkeypatch.setattr(duo_jax, "load", _load_once)


def run_main(capsys, *args):
    """`infer.main` in this process (what the script runs; `test_generates_and_prints_stats` runs the script
    itself): (exit status, stdout, stderr)."""
    status = infer.main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.slow
def test_a_top_k_above_the_vocabulary_keeps_every_token(capsys):
    """--top-k beyond the vocabulary is no limit (not a traceback from lax.top_k)."""
    status, _, err = run_main(
        capsys, "--prompt", "Hi", "--max-new-tokens", "2", "--temperature", "1", "--top-k", "50000", "--no-chat"
    )
    assert status == 0, err


@pytest.mark.slow
def test_other_methods_from_the_command_line(capsys):
    status, out, err = run_main(
        capsys,
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "3",
        "--method",
        "headkv",
        "--kv-budget",
        "40",
        "--scores",
        "default",
        "--no-chat",
    )
    assert status == 0, err
    assert out.startswith("The capital of France is") and "headkv |" in err


@pytest.mark.slow
def test_a_streaming_chunk_gives_the_output_of_its_chunk_size(capsys):
    """duo with --streaming-chunk 16 at --chunk-size 48 prints what --chunk-size 16 prints (a prompt of 51 tokens:
    its streaming heads' windows of 4 + 8 differ between chunks of 16 and 48), and 40 is not a multiple of 16."""
    prompt = (
        "The committee met on Tuesday to review the budget for the new library, the repairs to the bridge on Mill "
        "Street, and a proposal from the school board to extend the bus routes. After two hours of debate, the "
        "members agreed that the most urgent item was"
    )
    common = ("--prompt", prompt, "--no-chat", "--pattern", "default", "--sink", "4", "--recent", "8")
    sixteens, streamed, whole = (
        run_main(capsys, *common, "--max-new-tokens", "8", "--chunk-size", size, *extra)
        for size, extra in (("16", ()), ("48", ("--streaming-chunk", "16")), ("48", ()))
    )
    assert sixteens[0] == streamed[0] == whole[0] == 0, (sixteens, streamed, whole)
    assert streamed[1] == sixteens[1] != whole[1]
    status, _, err = run_main(capsys, *common, "--max-new-tokens", "8", "--chunk-size", "40", "--streaming-chunk", "16")
    assert status == 2 and "chunk_size (40) must be a multiple of duo's streaming_chunk (16)" in err


# Greedy replies of the embedded SmolLM2-135M-Instruct through its chat template, recorded (the first is also
# what transformers generates greedily from the same GGUF and template). Without the template the first prompt
# is continued as plain text.
CHAT_REPLIES = {
    "The capital of France is": "L'aujourcé! I am your friendly AI",
    "What is the capital of France?": "The capital of France is Paris.",
}


@pytest.mark.slow
@pytest.mark.parametrize("prompt", list(CHAT_REPLIES))
def test_instruct_model_answers_through_its_chat_template(prompt, capsys):
    status, out, err = run_main(capsys, "--prompt", prompt, "--max-new-tokens", "12")
    assert status == 0, err
    assert out.split("\n")[0] == CHAT_REPLIES[prompt]
    assert "| chat |" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama3-8b", "--prompt", "hi"], "weights for 'llama3-8b'"),
        (["--prompt", "hi", "--chunk-size", "0"], "chunk_size must be an integer >= 1"),
        (["--prompt", "hi", "--sink", "-1"], "sink must be an integer >= 0"),
        (
            ["--prompt", "hi", "--pattern", str(ROOT / "configs/patterns/llama3-8b"), "--sparsity", "0.5"],
            "32x8 .* 30x3",
        ),
        (["--prompt", "hi", "--sparsity", "1.5"], r"\[0, 1\]"),
        (["--prompt", "hi", "--temperature", "nan"], "temperature must be a finite number >= 0"),
        (["--prompt", "hi", "--top-p", "0"], "top_p must be a finite number > 0 and <= 1"),
        (["--prompt", "hi", "--top-k", "-1"], "top_k must be an integer >= 0"),
        (["--prompt", "hi", "--max-new-tokens", "9000"], "exceeds the model's context of 8192"),
        (["--prompt-file", "/nonexistent.txt"], "No such file"),
        (["--prompt-file", str(ROOT / "benchmarks" / "smollm2_gates.png")], "is not UTF-8 text"),  # a traceback before
        (["--prompt", "hi", "--method", "h2o"], "needs kv_budget"),
        (["--prompt", "hi", "--method", "infinigen"], "needs a positive kv_budget"),
        (["--prompt", "hi", "--method", "headkv", "--kv-budget", "64", "--scores", "/nonexistent"], "nonexistent"),
        (["--prompt", "hi", "--pattern", "default", "--streaming-chunk", "0"], "streaming_chunk must be an integer"),
        (["--prompt", "hi", "--streaming-chunk", "16"], "method 'full' does not take streaming_chunk"),
        (["--prompt", "hi", "--sparsity", "0.5"], "no head pattern, so no sparsity to set; pass a pattern"),
        (["--prompt", "hi", "--pattern", "default", "--kv-budget", "100"], "kv_budget=100 is below duo's streaming"),
    ],
)
def test_errors_are_one_line_with_status_2(args, message, capsys):
    """In this process: an uncaught exception fails the test, as a traceback would fail the user."""
    status, _, err = run_main(capsys, *args)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert re.search(message, lines[0]), lines[0]


def test_several_processes_without_a_mesh_are_refused(capsys, monkeypatch):
    """Launched as one of several processes (SLURM, a pod slice) with no --mesh, each process generated alone."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    status, _, err = run_main(capsys, "--prompt", "hi")
    assert status == 2 and err.startswith("error: this is one of 2 processes but no --mesh spans them"), err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sink", "4", "--recent", "16"], r"--sink/--recent apply to streaming heads.*--pattern, or --method duo\|"),
        (["--method", "full", "--recent", "16"], "--recent applies to streaming heads.*method full"),
        (["--sink", "0"], "--sink applies to streaming heads"),  # 0 is given too, not the default
    ],
)
def test_windows_without_streaming_heads_are_refused_before_loading(args, message, monkeypatch, capsys):
    """Full attention has no streaming heads: --sink / --recent were ignored there (exit 0), as --kv-budget is not."""
    monkeypatch.setattr(duo_jax, "load", lambda *a, **kw: pytest.fail("loaded"))
    status, _, err = run_main(capsys, "--prompt", "hi", *args)
    assert status == 2 and re.search(message, err), err


@pytest.mark.parametrize("chat", ["--chat", "--no-chat", None])
def test_an_empty_prompt_is_refused_in_every_mode(chat, tmp_path, monkeypatch, capsys):
    """With the chat template an empty file was an empty user message the model replied to (exit 0)."""
    monkeypatch.setattr(duo_jax, "load", lambda *a, **kw: pytest.fail("loaded"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    mode = [chat] if chat else []
    status, _, err = run_main(capsys, "--prompt-file", str(empty), *mode)
    assert status == 2 and f"--prompt-file {empty} is empty" in err, err
    status, _, err = run_main(capsys, "--prompt", "", *mode)
    assert status == 2 and "--prompt is empty" in err, err


@pytest.mark.slow
def test_the_script_exits_with_status_2_and_one_line():
    result = run_cli("--prompt", "hi", "--sparsity", "1.5")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: ")

"""duo_jax.errors' helpers for the command lines, and what they guard: an output folder that cannot be written is
refused by every command that writes results before it loads a model (found at the end, it cost the run)."""

import importlib
import os
import re

import pytest

import duo_jax
import duo_jax.loading
from duo_jax.errors import DuoJaxError, check_output_folder


def test_an_output_folder_is_checked_through_its_nearest_existing_parent(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert check_output_folder(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"  # created later
    assert check_output_folder(tmp_path) == tmp_path
    for bad in (afile, afile / "below"):
        with pytest.raises(DuoJaxError, match=f"--out {bad}: {afile} is a file, not a folder"):
            check_output_folder(bad)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(DuoJaxError, match="is not writable"):
            check_output_folder(locked / "out", "OUT")


@pytest.mark.parametrize(
    "module, args",
    [
        ("duo_jax.eval.__main__", ["niah", "--lengths", "256", "--modes", "full", "--out", "{afile}"]),
        ("train_gates", ["--model", "smollm2-135m", "--out", "{afile}/run"]),
        ("duo_jax.head_scores", ["smollm2-135m", "{afile}"]),
        ("demo", ["--out", "{afile}"]),
    ],
)
def test_commands_refuse_an_output_path_below_a_file_before_loading(module, args, tmp_path, monkeypatch, capsys):
    def no_load(*a, **kw):
        raise AssertionError("the model loaded before the output folder was checked")

    monkeypatch.setattr(duo_jax, "load", no_load)
    monkeypatch.setattr(duo_jax.loading, "load", no_load)
    afile = tmp_path / "afile"
    afile.write_text("x")
    main = importlib.import_module(module).main
    assert main([a.format(afile=afile) for a in args]) == 2
    err = capsys.readouterr().err
    assert f"{afile} is a file, not a folder" in err and err.startswith("error: ")


def test_demo_checks_its_sparsity_before_running(monkeypatch, capsys):
    import demo

    monkeypatch.setattr(duo_jax, "load", lambda *a, **kw: pytest.fail("the model loaded before the sparsity check"))
    assert demo.main(["--sparsity", "-1", "--out", "results/unused"]) == 2
    assert "sparsity" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "-5"], "--lengths: each must be at least 1 and at most 8176, the model's context .* got -5"),
        (["--lengths", "100000"], "--lengths: .* at most 8176, the model's context \\(8192 tokens\\) .* got 100000"),
        (["--lengths", "1024", "8177"], "at most 8176.* got 8177"),
        (["--lengths", "300", "300"], "--lengths: 300 is given more than once"),
        (["--depths", "0.5", "0.1", "0.5"], "--depths: 0.5 is given more than once"),
    ],
)
def test_demo_checks_its_grid_before_loading(args, message, monkeypatch, capsys):
    """A length past the context failed after the load naming an option demo.py lacks (context); -5 was
    "n_tokens must be >= 0"; a repeated length was printed twice and run once."""
    import demo

    monkeypatch.setattr(duo_jax, "load", lambda *a, **kw: pytest.fail("the model loaded before the grid check"))
    assert demo.main([*args, "--out", "results/unused"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and re.search(message, err), err


@pytest.mark.parametrize("value", ["nan", "0", "-1"])
def test_plan_refuses_a_memory_that_is_no_size(value, capsys):
    from duo_jax.plan import main

    assert main(["--model", "smollm2-135m", "--hbm-gib", value, "--no-temp"]) == 2
    assert "--hbm-gib must be a finite number > 0" in capsys.readouterr().err


def test_head_scores_refuses_zero_depths_before_loading(tmp_path, monkeypatch, capsys):
    """No depth is no prompt: said as such (it was "no prompt reached min_accuracy ... lower it", after a load)."""
    from duo_jax.head_scores import main

    monkeypatch.setattr(duo_jax.loading, "load", lambda *a, **kw: pytest.fail("loaded"))
    assert main(["smollm2-135m", str(tmp_path / "out"), "--depths", "0"]) == 2
    assert "--depths is a number of needle depths >= 1, got 0" in capsys.readouterr().err

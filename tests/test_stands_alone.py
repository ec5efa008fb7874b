"""The repository stands alone: no tracked file names a path of the machine it was built on.

A clone has only its own files: tests read the shipped configs/patterns/, docs cite facts with their source,
and committed results record repository-relative commands. System package locations (e.g. Debian's
/usr/lib/R/site-library) are fine; home directories, temporary folders and shared work folders are not.
"""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# This file names the paths it looks for, so it does not scan itself.
MACHINE_PATH = re.compile(
    "|".join(
        [
            r"/" + "work/",
            r"/" + "tmp/",
            r"\b" + "shared/",
            r"/" + "home/",
            r"/" + "root/",
            r"/" + "Users/",
            r"/" + "opt/",
            r"/" + "mnt/",
            r"[A-Z]:\\" + r"\\Users",
        ]
    )
)


def _tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [REPO / name for name in listed.stdout.split("\0") if name]


def test_no_tracked_file_names_a_machine_path():
    offenders = []
    for path in _tracked_files():
        if path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # images and other binary files
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:120]}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_the_check_catches_what_it_is_for():
    for line in ["see /" + "work/shared/GPU_NOTES.md", '"out": "/' + 'tmp/eval_dev/memory"', "~/x and /" + "home/me/x"]:
        assert MACHINE_PATH.search(line), line
    for line in ["configs/patterns/llama3-8b", "/usr/lib/R/site-library/janeaustenr/data", ".venv/share/duo-jax"]:
        assert not MACHINE_PATH.search(line), line

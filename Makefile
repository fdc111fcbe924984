# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv on first use (torch first, then the pinned lock) and is safe to re-run.
PY ?= python3
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# where plain PyPI would give you a CUDA build.
TORCH_PIP_ARGS ?=
VENV := .venv
STAMP := $(VENV)/.installed
# The vLLM engine's own environment (FARM_ENGINE=vllm; docs/architecture.md "Engines"); `make test` builds it, or
# writes why it could not to $(VLLM_VENV)/.failed, which the vllm tests skip with.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test install vllm-env clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade "pip>=25"
	$(VENV)/bin/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(VENV)/bin/pip install -q -c requirements.lock -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP): requirements-vllm.lock
	rm -f $(VLLM_STAMP) $(VLLM_VENV)/.failed
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade "pip>=25"
	$(VLLM_VENV)/bin/pip install -q --require-hashes --no-deps -r requirements-vllm.lock
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.launchers.api_server.entry"
	touch $(VLLM_STAMP)

vllm-env:
	@$(MAKE) --no-print-directory $(VLLM_STAMP) > $(VLLM_VENV).log 2>&1 || { \
		mkdir -p $(VLLM_VENV); tail -20 $(VLLM_VENV).log > $(VLLM_VENV)/.failed; \
		echo "vLLM's environment could not be installed: the vllm tests will skip (why: $(VLLM_VENV)/.failed)"; }

demo: $(STAMP)
	$(VENV)/bin/farm demo

test: $(STAMP) vllm-env
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).log runs

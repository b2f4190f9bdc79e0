# llmbus: `make serve` runs the service, `make test` passes the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-all serve bench-offline bench-gpu peer-vllm clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build on local disk. An unpinned torch pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow and not gpu"

test-all: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu"

serve: $(STAMP)
	$(VENV)/bin/llmbus up

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

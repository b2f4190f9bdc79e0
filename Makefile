# llmbus: `make serve` runs the service, `make test` passes the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-all serve bench-gpu clean

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

# On a CUDA machine: every kernel against its reference natively, decode attention bandwidth, and
# the engine's decode throughput on the large demo model (under 5 minutes on an H200).
bench-gpu:
	mkdir -p bench-results
	python3 scripts/bench_gpu.py --out bench-results/gpu-kernels.json
	python3 scripts/bench_gpu_engine.py --out bench-results/gpu-engine.json

include mk/bench.mk

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

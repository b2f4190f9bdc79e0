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
# the engine's decode throughput on the large demo model (eager and as CUDA graphs), within five
# minutes: the two parts share a 280-second deadline, the kernel table at most 160 of them
# (scripts/gpu_check.sh; timing.txt says what each took, and the engine's JSON keeps every row
# finished). `bash scripts/gpu_check.sh` alone also runs the kernel tests and the launch sweep.
bench-gpu:
	OUT=bench-results PARTS="warm kernels engine" DEADLINE=280 KERNELS_S=160 KERNEL_ARGS=--quick bash scripts/gpu_check.sh

include mk/bench.mk

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

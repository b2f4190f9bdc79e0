#!/usr/bin/env bash
# What n-gram speculative decoding buys, through the service, beside llama-server's and vLLM's own
# n-gram speculation on the same weights (docs/benchmarks.md, "Speculative decoding"). Workload:
# the code dataset (prompts of IN tokens from held-out Python standard library files, for the demo
# architecture trained on the rest: scripts/train_demo_model.py), OUT tokens each (ignore_eos), at
# concurrency 1, 4 and 16, greedy and at temperature 0.8. Each server runs twice: without drafts
# and with drafts of up to K tokens looked up by n-grams (llmbus: --speculative-tokens K, its default
# 2:4 lookup; llama-server: --spec-type ngram-simple, lookup N_LLAMA tokens, drafts of K; vLLM:
# method ngram, prompt_lookup 2..4, K tokens).
# Env: OUT (bench-results/speculative), MODEL_DIR (bench-results/models/large-trained), GGUF (its
#      bf16 GGUF, made by scripts/peers/convert_gguf.sh if missing), SERVERS ("llmbus llamacpp vllm"),
#      K (4), N_LLAMA (3), IN (512), OUT_LEN (256), TEMPS ("0 0.8"), CONC ("1 4 16"), SPEC ("off on"),
#      TAG (a suffix for the report names, e.g. when rerun with LLMBUS_CPU_AMX=0 set).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/speculative}")
source scripts/bench_lib.sh
model=${MODEL_DIR:-bench-results/models/large-trained}
size=trained
K=${K:-4}
GGUF=${GGUF:-.peers/gguf/$(basename "$model").bf16.gguf}
runs() {  # port server
    local port=$1 server=$2 np t
    for t in ${TEMPS:-0 0.8}; do
        for c in ${CONC:-1 4 16}; do
            np=$(( c == 1 ? 8 : 2 * c ))
            bench "$port" "$server t$t c$c" "$server-t$t-c$c" --dataset code --num-prompts $np --seed $c \
                --input-len "${IN:-512}" --output-len "${OUT_LEN:-256}" --ignore-eos --temperature "$t" \
                --max-concurrency $c --warmup 1
        done
    done
}
for server in ${SERVERS:-llmbus llamacpp vllm}; do
    for spec in ${SPEC:-off on}; do
        name=$server-spec-$spec${TAG:-}
        case $server in
        llmbus)
            extra=(); [ $spec = on ] && extra=(--speculative-tokens "$K")
            rm -rf "$OUT/data-$name"
            start "$name" 8300 "$PY" -m llmbus.cli up --model "$size=$ROOT/$model" --port 8300 \
                --data-dir "$OUT/data-$name" --colocated "${extra[@]}" || continue
            runs 8300 "$name";;
        llamacpp)
            if [ ! -x .peers/llamacpp/llama-server ]; then echo "skip llama.cpp: no llama-server" >&2; continue; fi
            [ -f "$GGUF" ] || bash scripts/peers/convert_gguf.sh "$model" "$GGUF" bf16 > "$OUT/convert.log" 2>&1 \
                || { echo "skip llama.cpp: conversion failed (see $OUT/convert.log)" >&2; continue; }
            extra=(); [ $spec = on ] && extra=(--spec-type ngram-simple --spec-ngram-simple-size-n "${N_LLAMA:-3}"
                                              --spec-ngram-simple-size-m "$K")
            start "$name" 8200 env SERVED_NAME="$size" bash scripts/peers/run_llamacpp.sh "$GGUF" 8200 16 \
                "${extra[@]}" || continue
            runs 8200 "$name";;
        vllm)
            if [ ! -x .peers/vllm-venv/bin/python ]; then echo "skip vLLM: no .peers/vllm-venv" >&2; continue; fi
            extra=(); [ $spec = on ] && extra=(--speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}")
            start "$name" 8100 env SERVED_NAME="$size" bash scripts/peers/run_vllm.sh "$model" 8100 "${extra[@]}" || continue
            runs 8100 "$name";;
        esac
        stop
    done
done
echo "reports: $OUT"

#!/usr/bin/env bash
# What conditional disaggregation buys (docs/benchmarks.md, "Short prompts to the decode pool").
# `llmbus up` (one prefill and one decode worker) on the small demo model: "handoff" runs the router
# with --whole-threshold=0, every prompt prefilled by the prefill worker and handed to the decode
# worker through kvpool; "whole" with --whole-threshold=$THRESHOLD, so prompts up to that many
# tokens go to the decode worker, which prefills and decodes them itself. Loads: 128 random
# 128-token prompts for 64 tokens, 16 at a time; and the "mixed" dataset (256-token prompts for
# 128, one in ten a 2,048-token prompt for 16), 16 at a time. Modes alternate, ROUNDS rounds; then
# llama.cpp's llama-server on the same weights (f32 GGUF, 16 slots, 2 threads) on both loads
# (skipped without `make peer-llamacpp`).
# Env: OUT (bench-results/whole), ROUNDS (2), THRESHOLD (128).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/whole}")
source scripts/bench_lib.sh
demo_model small
for round in $(seq 1 "${ROUNDS:-2}"); do
    for mode in handoff whole; do
        rm -rf "$OUT/data"
        threshold=0; [ $mode = whole ] && threshold=${THRESHOLD:-128}
        start "llmbus-$mode-$round" 8330 "$PY" -m llmbus.cli up --model "$size=$ROOT/$model" --port 8330 \
            --data-dir "$OUT/data" "--router-arg=--whole-threshold=$threshold" || continue
        bench 8330 "$mode short" "short-$mode-r$round" --dataset random --num-prompts 128 --input-len 128 \
            --output-len 64 --ignore-eos --max-concurrency 16 --seed 5
        bench 8330 "$mode mixed" "mixed-$mode-r$round" --dataset mixed --num-prompts 128 --ignore-eos \
            --max-concurrency 16 --seed 6
        stop
    done
done
if [ -x .peers/llamacpp/llama-server ]; then
    SERVED_NAME=$size start llamacpp 8331 bash scripts/peers/run_llamacpp.sh "$model" 8331 16 && {
        bench 8331 "llama.cpp short" short-llamacpp --dataset random --num-prompts 128 --input-len 128 \
            --output-len 64 --ignore-eos --max-concurrency 16 --seed 5
        bench 8331 "llama.cpp mixed" mixed-llamacpp --dataset mixed --num-prompts 128 --ignore-eos \
            --max-concurrency 16 --seed 6
    }
    stop
fi
"$PY" -m llmbus.cli bench compare --markdown "$OUT"/short-*.json
"$PY" -m llmbus.cli bench compare --markdown "$OUT"/mixed-*.json

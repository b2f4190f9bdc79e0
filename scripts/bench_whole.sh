#!/usr/bin/env bash
# What conditional disaggregation buys (docs/benchmarks.md, "Short prompts to the decode pool").
# `llmbus up` (one prefill and one decode worker) on the small demo model: "handoff" is the default
# router, every prompt prefilled by the prefill worker and handed to the decode worker through
# kvpool; "whole" adds --router-arg=--whole-threshold=$THRESHOLD, so prompts up to that many
# tokens go to the decode worker, which prefills and decodes them itself. Loads: 128 random
# 128-token prompts for 64 tokens, 16 at a time; and the "mixed" dataset (256-token prompts for
# 128, one in ten a 2,048-token prompt for 16), 16 at a time. Modes alternate, ROUNDS rounds.
# Env: OUT (bench-results/whole), ROUNDS (2), THRESHOLD (256).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/whole}")
source scripts/bench_lib.sh
demo_model small
for round in $(seq 1 "${ROUNDS:-2}"); do
    for mode in handoff whole; do
        rm -rf "$OUT/data"
        extra=(); [ $mode = whole ] && extra=("--router-arg=--whole-threshold=${THRESHOLD:-256}")
        start "llmbus-$mode-$round" 8330 "$PY" -m llmbus.cli up --model "$size=$ROOT/$model" --port 8330 \
            --data-dir "$OUT/data" "${extra[@]}" || continue
        bench 8330 "$mode short" "short-$mode-r$round" --dataset random --num-prompts 128 --input-len 128 \
            --output-len 64 --ignore-eos --max-concurrency 16 --seed 5
        bench 8330 "$mode mixed" "mixed-$mode-r$round" --dataset mixed --num-prompts 128 --ignore-eos \
            --max-concurrency 16 --seed 6
        stop
    done
done
"$PY" -m llmbus.cli bench compare --markdown "$OUT"/short-*.json
"$PY" -m llmbus.cli bench compare --markdown "$OUT"/mixed-*.json

#!/usr/bin/env bash
# Prefill workers pulling a burst only up to their prompt-token budget (docs/benchmarks.md, "A
# burst pulled up to the token budget"). `llmbus up --colocated --prefill 2` on the small demo
# model serves bursty mixed-length load: 128-token chats for 64 tokens, a quarter of them
# 1536-token prompts for 16, gamma arrivals (RATE a second, burstiness BURSTINESS), NUM_PROMPTS
# requests. When BASE_TREE names another checkout of llmbus (a `git worktree` of the tree before
# the change), that tree's service runs the same load, alternating, ROUNDS rounds. Then llama.cpp's
# llama-server on the same weights, 16 slots (skipped without `make peer-llamacpp`).
# Env: OUT (bench-results/pull-budget), ROUNDS (4), BASE_TREE (unset: no A/B), NUM_PROMPTS (384),
#      RATE (40), BURSTINESS (0.1). Round r uses seed r, so base and new see the same arrivals.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/pull-budget}")
source scripts/bench_lib.sh
demo_model small
load=(--dataset mixed --num-prompts "${NUM_PROMPTS:-384}" --input-len 128 --output-len 64 --long-share 0.25
      --long-input-len 1536 --long-output-len 16 --ignore-eos --request-rate "${RATE:-40}"
      --burstiness "${BURSTINESS:-0.1}" --slo ttft:2000 tpot:100)
for round in $(seq 1 "${ROUNDS:-4}"); do
    if [ -n "${BASE_TREE:-}" ] && up_tree "llmbus-base-$round" 8320 "$BASE_TREE" --colocated --prefill 2; then
        bench 8320 "base" "base-r$round" "${load[@]}" --seed "$round"; stop
    fi
    if up_tree "llmbus-$round" 8320 "$ROOT" --colocated --prefill 2; then
        bench 8320 "budget" "budget-r$round" "${load[@]}" --seed "$round"; stop
    fi
done
if [ -x .peers/llamacpp/llama-server ]; then
    SERVED_NAME=$size start llamacpp 8321 bash scripts/peers/run_llamacpp.sh "$model" 8321 16 \
        && bench 8321 "llama.cpp" llamacpp "${load[@]}" --seed 1
    stop
fi
"$PY" -m llmbus.cli bench compare --markdown "$OUT"/{base,budget,llamacpp}*.json

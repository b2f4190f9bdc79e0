#!/usr/bin/env bash
# A request's n choices and bursts sharing a prompt, through the service (docs/benchmarks.md,
# "n choices and prompts in flight"). For each demo model in SIZES:
#   1. random 256-token prompts, 64 output tokens, temperature 0.8, n=4 per request, at
#      concurrency 1 and 4, against `llmbus up --colocated` and llama-server (its n_cmpl, "n");
#   2. shared-prefix bursts (every request at once: 512-token system prompt, 32-token question,
#      32 output tokens) against llmbus and, when BASE_TREE names another checkout of llmbus
#      (a `git worktree`), that tree's service, alternating, ROUNDS times.
# Env: OUT (bench-results/choices), SIZES ("small large"), ROUNDS (3), BASE_TREE (unset: no A/B),
#      GGUF_DIR (bench-results/models: <size>-sp.<f32|bf16>.gguf, made by bench_suite.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/choices}")
source scripts/bench_lib.sh
for size in ${SIZES:-small large}; do
    demo_model "$size"
    if [ "$size" = small ]; then np=32; burst=(--groups 4 --prompts-per-group 16 --max-concurrency 64)
    else np=8; burst=(--groups 2 --prompts-per-group 8 --max-concurrency 16); fi
    choices=(--dataset random --num-prompts $np --input-len 256 --output-len 64 --ignore-eos --temperature 0.8 --warmup 2
             --extra-body '{"n": 4}')
    shared=(--dataset shared-prefix "${burst[@]}" --system-len 512 --question-len 32 --output-len 32 --ignore-eos)
    # 1. n=4 against llama-server
    if up_tree "llmbus-$size" 8300 "$ROOT" --colocated; then
        for c in 1 4; do bench 8300 "llmbus n4 c$c" "$size-llmbus-n4-c$c" "${choices[@]}" --seed $c --max-concurrency $c; done
        stop
    fi
    gguf=$(ls "$GGUF_DIR/$size-sp".*.gguf 2>/dev/null | head -1)
    if [ -x .peers/llamacpp/llama-server ] && [ -n "$gguf" ]; then
        if start "llamacpp-$size" 8200 env SERVED_NAME="$size" bash scripts/peers/run_llamacpp.sh "$gguf" 8200 32; then
            for c in 1 4; do bench 8200 "llamacpp n4 c$c" "$size-llamacpp-n4-c$c" "${choices[@]}" --seed $c --max-concurrency $c; done
            stop
        fi
    else echo "skip llama.cpp: no llama-server or no GGUF of $size in $GGUF_DIR" >&2; fi
    # 2. bursts, alternating with the base tree
    for round in $(seq 1 "${ROUNDS:-3}"); do
        if [ -n "${BASE_TREE:-}" ] && up_tree "base-$size" 8300 "$BASE_TREE" --colocated; then
            bench 8300 "base burst r$round" "$size-base-burst-r$round" "${shared[@]}" --seed $round; stop
        fi
        if up_tree "llmbus-$size" 8300 "$ROOT" --colocated; then
            bench 8300 "llmbus burst r$round" "$size-llmbus-burst-r$round" "${shared[@]}" --seed $round; stop
        fi
    done
done
echo "reports: $OUT"

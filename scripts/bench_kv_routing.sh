#!/usr/bin/env bash
# What routing by cached prefix buys two prefill workers (docs/benchmarks.md, "Routing by cached
# prefix"). `llmbus up --colocated --prefill 2` on the large demo model serves multi-turn chats
# (CONVERSATIONS conversations of TURNS turns, each turn resending the whole history plus a new
# 128-token message, 32 tokens out, CONCURRENCY conversations at a time): "kv" is the default
# router, "lane" the same stack with --router-arg=--no-kv-routing (whichever worker pulls a turn
# first takes it). Modes alternate, ROUNDS rounds. Then llama.cpp's llama-server on the same GGUF
# with one slot per conversation in flight, its own prompt cache and slot choice by prompt
# similarity (skipped without `make peer-llamacpp`). Each llmbus run then also serves 64 random
# 512-token prompts (nothing to reuse: what asking kvpool costs the router), 32 tokens out, 8 at a time.
# Env: OUT (bench-results/kv-routing), ROUNDS (2), CONVERSATIONS (16), TURNS (6), CONCURRENCY (4).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/kv-routing}")
source scripts/bench_lib.sh
demo_model large
load=(--dataset multi-turn --conversations "${CONVERSATIONS:-16}" --turns "${TURNS:-6}" --input-len 128 --output-len 32
      --ignore-eos --max-concurrency "${CONCURRENCY:-4}" --seed 3)
for round in $(seq 1 "${ROUNDS:-2}"); do
    for mode in kv lane; do
        rm -rf "$OUT/data"
        extra=(); [ $mode = lane ] && extra=(--router-arg=--no-kv-routing)
        start "llmbus-$mode-$round" 8310 "$PY" -m llmbus.cli up --model "$size=$ROOT/$model" --port 8310 \
            --data-dir "$OUT/data" --colocated --prefill 2 "${extra[@]}" || continue
        bench 8310 "llmbus $mode" "$mode-r$round" "${load[@]}"
        bench 8310 "llmbus $mode random" "random-$mode-r$round" --dataset random --num-prompts 64 --input-len 512 \
            --output-len 32 --ignore-eos --max-concurrency 8 --seed 4
        curl -s http://127.0.0.1:8310/metrics | grep -E '^llmbus_router_(directed|rescued|lookup)' > "$OUT/$mode-r$round.router.txt"
        stop
    done
done
if [ -x .peers/llamacpp/llama-server ]; then
    SERVED_NAME=$size LLAMA_CTX_PER_SLOT=4096 start llamacpp 8311 bash scripts/peers/run_llamacpp.sh "$model" 8311 \
        "${CONCURRENCY:-4}" && bench 8311 "llama.cpp" llamacpp "${load[@]}"
    stop
fi
"$PY" -m llmbus.cli bench compare --markdown "$OUT"/{kv,lane,llamacpp}*.json
"$PY" -m llmbus.cli bench compare --markdown "$OUT"/random-*.json

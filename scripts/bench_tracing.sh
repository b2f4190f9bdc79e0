#!/usr/bin/env bash
# What tracing costs, through the service (docs/benchmarks.md, "Tracing"): `llmbus up` (every
# service its own process) on the small demo model, tracing off, then on with every request traced
# and each span sent to a local OTLP/HTTP sink (tests/otlp_collector.py); 128-token prompts,
# 32-token answers, at concurrency 1 and 16; ROUNDS rounds, alternating, since the machine is noisy.
# Env: OUT (bench-results/tracing), ROUNDS (2).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/tracing}")
source scripts/bench_lib.sh
demo_model small
"$PY" - > "$OUT/sink.log" 2>&1 <<PY &
import sys, time
sys.path.insert(0, "$ROOT")
from tests.otlp_collector import Collector
c = Collector()
open("$OUT/sink.url", "w").write(c.url)
while True:
    time.sleep(5)
    print(len(c.spans), "spans", flush=True)
PY
SINK=$!
trap 'stop; kill $SINK 2>/dev/null' EXIT
for _ in $(seq 1 50); do [ -s "$OUT/sink.url" ] && break; sleep 0.2; done
url=$(cat "$OUT/sink.url")
for round in $(seq 1 "${ROUNDS:-2}"); do
    for mode in off on; do
        rm -rf "$OUT/data"
        tracing=(env); [ $mode = on ] && tracing=(env OTEL_EXPORTER_OTLP_ENDPOINT="$url")
        start "llmbus-$mode-$round" 8300 "${tracing[@]}" "$PY" -m llmbus.cli up --model "$size=$ROOT/$model" \
            --port 8300 --data-dir "$OUT/data" || continue
        for c in 1 16; do
            bench 8300 "tracing $mode c$c" "$mode-c$c-r$round" --dataset random --num-prompts $(( c == 1 ? 16 : 96 )) \
                --input-len 128 --output-len 32 --ignore-eos --temperature 0.8 --warmup 1 --max-concurrency $c --seed $c
        done
        stop
    done
done

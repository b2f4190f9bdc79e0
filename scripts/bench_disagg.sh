#!/bin/bash
# Disaggregated (one prefill + one decode process) vs colocated (one worker doing both), same 2 cores,
# on `mixed`: short chat requests with long prompts interleaved.
# usage: [MODES=disaggregated] bash scripts/bench_disagg.sh [MODEL_DIR]
cd "$(dirname "$0")/.."
M=${1:-bench-results/models/large-sp}
OUT_DIR=${OUT_DIR:-bench-results}
MIXED="--dataset mixed --num-prompts 32 --input-len 64 --output-len 64 --long-share 0.125 --long-input-len 1024 --long-output-len 8 --ignore-eos --request-rate 2 --slo ttft:2000 tpot:100"
for mode in ${MODES:-disaggregated colocated}; do
  extra=""; [ $mode = colocated ] && extra="--colocated --threads 2"
  [ $mode = disaggregated ] && extra="--threads 1"
  rm -rf /tmp/llmbus-$mode
  .venv/bin/llmbus up --model bench=$M --port 8600 --data-dir /tmp/llmbus-$mode $extra > /tmp/llmbus-$mode.log 2>&1 &
  pid=$!
  # the whole stack up (the gateway answers before kvpool and the workers have started)
  for i in $(seq 1 240); do grep -q "llmbus up: ready" /tmp/llmbus-$mode.log && break; sleep 1; done
  .venv/bin/llmbus bench serve --base-url http://127.0.0.1:8600 --model bench --tokenizer $M $MIXED --no-progress \
     --label "$mode" --out $OUT_DIR/$mode-mixed.json | grep -E "output throughput|short|long"
  kill -INT $pid; wait $pid
done
.venv/bin/llmbus bench compare --markdown $OUT_DIR/disaggregated-mixed.json $OUT_DIR/colocated-mixed.json

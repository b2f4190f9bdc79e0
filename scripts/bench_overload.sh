#!/bin/bash
# Steadiness under overload, disaggregated layout (prefill + decode + kvpool): bursts that cannot all
# fit at once must queue and complete, not fail. Two scenarios on the small demo model:
#   decode-blocks: a decode cache of 64 blocks, 8 concurrent 500-token prompts (35 blocks each as
#                  they decode): each fits alone, not together;
#   kvpool-full:   kvpool of 300 blocks, decode at 4 sequences, 40 concurrent 200/300 requests: the
#                  handoffs' leases fill kvpool while decode works through them.
# Prints each scenario's summary; "failed" must be 0.
# usage: bash scripts/bench_overload.sh [MODEL_DIR]   (OUT_DIR, PORT optional)
cd "${LLMBUS_SRC:-$(dirname "$0")/..}"
M=${1:-bench-results/models/small-sp}
[ -d "$M" ] || .venv/bin/llmbus demo-model --size small --tokenizer sentencepiece --out "$M" > /dev/null
OUT_DIR=${OUT_DIR:-bench-results}
PORT=${PORT:-8610}
mkdir -p "$OUT_DIR"
run() {  # NAME "up options" "bench options"
  local name=$1 data=/tmp/llmbus-overload-$1
  rm -rf "$data"
  # shellcheck disable=SC2086
  .venv/bin/llmbus up --model bench="$M" --port "$PORT" --data-dir "$data" --threads 1 $2 > "$data.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do grep -q "llmbus up: ready" "$data.log" && break; sleep 1; done
  # shellcheck disable=SC2086
  .venv/bin/llmbus bench serve --base-url "http://127.0.0.1:$PORT" --model bench --tokenizer "$M" --dataset random \
      --ignore-eos --no-progress --label "$name" --out "$OUT_DIR/overload-$name.json" $3 | grep -E "requests|failed"
  kill -INT $pid; wait $pid
}
run decode-blocks "--worker-arg=--num-blocks=64 --worker-arg=--max-num-seqs=16" \
    "--num-prompts 8 --max-concurrency 8 --input-len 500 --output-len 50"
run kvpool-full "--kvpool-blocks 300 --worker-arg=--num-blocks=512 --worker-arg=--max-num-seqs=4" \
    "--num-prompts 40 --max-concurrency 40 --input-len 200 --output-len 300"

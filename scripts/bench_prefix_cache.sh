#!/bin/bash
# usage: bash scripts/bench_prefix_cache.sh   (expects bench-results/models/large-sp)
# issue 5: shared-prefix throughput, prefix cache on vs off, large demo model, through the service
cd /work/main
M=bench-results/models/large-sp
for mode in on off; do
  extra=""
  [ $mode = off ] && extra="--worker-arg=--no-prefix-cache"
  rm -rf /tmp/pfx-$mode
  .venv/bin/llmbus up --model large=$M --port 8400 --data-dir /tmp/pfx-$mode $extra > /tmp/bench/prefix-$mode.server.log 2>&1 &
  pid=$!
  # the whole stack up (the gateway answers before kvpool and the workers have started)
  for i in $(seq 1 240); do grep -q "llmbus up: ready" /tmp/bench/prefix-$mode.server.log && break; sleep 1; done
  .venv/bin/llmbus bench serve --base-url http://127.0.0.1:8400 --model large --tokenizer $M --dataset shared-prefix \
     --groups 4 --prompts-per-group 8 --system-len 1024 --question-len 64 --output-len 16 --ignore-eos \
     --max-concurrency 8 --no-progress --label "prefix cache $mode" --out bench-results/prefix-$mode.json | grep -E "output throughput|TTFT"
  kill -INT $pid; wait $pid
done
.venv/bin/llmbus bench compare --markdown bench-results/prefix-on.json bench-results/prefix-off.json

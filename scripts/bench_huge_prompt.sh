#!/bin/bash
# One client's huge prompt against everyone else (scripts/huge_prompt.py): `/health` while three
# 3.9 MB chat prompts are in the gateway, and how long their refusal takes. With BASE (a checkout
# of another llmbus revision) that tree runs first, then this one, on the same machine.
# usage: [BASE=/path/to/checkout] bash scripts/bench_huge_prompt.sh   (OUT, PORT optional)
cd "${LLMBUS_SRC:-$(dirname "$0")/..}"
OUT=${OUT:-bench-results/huge-prompt}
PORT=${PORT:-8620}
source scripts/bench_lib.sh
demo_model small
for tree in ${BASE:+"$BASE"} "$ROOT"; do
    name=llmbus-$([ "$tree" = "$ROOT" ] && echo head || echo base)
    up_tree "$name" "$PORT" "$tree" || continue
    echo "$name ($(git -C "$tree" rev-parse --short HEAD)):"
    "$PY" scripts/huge_prompt.py "http://127.0.0.1:$PORT" "$size"
    stop
done

#!/usr/bin/env bash
# A decode worker restarted under load (docs/benchmarks.md, "A decode worker restarted under
# load"): `llmbus up` on the small demo model (one prefill, one decode worker) plus a second decode
# worker started beside it on the same bus; random 128-token prompts for OUTPUT_LEN tokens at RATE a
# second, NUM_PROMPTS of them; KILL_AT seconds in, the second decode worker gets SIGTERM (as a
# rolling restart sends) while a replacement starts beside it (a rolling update with surge). What matters:
# requests that failed. When BASE_TREE names another checkout of llmbus (a `git worktree` of the
# tree before workers drained at SIGTERM), its stack runs the same load first, each round.
# Env: OUT (bench-results/restart), ROUNDS (2), BASE_TREE (unset: no A/B), RATE (12), OUTPUT_LEN (512),
#      NUM_PROMPTS (96), KILL_AT (6).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-results/restart}")
source scripts/bench_lib.sh
demo_model small
load=(--dataset random --num-prompts "${NUM_PROMPTS:-96}" --input-len 128 --output-len "${OUTPUT_LEN:-512}" --ignore-eos
      --request-rate "${RATE:-12}")
extra_worker() {  # a decode worker of its own beside run's `llmbus up` (its name, tree and url), from the
    # tree's directory: `python -m` searches there first
    local ready; ready=$(grep -c "llmbus-ready" "$OUT/$name.extra.log")
    (cd "$tree" && exec env PYTHONPATH="$tree" "$PY" -m services.decode --nats-url "$url" \
        --model "$size=$ROOT/$model") >> "$OUT/$name.extra.log" 2>&1 & extra=$!
    for _ in $(seq 1 120); do
        [ "$(grep -c "llmbus-ready" "$OUT/$name.extra.log")" -gt "$ready" ] && break; sleep 0.5
    done
}
run() {  # name tree
    local name=$1 tree=$2 url extra
    up_tree "$name" 8330 "$tree" || return 1
    url=$(grep -o "nats-server at nats://[0-9.:]*" "$OUT/$name.log" | head -1 | cut -d' ' -f3)
    : > "$OUT/$name.extra.log"
    extra_worker
    bench 8330 "$name" "$name" "${load[@]}" &
    local client=$!
    sleep "${KILL_AT:-6}"
    echo "$(date -u +%T) SIGTERM to the second decode worker; its replacement starts" >> "$OUT/$name.extra.log"
    local old=$extra
    kill -TERM $old
    extra_worker  # (as a rolling update with surge: the new one comes up while the old one stops)
    wait $old
    echo "$(date -u +%T) the old one exited ($?)" >> "$OUT/$name.extra.log"
    wait $client
    kill -TERM $extra; wait $extra
    stop
}
for round in $(seq 1 "${ROUNDS:-2}"); do
    [ -n "${BASE_TREE:-}" ] && run "base-r$round" "$BASE_TREE"
    run "drain-r$round" "$ROOT"
done
"$PY" -m llmbus.cli bench compare --markdown "$OUT"/{base,drain}-r*.json

#!/usr/bin/env bash
# One device session's worth of GPU checks: kernel tests natively, the kernel bandwidth table, and
# the engine's decode throughput on the large demo model (or, with TRAINED_EVAL=1, KV-quantization
# accuracy). Writes everything under ${OUT:-bench-results}.
set -u
OUT="${OUT:-bench-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
# PARTS picks the checks, run in this order of importance: warm-up (the kernel table's launches
# compiled once, untimed, by one process per KV format in parallel: Triton compiles a kernel on one
# core, and the table compiles ~100 variants, which alone took most of a part's limit before), the
# kernel table (every kernel against
# its reference, then decode bandwidth: issue 4's goal), the static cost of the decode loops as this
# machine's Triton compiles them (scripts/kernel_cost.py, beside the measured bandwidth), the kernel
# tests, the engine's decode throughput, the graph tests. Their own timeouts add up to more than one device call, so all of
# them share DEADLINE seconds (default 540, inside a 600-second call): each gets what is left, and
# one that would start with less than its minimum left (30 s; the engine 90 s: it first generates
# the model) is skipped. $OUT/timing.txt says what each took and how it ended (124: timed out).
PARTS="${PARTS:-warm kernels cost tests engine graphs}"
DEADLINE="${DEADLINE:-540}"
# each part's own limit (seconds) and the kernel table's options
WARM_S="${WARM_S:-200}" KERNELS_S="${KERNELS_S:-240}" TESTS_S="${TESTS_S:-200}" ENGINE_S="${ENGINE_S:-240}" GRAPHS_S="${GRAPHS_S:-150}"
KERNEL_ARGS="${KERNEL_ARGS:---quick --sweep --sweep-at 64,8192 --sweep-at 256,32768}"
part() { [[ " $PARTS " == *" $1 "* ]]; }
t0=$SECONDS
# budget N NAME [MIN]: N seconds, or what is left before the deadline if less; fails (the part is
# skipped) with less than MIN (default 30) left
budget() {
    local left=$((DEADLINE - (SECONDS - t0)))
    if [ "$left" -lt "${3:-30}" ]; then echo "skipped $2: ${left}s left of ${DEADLINE}s" | tee -a "$OUT/timing.txt" >&2; return 1; fi
    echo $(($1 < left ? $1 : left))
}
# took NAME START LIMIT RC
took() { echo "$1: $((SECONDS - $2))s (limit $3s, exit $4)" >> "$OUT/timing.txt"; }
: > "$OUT/timing.txt"
if [ "${TRAINED_EVAL:-0}" != 1 ]; then
    if part warm && part kernels && lim=$(budget "$WARM_S" warm); then
        s=$SECONDS
        # NOTE: the processes hold their formats' caches at once: ~71 GB at 256 x 32,768 (bf16 34,
        # INT8 17, INT4 10, INT4R 9); on an 80 GB GPU name fewer in WARM_FORMATS
        pids=() codes=() formats="${WARM_FORMATS:-model int8 int4 int4r}"
        for fmt in $formats; do
            # shellcheck disable=SC2086
            timeout "$lim" python3 scripts/bench_gpu.py $KERNEL_ARGS --compile-only --formats "$fmt" \
                --out "$OUT/warm-$fmt.json" > "$OUT/warm-$fmt.log" 2>&1 &
            pids+=("$!")
        done
        # each process's own exit (124: cut by the limit, so the timed run compiles the rest; 1: a
        # check failed; other: a crash, its traceback in warm-FORMAT.log)
        for pid in "${pids[@]}"; do wait "$pid"; codes+=("$?"); done
        grep -h -E "^FAIL|ERROR|Error" "$OUT"/warm-*.log | head -20
        took warm $s "$lim" "$formats: ${codes[*]}"
    fi
    if part kernels && lim=$(budget "$KERNELS_S" kernels); then
        s=$SECONDS
        # shellcheck disable=SC2086
        # the whole output in gpu-kernels.log (the sweep alone is ~50 lines); the JSON is rewritten
        # after each stage, so a timeout keeps the stages done
        timeout "$lim" python3 scripts/bench_gpu.py $KERNEL_ARGS --out "$OUT/gpu-kernels.json" 2>&1 \
            | tee "$OUT/gpu-kernels.log" | tail -60 | tee "$OUT/gpu-kernels.txt"
        took kernels $s "$lim" "${PIPESTATUS[0]}"
    fi
    if part cost && lim=$(budget 60 cost); then
        s=$SECONDS
        timeout "$lim" python3 scripts/kernel_cost.py --json "$OUT/kernel-cost.json" 2>&1 | tail -8 \
            | tee "$OUT/kernel-cost.txt"
        took cost $s "$lim" "${PIPESTATUS[0]}"
    fi
    if part tests && lim=$(budget "$TESTS_S" tests); then
        s=$SECONDS
        # in parallel where pytest-xdist is installed (the H200's image has it): compiling dominates
        # and verbose (-q would cancel -v), so a run cut by its limit still names each test's outcome
        jobs=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TESTS_JOBS:-8} -v" || echo -q)
        # shellcheck disable=SC2086
        timeout "$lim" python3 -m pytest -p no:cacheprovider -rf $jobs tests/test_kernels_decode.py \
            tests/test_kernels_prefill.py tests/test_kernels_write_kv.py tests/test_kernels_backends.py tests/test_kernels_fused.py \
            > "$OUT/kernel-tests.log" 2>&1
        rc=$?
        grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR) |passed|failed" "$OUT/kernel-tests.log" | tail -40 | tee "$OUT/kernel-tests.txt"
        took tests $s "$lim" $rc
        # failures: the same tests with the plain-Triton conversions, to tell the inline PTX apart
        failed=$(grep -E "^FAILED |\] FAILED " "$OUT/kernel-tests.log" | grep -oE "tests/[^ ]+" | sort -u | head -40)
        if [ -n "$failed" ] && lim=$(budget 90 tests-no-asm); then
            s=$SECONDS
            LLMBUS_TRITON_ASM=0 timeout "$lim" python3 -m pytest -q -p no:cacheprovider -rf $failed 2>&1 | tail -20 \
                | tee "$OUT/kernel-tests-no-asm.txt"
            took tests-no-asm $s "$lim" "${PIPESTATUS[0]}"
        fi
    fi
    # every row eagerly and replayed; the JSON is rewritten after each row, so a timeout keeps the
    # rows done
    if part engine && lim=$(budget "$ENGINE_S" engine 90); then
        s=$SECONDS
        timeout "$lim" python3 scripts/bench_gpu_engine.py --batches 1,32,128 --graphs both \
            --out "$OUT/gpu-engine.json" 2>&1 | tail -30 | tee "$OUT/gpu-engine.txt"
        took engine $s "$lim" "${PIPESTATUS[0]}"
    fi
    # decode steps recorded as CUDA graphs and replayed give the eager steps' tokens
    if part graphs && lim=$(budget "$GRAPHS_S" graphs); then
        s=$SECONDS
        timeout "$lim" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_graphs.py 2>&1 \
            | tail -5 | tee "$OUT/graph-tests.txt"
        took graphs $s "$lim" "${PIPESTATUS[0]}"
    fi
    cat "$OUT/timing.txt"
fi
# TRAINED_EVAL=1 runs this instead of the checks above (a device call of its own, up to ~10
# minutes; needs transformers): KV-quantization accuracy through the Triton kernels on the large
# demo model's architecture trained on real text (scripts/train_demo_model.py, about a minute on a
# GPU), teacher-forced by decode steps and by prefill (docs/benchmarks.md). The checkpoint stays on the
# device (~200 MB); the figures come back under $OUT. The GPU run trains with the bpe tokenizer, so
# its windows of text differ from the CPU run's (sentencepiece).
if [ "${TRAINED_EVAL:-0}" = 1 ]; then
    if ! python3 -c "import transformers" 2>/dev/null; then
        echo "TRAINED_EVAL=1 but transformers is not installed: skipped" | tee "$OUT/kvquant-trained.txt"
    else
        CKPT="${TMPDIR:-/tmp}/llmbus-large-trained"
        BASE=$(python3 -c "from llmbus.model.demo import ensure_demo_model; print(ensure_demo_model('large'))")
        timeout 240 python3 scripts/train_demo_model.py --base "$BASE" --out "$CKPT" --device cuda > "$OUT/train.txt" 2>&1
        rc=$?
        tail -3 "$OUT/train.txt"
        : > "$OUT/kvquant-trained.txt"
        if [ $rc -ne 0 ]; then
            echo "training failed (rc $rc): evaluation skipped" | tee -a "$OUT/kvquant-trained.txt"
        else
            for path in decode prefill; do
                timeout 240 python3 scripts/eval_kv_quant.py --model-dir "$CKPT" --text stdlib --path $path \
                    --seqs 32 --tokens 256 --controls --out "$OUT/kvquant-trained-$path.json" 2>&1 | tail -8 \
                    | tee -a "$OUT/kvquant-trained.txt"
            done
            # a prompt's prefill pass, then decode steps (scored on those), as a request is served
            timeout 180 python3 scripts/eval_kv_quant.py --model-dir "$CKPT" --text stdlib --path mixed \
                --seqs 32 --tokens 256 --controls --out "$OUT/kvquant-trained-mixed.json" 2>&1 | tail -8 \
                | tee -a "$OUT/kvquant-trained.txt"
            # INT4 over 32-token blocks (its keys' ranges shared by twice the tokens: bench_gpu.BLOCK_SWEEP)
            timeout 180 python3 scripts/eval_kv_quant.py --model-dir "$CKPT" --text stdlib --seqs 32 --tokens 256 \
                --formats int4 --block-size 32 --out "$OUT/kvquant-trained-decode-int4-bs32.json" 2>&1 | tail -4 \
                | tee -a "$OUT/kvquant-trained.txt"
        fi
    fi
fi

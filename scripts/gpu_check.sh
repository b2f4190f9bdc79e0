#!/usr/bin/env bash
# One device session's worth of GPU checks: kernel tests natively, the kernel bandwidth table, and
# the engine's decode throughput on the large demo model. Writes everything under ${OUT:-bench-results}.
set -u
OUT="${OUT:-bench-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py tests/test_kernels_prefill.py \
    tests/test_kernels_write_kv.py tests/test_kernels_backends.py 2>&1 | tail -5 | tee "$OUT/kernel-tests.txt"
timeout 100 python3 scripts/bench_gpu.py --out "$OUT/gpu-kernels.json" 2>&1 | tail -45 | tee "$OUT/gpu-kernels.txt"
timeout 200 python3 scripts/bench_gpu_engine.py --batches 1,32,128 --out "$OUT/gpu-engine.json" 2>&1 | tail -25 | tee "$OUT/gpu-engine.txt"

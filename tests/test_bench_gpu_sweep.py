"""scripts/bench_gpu.py's launch sweep: its first launch per format (and per shared loop) is the wrapper's
CUDA default."""

import importlib.util
from pathlib import Path

from kernels.paged_decode import CUDA_LAUNCH, SHARED_LAUNCH


def test_the_sweep_starts_at_each_formats_default_launch():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert set(bench.SWEEP) == set(CUDA_LAUNCH)
    for fmt, launches in bench.SWEEP.items():
        assert launches[0] == CUDA_LAUNCH[fmt]
        assert all(len(launch) == 4 for launch in launches), launches
    assert set(bench.SHARED_SWEEP) == set(SHARED_LAUNCH)
    for fmt, launches in bench.SHARED_SWEEP.items():
        assert launches[0] == SHARED_LAUNCH[fmt]

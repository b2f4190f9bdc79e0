"""scripts/bench_gpu.py's launch sweep: its first launch per format (and per shared loop) is the wrapper's
CUDA default; the shapes it sweeps suit every block size it reads."""

import argparse
import importlib.util
from pathlib import Path

import pytest

from llmbus.kernels.paged_decode import CUDA_LAUNCH, SHARED_LAUNCH


def _bench():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_sweep_starts_at_each_formats_default_launch():
    bench = _bench()
    assert set(bench.SWEEP) == set(CUDA_LAUNCH)
    for fmt, launches in bench.SWEEP.items():
        assert launches[0] == CUDA_LAUNCH[fmt]
        assert all(len(launch) == 4 for launch in launches), launches
    assert set(bench.SHARED_SWEEP) == set(SHARED_LAUNCH)
    for fmt, launches in bench.SHARED_SWEEP.items():
        assert launches[0] == SHARED_LAUNCH[fmt]


def test_swept_contexts_are_whole_blocks_of_every_size_the_sweep_reads():
    """INT4 is also timed over 32-token blocks (BLOCK_SWEEP): a context of 16-token blocks that
    is not whole 32-token blocks would leave its last block out of those rows' tables."""
    bench = _bench()
    assert set(bench.BLOCK_SWEEP) <= set(bench.SWEEP) and bench.BLOCK_SWEEP["int4"] == [32]
    assert bench._shape("64,8192") == (64, 8192)
    with pytest.raises(argparse.ArgumentTypeError, match="multiple of 32"):
        bench._shape("64,8208")

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


def _small(monkeypatch):
    """The script's module on CPU at small sizes (2 KV heads of 64 channels, 4 query heads each;
    short sequences and split): its kernels run under the Triton interpreter."""
    bench = _bench()
    for name, value in dict(DEVICE="cpu", HQ=8, HKV=2, D=64, LENS=[1, 17, 40], QLENS=[1, 5, 20], LONG=205).items():
        monkeypatch.setattr(bench, name, value)
    return bench


@pytest.mark.parametrize("fmt", ["model", "int8", "int4", "int4r"])
def test_the_scripts_checks_pass_against_the_references(fmt, monkeypatch):
    """What a device session runs first (check_kernels: write, decode, prefill, over both storages,
    GQA groups of 1, 2 and 8, the exact chunk, a long split) runs here too, so a mistake in the
    script shows in CI rather than on a lent GPU."""
    bench = _small(monkeypatch)
    rows = bench.check_kernels(sweep=False, formats=(fmt,))
    names = {r["kernel"] for r in rows}
    assert {"write_kv", "paged_decode split-K group 1", "paged_prefill group 1", "paged_prefill exact chunk"} <= names
    assert all(r["fmt"] == fmt for r in rows)
    assert [r for r in rows if not r["ok"]] == []


def test_compile_only_runs_every_launch_of_the_sweep_and_table_once(monkeypatch):
    """--compile-only (the warm-up's processes): every sweep launch and every launch the table may
    take, each run once and untimed."""
    bench = _small(monkeypatch)
    monkeypatch.setattr(bench, "COMPILE_ONLY", True)
    seen = []
    real = bench.paged_decode_attention
    monkeypatch.setattr(bench, "paged_decode_attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    rows, best = bench.sweep_launch(None, 2, 64, ("int8",))
    launches = len(bench.SWEEP["int8"]) + len(bench.SHARED_SWEEP["int8"])
    assert len(rows) >= launches + 1 and all(r["ms"] == 1.0 for r in rows)  # + the other storage
    assert set(best) == {"int8"}
    seen.clear()
    table = bench.bench_decode([1], [64], None, best, ("int8",))
    assert len(table) == 1 and len(seen) == len(bench.every_best("int8")) + 1
    assert {kw["tile"] for kw in seen} == {t for t, *_ in bench.SWEEP["int8"] + bench.SHARED_SWEEP["int8"]}

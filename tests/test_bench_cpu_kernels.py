"""scripts/bench_kv_write.py and scripts/bench_cpu_attention.py, the harnesses behind docs/benchmarks.md's
CPU KV write and decode attention figures: they run end to end on small shapes, every format."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmbus.kernels import cpu_native

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
needs_kernel = pytest.mark.skipif(not cpu_native.available(), reason="the C kernels did not build here")


@needs_kernel
def test_kv_write_bench_times_every_format(tmp_path):
    out = tmp_path / "write.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_kv_write.py"), "--tokens", "100", "--runs", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == ["int8", "int4", "int4r"]
    assert all(r["c_ms"] > 0 and r["torch_ms"] > 0 for r in rows)
    assert "int4r  C" in proc.stdout


@needs_kernel
@pytest.mark.parametrize("fmt", ["model", "int8", "int4", "int4r"])
def test_attention_bench_times_every_format(fmt):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_cpu_attention.py"), "--hot", "--batch", "2",
                           "--steps", "2", "--kv-format", fmt], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{fmt} hot: 12 layers, batch 2: median ") and " GB/s)" in proc.stdout

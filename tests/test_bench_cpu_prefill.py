"""scripts/bench_cpu_prefill.py, the harness behind docs/benchmarks.md's quantized-prefill figures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmbus.bench.tinymodel import write_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny")), hidden=64, layers=2, heads=2, kv_heads=1, vocab_size=300)


def test_prefill_bench_times_every_format(model_dir, tmp_path):
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "bench_cpu_prefill.py")
    out = tmp_path / "prefill.json"
    proc = subprocess.run([sys.executable, script, "--model-dir", str(model_dir), "--batch", "2", "--prompt-len", "40",
                           "--runs", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2 and all(set(r) == {"model", "int8", "int4"} and min(r.values()) > 0 for r in runs)


def test_prefill_bench_puts_a_cached_prefix_before_the_first_prompt(model_dir, tmp_path):
    """``--cached-prefix``: the timed steps find the prefix's full blocks cached (16-token blocks:
    48 tokens, 3 blocks) for the first prompt, none for the fresh ones."""
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "bench_cpu_prefill.py")
    out = tmp_path / "prefill.json"
    proc = subprocess.run([sys.executable, script, "--model-dir", str(model_dir), "--batch", "3", "--prompt-len", "20",
                           "--runs", "1", "--cached-prefix", "48", "--kv-formats", "int8,int4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["cached_tokens"] == [{"int8": 48, "int4": 48}] and min(got["runs"][0].values()) > 0

"""llmbus.engine.omp: a worker process keeps one OpenMP team, the engine thread's.

OpenMP pools are process-wide state, so each case runs in a fresh interpreter and reports how many
OS threads the process has after each stage (a thread's pool adds threads that outlive the op)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from llmbus.engine.omp import on_own_thread, serial_here

    torch.set_num_threads(2)
    def count():
        return len(os.listdir("/proc/self/task"))
    def settled(want):  # an exiting pool's threads leave asynchronously
        for _ in range(200):
            if count() == want:
                break
            time.sleep(0.01)
        return count()
    def parallel_op():
        x = torch.ones(1 << 22)
        x.add_(1)  # 4M elements: far over torch's grain size, so it runs as an OpenMP region
        return float(x[0])

    out = {"start": count()}
    if sys.argv[1] == "serial":
        out["serial"] = serial_here()
        out["main_threads"] = torch.get_num_threads()
    parallel_op()
    out["after_main_op"] = count()
    out["built"] = on_own_thread(parallel_op)
    out["after_short_thread"] = settled(out["after_main_op"])
    print(json.dumps(out))
""")


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_serial_thread_starts_no_team_and_a_short_thread_takes_its_team_along():
    control = _run("plain")
    assert control["after_main_op"] > control["start"], "a parallel op on main should leave an OpenMP pool"

    out = _run("serial")
    assert out["serial"] is True and out["main_threads"] == 1
    assert out["after_main_op"] == out["start"], "a serial thread must not start OpenMP threads"
    assert out["built"] == 2.0
    assert out["after_short_thread"] == out["start"], "a finished build thread's pool must go with it"


def test_on_own_thread_returns_and_raises_on_the_caller():
    import threading

    from llmbus.engine.omp import on_own_thread

    caller = threading.get_ident()
    assert on_own_thread(lambda: threading.get_ident()) != caller
    with pytest.raises(FileNotFoundError, match="no model"):
        on_own_thread(lambda: (_ for _ in ()).throw(FileNotFoundError("no model")))

"""How `llmbus up` supervises: its shutdown gives each service group SIGTERM and a bounded wait,
then SIGKILL, and says which service needed it; and `up` itself stays a small process (no torch)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from llmbus.launch import Child, _start, _stop
from llmbus.model.demo import ensure_demo_model

# prints its readiness, then exits on SIGTERM (Python's default) or ignores it
OBEYS = "import time; print('llmbus-ready probe x', flush=True); time.sleep(120)"
IGNORES = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "print('llmbus-ready probe x', flush=True); time.sleep(120)")  # fmt: skip


def _started(name: str, code: str) -> Child:
    child = Child(name, [sys.executable, "-c", code])
    _start(child)
    assert child.ready.wait(60), f"{name} never reported ready"
    return child


def test_a_service_that_ignores_sigterm_is_killed_and_named(capsys):
    kvpool, router = _started("kvpool", IGNORES), _started("router", OBEYS)
    try:
        _stop([kvpool, router], timeout=1.0)
        assert router.proc.returncode == -15 and kvpool.proc.returncode == -9
        out = capsys.readouterr()
        assert "llmbus up: router stopped in " in out.out
        assert "llmbus up: kvpool did not stop within 1s of SIGTERM; killed" in out.err
    finally:
        for c in (kvpool, router):
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()


def test_what_a_service_started_stops_with_it(tmp_path):
    """A service's children (a C compiler building the CPU kernels, say) are in its process group:
    they get its SIGTERM, and one that outlives it is killed; none is left running after `up`."""
    pids = tmp_path / "pids"
    code = (f"import subprocess, sys, time; kids = [subprocess.Popen([sys.executable, '-c', c]) for c in ("
            "'import time; time.sleep(120)', "
            "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)')]; "
            f"open({str(pids)!r}, 'w').write(' '.join(str(k.pid) for k in kids)); time.sleep(1); "
            "print('llmbus-ready probe x', flush=True); time.sleep(120)")  # fmt: skip
    worker = _started("prefill-0", code)
    kids = [int(p) for p in pids.read_text().split()]
    try:
        _stop([worker], timeout=5.0)
        assert worker.proc.returncode == -15
        for pid in kids:  # gone, or a zombie its dead parent left to init
            for _ in range(100):
                try:
                    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
                except FileNotFoundError:
                    break
                if state == "Z":
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"child {pid} of the stopped service is still running")
    finally:
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_up_plans_the_stack_without_importing_torch(tmp_path, monkeypatch):
    """`up` only supervises: kvpool's block size comes from the model's config and the KV format,
    not through the engine (torch: ~200 MB resident, and seconds to start and exit on a busy
    machine). The size is the one the workers' kvpool clients use (``kv_block_bytes``), for the
    model's layout."""
    monkeypatch.setenv("LLMBUS_DATA_DIR", str(tmp_path))
    model = ensure_demo_model("small")  # the model `up` serves by default, under $LLMBUS_DATA_DIR
    code = f"""
import sys
from pathlib import Path
from llmbus.cli import build_parser
from llmbus.launch import _models, _plan
# the default model (`make serve`), found where `up` looks for it
default = build_parser().parse_args(["up"])
assert [p for _, p in _models(default, Path("{tmp_path}"))] == ["{model}"]
args = build_parser().parse_args(["up", "--model", "demo={model}", "--kv-format", "int4r"])
plan = _plan(args, "nats://127.0.0.1:4222", _models(args, None))
assert "torch" not in sys.modules, "up imported torch"
argv = next(c.argv for c in plan if c.name == "kvpool")
print(argv[argv.index("--block-bytes") + 1])
from llmbus.kv.formats import kv_block_bytes
from llmbus.model.config import ModelConfig
cfg = ModelConfig.from_file(Path("{model}") / "config.json")
print(kv_block_bytes(cfg.kv_layout(16, cfg.dtype), "int4r"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    planned, reference = out.stdout.split()
    assert int(planned) == int(reference) > 0

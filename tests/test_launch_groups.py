"""`llmbus up` starts each service (and nats-server) in a process group of its own, so a terminal's
Ctrl-C reaches only `up`, but inside `up`'s session: Linux schedules each session as one group
("autogroup"), and a session per service made the scheduler share the cores between services as
groups, whatever their threads' nice values or scheduling classes."""

from __future__ import annotations

import os
import sys
import time

from llmbus.bus.server import EmbeddedNats
from llmbus.launch import Child, _start

PROBE = "import os, sys; print('ids', os.getsid(0), os.getpgid(0), os.getpid(), flush=True); sys.stdin.read()"


def _ids_line(capsys, deadline_s: float = 20.0) -> list[int]:
    seen = ""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        seen += capsys.readouterr().out
        for line in seen.splitlines():
            if line.startswith("[probe] ids "):
                return [int(x) for x in line.split()[2:]]
        time.sleep(0.05)
    raise AssertionError(f"the child never reported its ids; output: {seen!r}")


def test_a_service_runs_in_its_own_process_group_inside_ups_session(capsys):
    child = Child("probe", [sys.executable, "-c", PROBE])
    _start(child)
    try:
        sid, pgid, pid = _ids_line(capsys)
        assert pid == child.proc.pid
        assert pgid == pid, "the service must not share the terminal's foreground process group"
        assert pgid != os.getpgid(0)
        assert sid == os.getsid(0), "the service must stay in the launcher's session (one scheduler autogroup)"
    finally:
        child.proc.kill()
        child.proc.wait()


def test_the_embedded_nats_server_is_grouped_the_same_way(tmp_path):
    with EmbeddedNats(tmp_path / "nats") as server:
        pid = server._proc.pid
        assert os.getpgid(pid) == pid
        assert os.getsid(pid) == os.getsid(0)

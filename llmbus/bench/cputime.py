"""CPU seconds used by a process tree (the server under test), read from /proc."""

from __future__ import annotations

import os


def children_map() -> dict[int, list[int]]:
    """Each live process's children, by parent pid."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _own_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[11], [12] are utime, stime (stat fields 14, 15), in clock ticks
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pids: list[int]) -> float:
    """utime+stime of each pid and all its live descendants.

    NOTE: take a reading before and after the run and subtract; descendants that exit during the
    run take their CPU time with them, so keep the server's workers alive across the run.
    """
    if not os.path.isdir("/proc"):
        raise ValueError("CPU accounting of server processes needs /proc (Linux)")
    kids = children_map()
    seen: set[int] = set()
    stack = list(pids)
    total = 0.0
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            total += _own_cpu_s(pid)
        except (OSError, ValueError):
            if pid in pids:
                raise ValueError(f"no process with pid {pid} (--server-pid)") from None
            continue
        stack.extend(kids.get(pid, []))
    return total

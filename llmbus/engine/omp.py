"""One OpenMP team per process: why an engine-driving service keeps torch's threads to its engine.

libgomp, the OpenMP runtime in torch's CPU builds, keeps a pool of threads for every thread that
ever ran a parallel region, and counts them all together. Once that count exceeds the CPUs, every
thread stops spinning at a barrier and sleeps at once, so each of the hundreds of parallel regions
in a decode step ends in a futex sleep and a wake-up. In a service the engine steps on its own
thread while the asyncio thread loads the model and copies KV bytes; measured on 2 vCPUs (large
demo model, batch 32, nothing else running): one parallel op run beforehand on another thread took
a decode step from 36-39 ms to 43-45 ms, with ~10,000 voluntary context switches per 50 steps
instead of ~10.

So a worker builds its engine on a thread that exits afterwards (its pool goes with it), and makes
its asyncio thread serial (torch ops there run on that thread alone; they are small copies).
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_RUNTIME = re.compile(r"/lib(g|i|)omp[0-9]*(-[0-9a-f]+)?\.so[.0-9]*$")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_looked = False


def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded into this process (libgomp, libiomp5 or libomp), if any."""
    global _lib, _looked
    with _lock:
        if not _looked:
            _looked = True
            try:
                with open("/proc/self/maps") as maps:
                    paths = {line.split()[-1] for line in maps if _RUNTIME.search(line.rstrip())}
            except OSError:  # not Linux: torch there has no OpenMP pool to share
                paths = set()
            for path in sorted(paths):
                try:
                    _lib = ctypes.CDLL(path)
                    break
                except OSError:
                    continue
        return _lib


def serial_here() -> bool:
    """Make torch ops on the calling thread run on it alone (no OpenMP team of its own).

    Returns False where no OpenMP runtime is loaded (nothing to do)."""
    import torch

    torch.get_num_threads()  # torch's per-thread setup runs now, so it cannot undo what follows
    lib = _runtime()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)
    return True


def on_own_thread(fn: Callable[[], T], name: str = "engine-build") -> T:
    """``fn()`` run on a thread that exits once it returns (and takes its OpenMP pool with it);
    its result, or its exception re-raised here."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]

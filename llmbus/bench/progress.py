"""A plain-text progress line on stderr: redrawn in place on a terminal, every 10% otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str = "bench", stream=None, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled and total > 0
        self.stream = stream or sys.stderr
        self.done = self.failed = 0
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._t0 = time.perf_counter()
        self._last_decile = -1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        decile = self.done * 10 // self.total
        if not self._tty and decile == self._last_decile and self.done != self.total:
            return
        self._last_decile = decile
        width = 30
        filled = self.done * width // self.total
        line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                f" failed={self.failed} {time.perf_counter() - self._t0:.1f}s")
        self.stream.write(("\r" + line) if self._tty else (line + "\n"))
        if self._tty and self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()

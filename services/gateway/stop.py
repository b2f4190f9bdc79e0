"""Stop strings over streamed text.

NOTE: text is held back while a suffix of it could still grow into a stop string, so released text
never contains the start of a stop string that later completes: a stop string cannot straddle what
was already sent and what arrives next.
"""

from __future__ import annotations


class StopStringMatcher:
    """Feed decoded text pieces; get back the text safe to send, and whether a stop string hit."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add new text; return what may be released now. After a match, returns only the text
        before the stop string and ignores anything fed later."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        self._pending += text
        hit, hit_at = None, -1
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0 and (hit_at < 0 or at < hit_at):
                hit, hit_at = stop, at
        if hit is not None:
            self.stopped, self.matched = True, hit
            out, self._pending = self._pending[:hit_at], ""
            return out
        keep = self._held_back()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """The stream ended without a match: release whatever was held back."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best

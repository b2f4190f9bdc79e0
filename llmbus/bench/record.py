"""One benchmarked request: what was sent, when, and what came back."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """Timings are seconds; `start_s`/`arrival_s` are relative to the benchmark start.

    TTFT and E2E run from sending the request to the first and the last token chunk.
    `output_tokens` comes from the server's `usage` (or the engine's own count offline);
    `usage_reported` is False when the server sent no usage and the count fell back to the number
    of streamed token chunks.
    """

    index: int
    kind: str = "default"  # dataset category, e.g. "short"/"long" for mixed
    conversation: int | None = None
    turn: int = 0
    arrival_s: float = 0.0  # scheduled arrival
    start_s: float = 0.0  # request actually sent (after waiting for a concurrency slot)
    success: bool = False
    status: int | None = None  # HTTP status; None when the connection failed before one
    error: str = ""
    prompt_len: int = 0  # dataset's prompt length in tokens
    requested_output_len: int = 0
    prompt_tokens: int = 0  # as reported by the server
    output_tokens: int = 0
    cached_tokens: int | None = None
    usage_reported: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # every gap between streamed token chunks
    cpu_s: float | None = None  # offline only: process CPU seconds attributed to this request's batch

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for single-token or failed requests."""
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def token_times(self) -> list[float]:
        """Absolute (benchmark-relative) times at which token chunks arrived."""
        if self.ttft_s is None:
            return []
        t = self.start_s + self.ttft_s
        times = [t]
        for gap in self.itl_s:
            t += gap
            times.append(t)
        return times

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in names})

"""Service-level objectives for goodput: `--slo ttft:500 tpot:50 e2e:10000` (milliseconds)."""

from __future__ import annotations

from dataclasses import dataclass

from llmbus.bench.record import RequestRecord

_METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in _METRICS:
            v = getattr(self, f"{name}_ms")
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} must be a positive number of milliseconds, got {v}")

    @classmethod
    def parse(cls, specs: list[str] | None) -> "SLO | None":
        if not specs:
            return None
        values: dict[str, float] = {}
        for spec in specs:
            name, sep, ms = spec.partition(":")
            name = name.strip().lower()
            if not sep or name not in _METRICS:
                raise ValueError(f"bad --slo {spec!r}: expected METRIC:MS with METRIC one of {', '.join(_METRICS)}")
            if name in values:
                raise ValueError(f"--slo {name} given twice")
            try:
                values[name] = float(ms)
            except ValueError:
                raise ValueError(f"bad --slo {spec!r}: {ms!r} is not a number of milliseconds") from None
        return cls(**{f"{k}_ms": v for k, v in values.items()})

    def met(self, r: RequestRecord) -> bool:
        """A request counts toward goodput when it succeeded and met every objective set."""
        if not r.success:
            return False
        checks = (("ttft_ms", r.ttft_s), ("tpot_ms", r.tpot_s), ("e2e_ms", r.e2e_s))
        for attr, value_s in checks:
            limit = getattr(self, attr)
            # NOTE: a single-token request has no TPOT; it cannot miss a TPOT objective.
            if limit is not None and value_s is not None and value_s * 1000.0 > limit:
                return False
        return True

    def to_dict(self) -> dict:
        return {k: v for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2e_ms", self.e2e_ms)) if v is not None}

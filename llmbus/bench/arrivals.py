"""When requests arrive: all at once, at a fixed rate, Poisson, or gamma with a burstiness factor."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PROCESSES = ("poisson", "gamma", "constant")


@dataclass(frozen=True)
class ArrivalProcess:
    """`rate` in requests/s (inf: all at once). Gamma inter-arrivals with shape `burstiness` and
    mean 1/rate: burstiness 1 is Poisson, < 1 burstier, > 1 steadier (coefficient of variation
    1/sqrt(burstiness)); `constant` spaces requests exactly 1/rate apart."""

    rate: float = math.inf
    process: str = "poisson"
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"request rate must be > 0 (or inf for all at once), got {self.rate}")
        if self.process not in PROCESSES:
            raise ValueError(f"arrival process must be one of {', '.join(PROCESSES)}, got {self.process!r}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive finite number, got {self.burstiness}")
        if self.process == "poisson" and self.burstiness != 1.0:
            raise ValueError("burstiness applies to the gamma process; use --arrival gamma (or leave burstiness at 1)")

    def inter_arrivals(self, n: int, seed: int) -> list[float]:
        """n gaps in seconds, deterministic from `seed`; the first request waits gap[0]."""
        if n < 0:
            raise ValueError(f"number of arrivals must be >= 0, got {n}")
        if math.isinf(self.rate):
            return [0.0] * n
        if self.process == "constant":
            return [1.0 / self.rate] * n
        rng = random.Random(seed)
        shape = 1.0 if self.process == "poisson" else self.burstiness
        scale = 1.0 / (self.rate * shape)
        return [rng.gammavariate(shape, scale) for _ in range(n)]

    def schedule(self, n: int, seed: int) -> list[float]:
        """Arrival times (cumulative gaps), starting at 0 for the first request."""
        gaps = self.inter_arrivals(n, seed)
        times, t = [], 0.0
        for i, g in enumerate(gaps):
            if i:
                t += g
            times.append(t)
        return times

    def describe(self) -> str:
        if math.isinf(self.rate):
            return "all at once"
        if self.process == "gamma":
            return f"gamma {self.rate:g} req/s, burstiness {self.burstiness:g}"
        return f"{self.process} {self.rate:g} req/s"

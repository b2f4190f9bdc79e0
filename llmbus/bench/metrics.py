"""Aggregates over request records: throughput, goodput, percentiles, errors by status."""

from __future__ import annotations

import math
from collections import Counter

from llmbus.bench.record import RequestRecord
from llmbus.bench.slo import SLO

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values_s: list[float]) -> dict:
    """mean/median/p90/p99 in milliseconds (NaN-free: empty input gives None)."""
    if not values_s:
        return {"n": 0, "mean_ms": None, "median_ms": None, "p90_ms": None, "p99_ms": None}
    ms = [v * 1000.0 for v in values_s]
    out = {"n": len(ms), "mean_ms": sum(ms) / len(ms), "median_ms": percentile(ms, 50)}
    for q in PERCENTILES[1:]:
        out[f"p{q}_ms"] = percentile(ms, q)
    return out


def _error_key(r: RequestRecord) -> str:
    """HTTP status of a failed request; "connection" when none came back, "stream" when a 200
    stream broke off before it finished."""
    if r.status is None:
        return "connection"
    return "stream" if r.status == 200 else str(r.status)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None,
              cpu_s: float | None = None) -> dict:
    """The report's summary. `duration_s`: first arrival to last completion.

    `cpu_s` (optional) is CPU time spent by the measured side (server processes or the in-process
    engine) over the run; it is reported per output token.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or r.prompt_len for r in ok)
    errors = Counter(_error_key(r) for r in records if not r.success)
    summary = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors_by_status": dict(sorted(errors.items())),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (out_tokens + in_tokens) / duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "usage_missing": sum(1 for r in ok if not r.usage_reported),
        "ttft": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl": distribution([g for r in ok for g in r.itl_s]),
        "e2e": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
    }
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if cached:
        summary["total_cached_tokens"] = total_cached = sum(cached)
        # NOTE: a prefix cache warm from an earlier run makes a "random" run measure cached prompts;
        # the share is shown beside the figures so that never passes unnoticed.
        summary["cached_prompt_share"] = total_cached / in_tokens if in_tokens else 0.0
    if slo is not None:
        good = sum(1 for r in records if slo.met(r))
        summary["slo"] = slo.to_dict()
        summary["good_requests"] = good
        summary["goodput"] = good / duration_s
    if cpu_s is not None:
        summary["cpu_s"] = cpu_s
        summary["cpu_s_per_output_token"] = cpu_s / out_tokens if out_tokens else None
    kinds = sorted({r.kind for r in records})
    if len(kinds) > 1:
        # NOTE: per-kind latencies only; throughputs stay whole-run figures.
        summary["by_kind"] = {
            k: {
                "num_requests": sum(1 for r in records if r.kind == k),
                "ttft": distribution([r.ttft_s for r in ok if r.kind == k and r.ttft_s is not None]),
                "tpot": distribution([r.tpot_s for r in ok if r.kind == k and r.tpot_s is not None]),
                "e2e": distribution([r.e2e_s for r in ok if r.kind == k and r.e2e_s is not None]),
            }
            for k in kinds
        }
    return summary

"""The JSON report (every per-request record plus the summary) and the printed table.

Shape (schema "llmbus-bench/1"): {"schema", "kind": "serve"|"offline", "label", "date", "machine",
"config": {...}, "summary": {...}, "requests": [RequestRecord.to_dict(), ...]}.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket

from llmbus.bench.record import RequestRecord

SCHEMA = "llmbus-bench/1"
_DIST_ROWS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))


def machine_info() -> dict:
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cpu_model": model, "affinity": sorted(cpus) if cpus else None}


def make_report(kind: str, label: str, config: dict, records: list[RequestRecord], summary: dict) -> dict:
    return {"schema": SCHEMA, "kind": kind, "label": label,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "config": config, "summary": summary,
            "requests": [r.to_dict() for r in records]}


def write_report(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, allow_nan=False)


def load_report(path: str) -> dict:
    try:
        with open(path) as f:
            report = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a JSON report ({exc})") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an llmbus bench report (schema {SCHEMA!r} expected)")
    return report


def records_of(report: dict) -> list[RequestRecord]:
    return [RequestRecord.from_dict(d) for d in report["requests"]]


def _f(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def format_table(report: dict) -> str:
    s = report["summary"]
    lines = [f"== {report['label']} ({report['kind']}) ==",
             f"requests: {s['completed']} ok / {s['failed']} failed of {s['num_requests']}"
             + (f"   errors: {s['errors_by_status']}" if s["errors_by_status"] else ""),
             f"duration: {s['duration_s']:.2f} s",
             f"request throughput: {s['request_throughput']:.2f} req/s",
             f"output throughput:  {s['output_throughput']:.1f} tok/s   (total {s['total_token_throughput']:.1f} tok/s)"]
    if "goodput" in s:
        lines.append(f"goodput: {s['goodput']:.2f} req/s ({s['good_requests']} met {s['slo']})")
    if s.get("cpu_s_per_output_token") is not None:
        lines.append(f"CPU: {s['cpu_s']:.1f} s, {s['cpu_s_per_output_token'] * 1000:.2f} ms per output token")
    if s.get("usage_missing"):
        lines.append(f"WARNING: {s['usage_missing']} responses carried no usage; their tokens were counted by chunk")
    lines.append(f"{'metric (ms)':<12}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key, name in _DIST_ROWS:
        d = s[key]
        lines.append(f"{name:<12}" + "".join(f"{_f(d[k]):>10}" for k in ("mean_ms", "median_ms", "p90_ms", "p99_ms")))
    for kind, ks in (s.get("by_kind") or {}).items():
        lines.append(f"[{kind}] n={ks['num_requests']} TTFT p50 {_f(ks['ttft']['median_ms'])} p99 {_f(ks['ttft']['p99_ms'])}"
                     f"  TPOT p50 {_f(ks['tpot']['median_ms'])} p99 {_f(ks['tpot']['p99_ms'])} ms")
    return "\n".join(lines)

"""`llmbus bench compare`: key figures of several reports side by side, as ratios to the first."""

from __future__ import annotations

from llmbus.bench.report import load_report

# (label, path into the summary, higher is better; None: shown without a ratio)
ROWS = (
    ("output tok/s", ("output_throughput",), True),
    ("requests/s", ("request_throughput",), True),
    ("goodput req/s", ("goodput",), True),
    ("TTFT p50 ms", ("ttft", "median_ms"), False),
    ("TTFT p99 ms", ("ttft", "p99_ms"), False),
    ("TPOT p50 ms", ("tpot", "median_ms"), False),
    ("TPOT p99 ms", ("tpot", "p99_ms"), False),
    ("ITL p50 ms", ("itl", "median_ms"), False),
    ("ITL p99 ms", ("itl", "p99_ms"), False),
    ("E2E p50 ms", ("e2e", "median_ms"), False),
    ("CPU ms/out tok", ("cpu_s_per_output_token",), False),
    ("cached prompt %", ("cached_prompt_share",), None),
    ("failed", ("failed",), None),
)


def load_reports(paths: list[str]) -> list[dict]:
    """The reports to compare; anything unusable is a ValueError naming its file."""
    reports = []
    for path in paths:
        try:
            report = load_report(path)
        except OSError as exc:
            raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not a JSON report ({exc})") from None
        if not isinstance(report.get("summary"), dict):
            raise ValueError(f"{path}: the report has no summary")
        if not isinstance(report.get("label"), str):
            raise ValueError(f"{path}: the report has no label")
        reports.append(report)
    return reports


def _get(summary: dict, path: tuple[str, ...]):
    v = summary
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v


def comparison(reports: list[dict]) -> list[dict]:
    """One row per figure: the values and each report's ratio to the first (baseline) report."""
    if len(reports) < 2:
        raise ValueError("compare needs at least two reports")
    rows = []
    for name, path, higher_better in ROWS:
        vals = [_get(r["summary"], path) for r in reports]
        if name.startswith("CPU"):
            vals = [None if v is None else v * 1000.0 for v in vals]
        if name.endswith("%"):
            vals = [None if v is None else v * 100.0 for v in vals]
        if all(v is None for v in vals):
            continue
        base = vals[0]
        # NOTE: a ratio of error counts or of cache shares means nothing; show the values
        no_ratio = higher_better is None
        ratios = [None if (no_ratio or v is None or not base) else v / base for v in vals]
        rows.append({"metric": name, "values": vals, "ratios": ratios, "higher_is_better": higher_better})
    return rows


def _cell(v, r) -> str:
    if v is None:
        return "-"
    s = f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return s if r is None else f"{s} ({r:.2f}x)"


def format_comparison(reports: list[dict], markdown: bool = False) -> str:
    labels = [r["label"] for r in reports]
    rows = comparison(reports)
    cells = [[row["metric"]] + [_cell(v, r) for v, r in zip(row["values"], row["ratios"])] for row in rows]
    header = ["metric"] + labels
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(out)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *cells)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*c) for c in cells] + ["(ratios are to the first report)"])


def update_doc(path: str, section: str, table: str) -> None:
    """Replace the text between `<!-- bench:SECTION -->` and `<!-- /bench:SECTION -->` in `path`."""
    begin, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    with open(path) as f:
        text = f.read()
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{path} has no '{begin}' ... '{end}' markers to refresh")
    with open(path, "w") as f:
        f.write(text[: i + len(begin)] + "\n" + table + "\n" + text[j:])

"""The optional PNG chart: latency CDFs (TTFT, TPOT) and output throughput over time.

matplotlib is optional: the CLI calls `require` before a run that asks for a chart, so a missing
matplotlib is an error up front rather than a benchmark whose chart is silently skipped; without it
`draw` itself returns a message and draws nothing.
"""

from __future__ import annotations

from llmbus.bench.record import RequestRecord
from llmbus.bench.report import records_of


def _throughput_series(records: list[RequestRecord], bin_s: float) -> tuple[list[float], list[float]]:
    times = [t for r in records if r.success for t in r.token_times()]
    if not times:
        return [], []
    n = int(max(times) / bin_s) + 1
    counts = [0] * n
    for t in times:
        counts[int(t / bin_s)] += 1
    return [(k + 0.5) * bin_s for k in range(n)], [c / bin_s for c in counts]


def require() -> None:
    """Raises ValueError, saying what to install, when charts cannot be drawn here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--chart needs matplotlib, which is not installed (pip install matplotlib)") from None


def draw(reports: list[dict], path: str, bin_s: float = 1.0) -> str | None:
    """Draws to `path`; returns None, or a message saying why nothing was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install matplotlib)"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for rep in reports:
        recs = [r for r in records_of(rep) if r.success]
        for ax, key in ((axes[0], "ttft_s"), (axes[1], "tpot_s")):
            vals = sorted(v * 1000 for v in (getattr(r, key) for r in recs) if v is not None)
            if vals:
                ax.plot(vals, [(k + 1) / len(vals) for k in range(len(vals))], label=rep["label"])
        xs, ys = _throughput_series(recs, bin_s)
        axes[2].plot(xs, ys, label=rep["label"])
    for ax, title, xlabel in ((axes[0], "TTFT CDF", "ms"), (axes[1], "TPOT CDF", "ms"),
                              (axes[2], "output throughput", "s")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].set_ylabel("tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None

"""Metrics every service keeps the same way: counters, gauges and fixed-bucket histograms with label
sets, turned into ``MetricFamily`` records (what a service answers on ``llmbus.metrics.<instance>``)
and rendered as Prometheus' text format 0.0.4 (what the gateway's ``GET /metrics`` serves).

Written by hand (no client library): a few families per service, updated on hot paths (a histogram
observation is a bisection and two additions), read whole at a scrape.

NOTE: thread safety. An engine thread observes while the asyncio thread reads; a read copies each
series, so at worst it sees an observation half-recorded (its bucket without its sum; a histogram's
count is its buckets' total, so +Inf never reads below a finite bucket): fine for a scrape, and no
lock sits in the engine's step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from llmbus.protocol import MetricFamily, MetricSample

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metric:
    """A counter or gauge family: one value per label set."""

    def __init__(self, name: str, help_: str, kind: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.kind, self.labels = name, help_, kind, labels
        self.values: dict[tuple[str, ...], float] = {}

    def add(self, value: float, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + value

    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = value

    def family(self) -> MetricFamily:
        samples = [MetricSample(list(k), value=float(v)) for k, v in sorted(dict(self.values).items())]
        return MetricFamily(self.name, self.help, self.kind, list(self.labels), samples=samples)


class Histogram:
    def __init__(self, name: str, help_: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.labels, self.buckets = name, help_, labels, tuple(float(b) for b in buckets)
        self.series: dict[tuple[str, ...], list] = {}  # labels -> [count per bucket..., over the last, sum, count]

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0] * (len(self.buckets) + 1) + [0.0, 0]
        s[bisect.bisect_left(self.buckets, value)] += 1  # the first bound >= value
        s[-2] += value
        s[-1] += 1

    def family(self) -> MetricFamily:
        samples = []
        for key, s in sorted(dict(self.series).items()):
            s = list(s)
            cumulative, total = [], 0
            for n in s[: len(self.buckets)]:
                total += n
                cumulative.append(total)
            # NOTE: the count from the buckets (the overflow one too), not s[-1]: an observation
            # half-recorded on the engine thread must not put +Inf below the last finite bucket
            count = total + s[len(self.buckets)]
            samples.append(MetricSample(list(key), counts=cumulative, sum=float(s[-2]), count=count))
        return MetricFamily(self.name, self.help, "histogram", list(self.labels), list(self.buckets), samples)


def scalar(name: str, help_: str, value: float, kind: str = "gauge") -> MetricFamily:
    """A family of one unlabelled sample."""
    return MetricFamily(name, help_, kind, samples=[MetricSample([], value=float(value))])


def render(families: Iterable[MetricFamily]) -> str:
    """Families in Prometheus' text format 0.0.4; families of one name (from several services) are
    written as one, their samples together, with the first one's help."""
    merged: dict[str, MetricFamily] = {}
    samples: dict[str, list[MetricSample]] = {}
    for f in families:
        if f.name not in merged:
            merged[f.name], samples[f.name] = f, []
        elif (merged[f.name].kind, merged[f.name].labels, merged[f.name].bounds) != (f.kind, f.labels, f.bounds):
            continue  # NOTE: a service of another version that shaped it otherwise: the first one wins
        samples[f.name].extend(f.samples)
    lines: list[str] = []
    for name, f in merged.items():
        lines += [f"# HELP {name} {_escape_help(f.help)}", f"# TYPE {name} {f.kind}"]
        for s in samples[name]:
            if f.kind != "histogram":
                lines.append(f"{name}{_labels(f.labels, s.labels)} {_number(s.value)}")
                continue
            for bound, n in [*zip(f.bounds, s.counts), (math.inf, s.count)]:
                le = 'le="' + _number(bound) + '"'
                lines.append(f"{name}_bucket{_labels(f.labels, s.labels, le)} {n}")
            lines.append(f"{name}_sum{_labels(f.labels, s.labels)} {_number(s.sum)}")
            lines.append(f"{name}_count{_labels(f.labels, s.labels)} {s.count}")
    return "\n".join(lines) + "\n"


def labelled(family: MetricFamily, **labels: str) -> MetricFamily:
    """``family`` with ``labels`` (name=value) put before its own, on every sample. A label of its
    own of the same name becomes ``exported_<name>``, as Prometheus renames a target's clashing
    labels: a name twice in one sample makes Prometheus refuse the whole scrape."""
    names = list(labels)
    values = [labels[n] for n in names]
    own = [f"exported_{n}" if n in labels else n for n in family.labels]
    return MetricFamily(family.name, family.help, family.kind, names + own, list(family.bounds),
                        [MetricSample(values + list(s.labels), s.value, list(s.counts), s.sum, s.count)
                         for s in family.samples])  # fmt: skip


def _labels(names: Iterable[str], values: Iterable[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _number(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))

"""``GET /metrics``: the gateway's request figures and the workers' registry entries in Prometheus'
text format (0.0.4), for any Prometheus-compatible scraper.

Written out by hand (no client library): a few counters, gauges and fixed-bucket histograms with
label sets, rendered on each scrape. Per model: requests by outcome, requests running, prompt,
cached and generated tokens, and time to first token, time per output token and end-to-end
latency as seen by the gateway (from a request's arrival to its pieces leaving). Per worker, from
the registry as read at the scrape: queued requests, free and total KV blocks.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Iterable

from llmbus.protocol import InstanceInfo
from services.gateway.generation import Piece
from services.gateway.shapes import Usage

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Metric:
    """A counter or gauge family: one value per label set."""

    def __init__(self, name: str, help_: str, kind: str, labels: tuple[str, ...]) -> None:
        self.name, self.help, self.kind, self.labels = name, help_, kind, labels
        self.values: dict[tuple[str, ...], float] = {}

    def add(self, value: float, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{self.name}{_labels(self.labels, k)} {_number(v)}" for k, v in sorted(self.values.items())]
        return lines


class Histogram:
    def __init__(self, name: str, help_: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.labels, self.buckets = name, help_, labels, buckets
        self.series: dict[tuple[str, ...], list] = {}  # labels -> [bucket counts..., sum, count]

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.setdefault(labels, [0] * len(self.buckets) + [0.0, 0])
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                s[i] += 1
        s[-2] += value
        s[-1] += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, s in sorted(self.series.items()):
            for bound, n in [*zip(self.buckets, s), (math.inf, s[-1])]:
                le = 'le="' + _number(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.labels, key, le)} {n}")
            lines.append(f"{self.name}_sum{_labels(self.labels, key)} {_number(s[-2])}")
            lines.append(f"{self.name}_count{_labels(self.labels, key)} {s[-1]}")
        return lines


class GatewayMetrics:
    def __init__(self) -> None:
        m = ("model",)
        self.http = Metric("llmbus_gateway_http_requests_total",
                           "Completion and chat requests answered, by endpoint and HTTP status.", "counter",
                           ("endpoint", "status"))
        self.outcomes = Metric("llmbus_gateway_requests_total",
                               "Generation requests that ended, by outcome: ok (every choice finished), "
                               "error, or cancelled (the client left).", "counter", ("model", "outcome"))
        self.running = Metric("llmbus_gateway_requests_running", "Generation requests in flight.", "gauge", m)
        self.prompt = Metric("llmbus_gateway_prompt_tokens_total", "Prompt tokens of finished requests.",
                             "counter", m)
        self.cached = Metric("llmbus_gateway_cached_prompt_tokens_total",
                             "Prompt tokens of finished requests served from a prefix cache.", "counter", m)
        self.generated = Metric("llmbus_gateway_generation_tokens_total", "Tokens generated for finished requests.",
                                "counter", m)
        self.ttft = Histogram("llmbus_gateway_time_to_first_token_seconds",
                              "From a request's arrival to its first output.", m, LATENCY_BUCKETS)
        self.tpot = Histogram("llmbus_gateway_time_per_output_token_seconds",
                              "Per request: (end - first output) / (output tokens per choice - 1).", m, TOKEN_BUCKETS)
        self.e2e = Histogram("llmbus_gateway_e2e_request_latency_seconds",
                             "From a request's arrival to its last output.", m, E2E_BUCKETS)

    def request(self, model: str, n: int, arrival: float) -> RequestObserver:
        """A request's observer; ``arrival``: when it came in (``time.monotonic()``)."""
        return RequestObserver(self, model, n, arrival)

    def render(self, instances: Iterable[InstanceInfo] = ()) -> str:
        families = [self.http, self.outcomes, self.running, self.prompt, self.cached, self.generated,
                    self.ttft, self.tpot, self.e2e, *_worker_gauges(instances)]
        return "\n".join(line for f in families for line in f.render()) + "\n"


def _worker_gauges(instances: Iterable[InstanceInfo]) -> list[Metric]:
    labels = ("instance", "role")
    queue = Metric("llmbus_worker_queue_depth", "Requests a worker holds (its registry entry).", "gauge", labels)
    free = Metric("llmbus_worker_free_kv_blocks", "A worker's free KV blocks (its registry entry).", "gauge", labels)
    total = Metric("llmbus_worker_kv_blocks", "A worker's KV blocks in all (its registry entry).", "gauge", labels)
    for i in instances:
        if i.role in ("prefill", "decode"):
            key = (i.instance_id, i.role)
            queue.add(i.queue_depth, *key)
            free.add(i.free_blocks, *key)
            total.add(i.total_blocks, *key)
    return [queue, free, total]


class RequestObserver:
    """One generation request's figures, from its pieces as they leave (``watch``)."""

    def __init__(self, metrics: GatewayMetrics, model: str, n: int, arrival: float) -> None:
        self.metrics, self.model, self.n = metrics, model, n
        self.start = arrival
        self.first: float | None = None
        metrics.running.add(1, model)

    async def watch(self, pieces: AsyncIterator[tuple[int, Piece]], choices: int) -> AsyncIterator[tuple[int, Piece]]:
        """``pieces`` passed through, observed; the request's figures are recorded when it ends."""
        usages: dict[int, Usage] = {}
        outcome = "cancelled"
        try:
            async with contextlib.aclosing(pieces) as stream:
                async for i, piece in stream:
                    if self.first is None:
                        self.first = time.monotonic()
                    if piece.error is not None:
                        outcome = "error"
                    elif piece.usage is not None:
                        usages[i] = piece.usage
                        if len(usages) == choices:
                            outcome = "ok"
                    yield i, piece
        finally:
            self._end(outcome, [usages[i] for i in sorted(usages)] if outcome == "ok" else [])

    def _end(self, outcome: str, usages: list[Usage]) -> None:
        m, model = self.metrics, self.model
        m.running.add(-1, model)
        m.outcomes.add(1, model, outcome)
        if not usages:
            return
        end = time.monotonic()
        usage = Usage.of_choices(usages, self.n)
        m.prompt.add(usage.prompt_tokens, model)
        m.cached.add(usage.cached_tokens, model)
        m.generated.add(usage.completion_tokens, model)
        m.e2e.observe(end - self.start, model)
        if self.first is not None:
            m.ttft.observe(self.first - self.start, model)
            per_choice = usage.completion_tokens / len(usages)
            if per_choice > 1:
                m.tpot.observe((end - self.first) / (per_choice - 1), model)

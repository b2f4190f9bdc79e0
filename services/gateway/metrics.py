"""``GET /metrics``: the gateway's request figures and the workers' registry entries in Prometheus'
text format (0.0.4), for any Prometheus-compatible scraper.

Built with ``llmbus.metrics``, rendered on each scrape, after which come the families every other
service answers over the bus (``llmbus.bus.metrics.scrape``). Per model: requests by outcome, requests running, prompt,
cached and generated tokens, and time to first token, time per output token and end-to-end
latency as seen by the gateway (from a request's arrival to its pieces leaving). Per worker, from
the registry as read at the scrape: queued requests, free and total KV blocks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable

from llmbus import tracing
from llmbus.metrics import E2E_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS, Histogram, Metric, render
from llmbus.protocol import InstanceInfo, MetricFamily
from services.gateway.generation import Piece
from services.gateway.shapes import Usage

class GatewayMetrics:
    def __init__(self) -> None:
        m = ("model",)
        self.http = Metric("llmbus_gateway_http_requests_total",
                           "Completion, chat and Responses API requests answered, by endpoint and HTTP status.", "counter",
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
        self.tenant_tokens = Metric(
            "llmbus_gateway_tenant_tokens_total",
            "Tokens of finished requests by tenant (the API key's; \"\" on an open gateway) and kind: prompt, "
            "cached (prompt tokens read from a prefix cache) or completion; what usage-based billing counts.",
            "counter", ("tenant", "kind"))
        self.limited = Metric("llmbus_gateway_rate_limited_total",
                              "Requests refused with 429 by a tenant's limit (--tenant-limits): requests or tokens "
                              "per minute or per day, or requests in flight.", "counter", ("tenant", "limit"))
        self.e2e = Histogram("llmbus_gateway_e2e_request_latency_seconds",
                             "From a request's arrival to its last output.", m, E2E_BUCKETS)

    def request(self, model: str, n: int, arrival: float, span=None,
                on_end: Callable[[str, Usage | None], None] | None = None, tenant: str = "") -> RequestObserver:  # fmt: skip
        """A request's observer; ``arrival``: when it came in (``time.monotonic()``); ``span``: its
        trace span (``llmbus.tracing``), ended with it; ``on_end(outcome, usage)`` called as it ends
        (usage None unless every choice finished)."""
        return RequestObserver(self, model, n, arrival, span, on_end, tenant)

    def render(self, instances: Iterable[InstanceInfo] = (), services: Iterable[MetricFamily] = ()) -> str:
        """The gateway's own families, the workers' registry gauges, then ``services``: what the
        other services answered, labelled with their instance and role (``llmbus.bus.metrics.scrape``)."""
        own = [self.http, self.outcomes, self.running, self.prompt, self.cached, self.generated,
               self.ttft, self.tpot, self.e2e, self.tenant_tokens, self.limited, *_worker_gauges(instances)]
        return render([*(f.family() for f in own), *services])


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

    def __init__(self, metrics: GatewayMetrics, model: str, n: int, arrival: float, span=None,
                 on_end: Callable[[str, Usage | None], None] | None = None, tenant: str = "") -> None:  # fmt: skip
        self.metrics, self.model, self.n, self.on_end, self.tenant = metrics, model, n, on_end, tenant
        self.start = arrival
        self.first: float | None = None
        self.span = span if span is not None and span.is_recording() else None
        self.ended = False
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
                        if self.span is not None:
                            self.span.add_event("first_token")
                    if piece.error is not None:
                        outcome = "error"
                    elif piece.usage is not None:
                        usages[i] = piece.usage
                        if len(usages) == choices:
                            outcome = "ok"
                    yield i, piece
        finally:
            self._end(outcome, [usages[i] for i in sorted(usages)] if outcome == "ok" else [])

    def close(self) -> None:
        """End the request as cancelled unless its pieces ended it (a stream whose client left
        before the first piece was read never started ``watch``)."""
        self._end("cancelled", [])

    def _end(self, outcome: str, usages: list[Usage]) -> None:
        if self.ended:
            return
        self.ended = True
        m, model = self.metrics, self.model
        m.running.add(-1, model)
        m.outcomes.add(1, model, outcome)
        usage = Usage.of_choices(usages, self.n) if usages else None
        if self.span is not None:
            self._end_span(outcome, usage)
        if self.on_end is not None:
            self.on_end(outcome, usage)
        if usage is None:
            return
        end = time.monotonic()
        m.prompt.add(usage.prompt_tokens, model)
        m.cached.add(usage.cached_tokens, model)
        m.generated.add(usage.completion_tokens, model)
        for kind, n in (("prompt", usage.prompt_tokens), ("cached", usage.cached_tokens),
                        ("completion", usage.completion_tokens)):  # fmt: skip
            m.tenant_tokens.add(n, self.tenant, kind)
        m.e2e.observe(end - self.start, model)
        if self.first is not None:
            m.ttft.observe(self.first - self.start, model)
            per_choice = usage.completion_tokens / len(usages)
            if per_choice > 1:
                m.tpot.observe((end - self.first) / (per_choice - 1), model)

    def _end_span(self, outcome: str, usage: Usage | None) -> None:
        span = self.span
        span.set_attribute("llmbus.outcome", outcome)
        if usage is not None:
            span.set_attributes({"gen_ai.usage.output_tokens": usage.completion_tokens,
                                 "llmbus.cached_tokens": usage.cached_tokens})  # fmt: skip
        if outcome == "error":
            tracing.fail(span, "a choice ended with an error")
        span.end()

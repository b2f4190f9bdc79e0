"""``llmbus.tracing``: configuration from OpenTelemetry's variables, spans on and off, the OTLP/HTTP
JSON encoding (checked against the SDK's own span objects and a collector), and the trace context
a GenerateRequest carries."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExportResult

from llmbus import tracing
from llmbus.protocol import GenerateRequest, ProtocolError, decode, encode
from tests.otlp_collector import Collector


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


@pytest.fixture
def traced(collector):
    assert tracing.setup("router", "router-t", {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url + "/",
                                                "OTEL_SERVICE_NAME": "my-router"})
    yield collector
    tracing.shutdown()


def test_the_exporter_follows_opentelemetrys_variables():
    assert tracing.exporter_from({}) is None
    assert tracing.exporter_from({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}) is None
    assert isinstance(tracing.exporter_from({"OTEL_TRACES_EXPORTER": "console"}), ConsoleSpanExporter)
    e = tracing.exporter_from({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"})
    assert e.url == "http://c:4318/v1/traces"
    e = tracing.exporter_from({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://t/x", "OTEL_EXPORTER_OTLP_HEADERS": "a=1, b%20c=d=e"})
    assert e.url == "https://t/x" and e.headers["a"] == "1" and e.headers["b c"] == "d=e"
    with pytest.raises(ValueError, match="http"):
        tracing.exporter_from({"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://c:4317"})
    with pytest.raises(tracing.TracingConfigError, match="not 'grpc'"):
        tracing.exporter_from({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert tracing.exporter_from({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    for env in ({"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"},
                {"OTEL_TRACES_EXPORTER": "zipkin"}):  # without an endpoint too: not silently off
        with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
            tracing.exporter_from(env)


def test_off_nothing_is_recorded_and_nothing_travels():
    assert not tracing.enabled()
    span = tracing.start("x", root=True)
    assert not span.is_recording() and tracing.traceparent(span) == ""
    span.end()


def test_spans_reach_the_collector_in_otlp_json(traced):
    parent = f"00-{'ab' * 16}-{'cd' * 8}-01"
    root = tracing.start("request", parent, root=True, kind=trace.SpanKind.SERVER,
                         attributes={"n": 3, "ok": True, "ratio": 0.5, "tags": ["a", "b"], "who": "x"})
    tp = tracing.traceparent(root)
    assert tp.startswith("00-" + "ab" * 16 + "-") and tp.endswith("-01") and tp != parent
    child = tracing.start("part", tp)
    child.add_event("first_token", {"at": 1})
    tracing.fail(child, "it broke")
    child.end()
    root.end()
    assert not tracing.start("orphan").is_recording()  # a worker's span needs a parent
    tracing.shutdown()  # flushes
    by_name = {s["name"]: s for s in traced.spans}
    assert set(by_name) == {"request", "part"}
    r, c = by_name["request"], by_name["part"]
    assert r["traceId"] == c["traceId"] == "ab" * 16
    assert r["parentSpanId"] == "cd" * 8 and c["parentSpanId"] == r["spanId"] == tp.split("-")[2]
    assert (r["kind"], c["kind"]) == (2, 1)  # OTLP's SERVER and INTERNAL
    assert r["attrs"] == {"n": 3, "ok": True, "ratio": 0.5, "tags": {"values": [{"stringValue": "a"},
                                                                                  {"stringValue": "b"}]}, "who": "x"}
    assert c["status"] == {"code": 2, "message": "it broke"} and r["status"] == {"code": 0}
    assert c["events"][0]["name"] == "first_token" and c["events"][0]["attributes"][0]["value"] == {"intValue": "1"}
    assert int(r["startTimeUnixNano"]) <= int(c["startTimeUnixNano"]) <= int(c["endTimeUnixNano"]) \
        <= int(r["endTimeUnixNano"])
    assert {s["service"] for s in traced.spans} == {"my-router"}


def test_a_collector_that_is_down_costs_the_spans_only(collector):
    exporter = tracing.exporter_from({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url})
    collector.close()
    assert exporter.export([]) == SpanExportResult.FAILURE


def test_a_busy_collector_gets_the_spans_again_and_a_refusing_one_loses_them(collector):
    """429/502/503/504 are tried again (after Retry-After, else a growing pause) within the
    exporter's timeout; any other answer costs the batch at once."""
    exporter = tracing.exporter_from({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url})
    provider = TracerProvider()
    span = provider.get_tracer("t").start_span("retried")
    span.end()
    collector.refusals[:] = [(503, "0"), (429, None), (502, "soon")]
    assert exporter.export([span]) == SpanExportResult.SUCCESS
    assert len(collector.requests) == 4 and [s["name"] for s in collector.spans] == ["retried"]
    collector.refusals[:] = [(400, None)]
    assert exporter.export([span]) == SpanExportResult.FAILURE
    assert len(collector.requests) == 5 and len(collector.spans) == 1
    collector.refusals[:] = [(503, "3600")]  # later than the timeout allows: given up at once
    assert exporter.export([span]) == SpanExportResult.FAILURE and len(collector.requests) == 6


class _Waits:
    """Stands in for the exporter's stop event: records each wait asked for, waits none."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def wait(self, seconds: float) -> bool:
        self.asked.append(seconds)
        return False

    def set(self) -> None:
        pass


def test_a_retry_never_comes_sooner_than_the_backoff(collector):
    """Retry-After 0 (or any shorter than the backoff) waits the backoff: 0.5 s, then 1 s..."""
    exporter = tracing.exporter_from({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url})
    exporter._stopping = waits = _Waits()
    span = TracerProvider().get_tracer("t").start_span("s")
    span.end()
    collector.refusals[:] = [(503, "0"), (429, "0.1"), (503, "3")]
    assert exporter.export([span]) == SpanExportResult.SUCCESS
    assert waits.asked == [0.5, 1.0, 3.0] and len(collector.requests) == 4


def test_stopping_sends_each_queued_batch_once_without_waiting_to_retry(collector):
    collector.refusals[:] = [(503, "1")] * 100
    assert tracing.setup("router", "router-stop", {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url})
    for i in range(3):
        tracing.start(f"s{i}", root=True).end()
    tracing.shutdown()  # NOTE: told late, the exporter would try this batch every 1 s for 10 s
    assert len(collector.requests) == 1 and not tracing.enabled()


def test_a_request_carries_a_w3c_trace_context_or_nothing():
    tp = f"00-{'0a' * 16}-{'0b' * 8}-01"
    req = GenerateRequest("r1", "m", [1, 2], traceparent=tp)
    assert decode(GenerateRequest, encode(req)).traceparent == tp
    assert GenerateRequest("r1", "m", [1]).traceparent == ""
    for bad in ("nonsense", tp.upper(), tp + "-x", "01" + tp[2:]):
        with pytest.raises(ValueError, match="traceparent"):
            GenerateRequest("r1", "m", [1], traceparent=bad)
    with pytest.raises(ProtocolError, match="traceparent"):
        decode(GenerateRequest, encode(req).replace(b"0a0a", b"zz0a"))


def test_a_service_refuses_a_tracing_setting_it_cannot_use_in_one_line():
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT="grpc://127.0.0.1:4317")
    r = subprocess.run([sys.executable, "-m", "services.router", "--nats-url", "nats://127.0.0.1:1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["router: error: the OTLP traces endpoint must be an http(s) URL, "
                                             "got 'grpc://127.0.0.1:4317/v1/traces'"]

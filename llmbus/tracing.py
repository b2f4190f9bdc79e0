"""Distributed traces (OpenTelemetry): one trace per HTTP request, across the services it crosses.

Off unless configured, with OpenTelemetry's own variables: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
(the full URL) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` appended) sends spans as OTLP over
HTTP, JSON-encoded, to any OpenTelemetry collector (or Jaeger, Tempo, ...); ``OTEL_TRACES_EXPORTER``
``console`` prints them instead, ``none`` turns tracing off. ``OTEL_EXPORTER_OTLP_HEADERS``
(``k=v,k2=v2``) adds headers (credentials); ``OTEL_EXPORTER_OTLP_PROTOCOL`` may be ``http/json``
or ``http/protobuf`` (JSON is sent either way), not ``grpc``; ``OTEL_TRACES_SAMPLER`` / ``_ARG`` and ``OTEL_BSP_*``
work as the SDK documents them; ``OTEL_SERVICE_NAME`` overrides ``llmbus-<role>``.

The gateway opens a request's span (continuing the client's W3C ``traceparent`` header when it
sends one) and writes its context into every ``GenerateRequest.traceparent``; the router, the
prefill and the decode worker each open a child span of it for their part. Off, no span is
recorded and ``traceparent`` stays empty.

A busy collector (429, 502, 503, 504) is tried again, as OTLP/HTTP asks (``OtlpJsonExporter``).

NOTE: the OTLP exporter is ours (OTLP/HTTP's JSON encoding, urllib), not the
opentelemetry-exporter-otlp package: that one brings protobuf and requests into every service for
a few dozen lines of encoding.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

import orjson
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("llmbus.tracing")

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_tracer: trace.Tracer = trace.NoOpTracer()
_exporter: SpanExporter | None = None


class TracingConfigError(ValueError):
    """An OTEL_* setting this process cannot use."""


def setup(role: str, instance_id: str, env: dict[str, str] | None = None) -> bool:
    """Configure this process's tracing from ``env`` (default ``os.environ``); whether it is on.
    Raises TracingConfigError on a setting it cannot use (an endpoint that is not an http(s) URL)."""
    global _provider, _tracer, _exporter
    env = os.environ if env is None else env
    exporter = exporter_from(env)
    if exporter is None:
        return False
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or f"llmbus-{role}",
                                "service.instance.id": instance_id})  # fmt: skip
    _provider = TracerProvider(resource=resource)  # NOTE: the sampler comes from OTEL_TRACES_SAMPLER
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _exporter = exporter
    _tracer = _provider.get_tracer("llmbus")
    return True


def exporter_from(env) -> SpanExporter | None:
    kind = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    url = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if not url and (base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()):
        url = base.rstrip("/") + "/v1/traces"
    if kind not in ("", "otlp"):  # (checked with or without an endpoint: zipkin alone must not mean off)
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER must be otlp, console or none, got {kind!r}")
    if not url:
        return None
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "").strip()
    if protocol and not protocol.startswith("http/"):  # NOTE: a collector's HTTP receiver reads JSON too
        raise TracingConfigError(f"llmbus sends OTLP over HTTP (JSON), not {protocol!r}: unset "
                                 "OTEL_EXPORTER_OTLP_PROTOCOL and give the collector's HTTP endpoint (port 4318)")
    if not url.startswith(("http://", "https://")):
        raise TracingConfigError(f"the OTLP traces endpoint must be an http(s) URL, got {url!r}")
    return OtlpJsonExporter(url, _headers(env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
                                          or env.get("OTEL_EXPORTER_OTLP_HEADERS", "")))  # fmt: skip


def shutdown() -> None:
    """Send what is still queued, each batch tried once, and stop.

    NOTE: the exporter is told first: the batch processor calls its ``shutdown`` only after
    exporting everything queued, and with a collector asking to come back later each batch would
    wait out its retries (up to ``timeout_s`` each) past the 30 s a stopping service has."""
    global _provider, _tracer, _exporter
    if _exporter is not None:
        _exporter.shutdown()
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer, _exporter = None, trace.NoOpTracer(), None


def enabled() -> bool:
    return _provider is not None


def start(name: str, traceparent: str = "", *, root: bool = False, kind: SpanKind = SpanKind.INTERNAL,
          attributes: dict | None = None) -> Span:  # fmt: skip
    """A span, child of the span ``traceparent`` names (a W3C header value). Without one it starts
    a trace only when ``root`` (the gateway, which takes the sampling decision); otherwise, and
    while tracing is off, the span is not recorded."""
    if _provider is None or not (traceparent or root):
        return trace.INVALID_SPAN
    context = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
    return _tracer.start_span(name, context=context, kind=kind, attributes=attributes)


def traceparent(span: Span) -> str:
    """``span``'s context as a W3C traceparent value; "" for a span that is not recorded."""
    if not span.is_recording():
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def fail(span: Span, message: str) -> None:
    span.set_status(Status(StatusCode.ERROR, message[:500]))


def _headers(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            out[urllib.parse.unquote(k.strip())] = urllib.parse.unquote(v.strip())
    return out


# what OTLP/HTTP calls retryable: the collector is busy or restarting and asks the exporter to come back
RETRYABLE = frozenset({429, 502, 503, 504})
FIRST_RETRY_S = 0.5  # doubled each time; a Retry-After header overrides it


class OtlpJsonExporter(SpanExporter):
    """Spans as OTLP/HTTP JSON (``ExportTraceServiceRequest``) POSTed to ``url``; runs on the batch
    processor's thread. A retryable answer (429, 502, 503, 504) is tried again after its
    Retry-After, else after 0.5 s, 1 s, 2 s..., while ``timeout_s`` allows; any other failure, or
    a collector that cannot be reached, costs the batch's spans and nothing else."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self._stopping = threading.Event()  # shutdown: no more waiting to retry

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        body = orjson.dumps(encode_spans(spans))
        deadline = time.monotonic() + self.timeout_s
        delay = FIRST_RETRY_S
        while True:
            request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=max(0.1, deadline - time.monotonic())) as response:
                    response.read()
                return SpanExportResult.SUCCESS
            except urllib.error.HTTPError as exc:
                # NOTE: never sooner than the backoff: a collector that says 0 would be asked again at once
                wait = max(delay, _retry_after(exc.headers.get("Retry-After"), delay)) if exc.code in RETRYABLE else None
                failure: Exception = exc
            except Exception as exc:  # unreachable, a timeout: no second try
                wait, failure = None, exc
            if wait is None or time.monotonic() + wait >= deadline or self._stopping.wait(wait):
                log.warning("could not send %d spans to %s: %s", len(spans), self.url, failure)
                return SpanExportResult.FAILURE
            delay *= 2

    def shutdown(self) -> None:
        self._stopping.set()


def _retry_after(value: str | None, default: float) -> float:
    """A Retry-After header's seconds (its HTTP-date form counts as none), else ``default``."""
    try:
        return max(0.0, float(value)) if value is not None else default
    except ValueError:
        return default


def encode_spans(spans: Sequence[ReadableSpan]) -> dict:
    """OTLP's JSON mapping: ids in hex, 64-bit integers as strings, enums as numbers."""
    by_resource: dict[int, tuple[Resource, dict[tuple, list]]] = {}
    for s in spans:
        res = by_resource.setdefault(id(s.resource), (s.resource, {}))[1]
        scope = s.instrumentation_scope
        res.setdefault((scope.name, scope.version or "") if scope else ("", ""), []).append(_span(s))
    return {"resourceSpans": [
        {"resource": {"attributes": _attributes(resource.attributes)},
         "scopeSpans": [{"scope": {"name": name, "version": version}, "spans": items}
                        for (name, version), items in scopes.items()]}
        for resource, scopes in by_resource.values()]}  # fmt: skip


def _span(s: ReadableSpan) -> dict:
    ctx = s.context
    out = {
        "traceId": f"{ctx.trace_id:032x}",
        "spanId": f"{ctx.span_id:016x}",
        "name": s.name,
        "kind": s.kind.value + 1,  # the SDK counts from INTERNAL = 0; OTLP from UNSPECIFIED = 0
        "startTimeUnixNano": str(s.start_time or 0),
        "endTimeUnixNano": str(s.end_time or 0),
        "attributes": _attributes(s.attributes),
        "events": [{"timeUnixNano": str(e.timestamp), "name": e.name, "attributes": _attributes(e.attributes)}
                   for e in s.events],  # fmt: skip
        "status": {"code": s.status.status_code.value, **({"message": s.status.description}
                                                          if s.status.description else {})},  # fmt: skip
    }
    if s.parent is not None:
        out["parentSpanId"] = f"{s.parent.span_id:016x}"
    return out


def _attributes(attrs) -> list[dict]:
    return [{"key": k, "value": _value(v)} for k, v in (attrs or {}).items()]


def _value(v) -> dict:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": str(v)}

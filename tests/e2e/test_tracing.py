"""Traces across the real stack (`llmbus up`, every service its own process) into an OTLP/HTTP
collector: one trace per HTTP request, the client's `traceparent` continued, and the router's,
prefill's and decode's spans children of the gateway's."""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest

from tests.e2e.stack import Stack
from tests.otlp_collector import Collector

MODEL = "demo"
pytestmark = pytest.mark.timeout(600)
SERVER, INTERNAL = 2, 1  # OTLP span kinds
ERROR = 2  # OTLP status code


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory, collector):
    s = Stack(MODEL, model_dir, tmp_path_factory.mktemp("trace-data"), "--router-arg=--whole-threshold=0", env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20t0ken"})
    yield s
    s.stop()


def test_a_request_is_one_trace_across_every_service(stack, collector):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120,
                           default_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                         max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    names = {f"chat {MODEL}", "llmbus.route", "llmbus.prefill", "llmbus.decode"}
    spans = collector.trace(trace_id, names)
    gateway, route, prefill, decode = (spans[n] for n in (f"chat {MODEL}", "llmbus.route", "llmbus.prefill",
                                                           "llmbus.decode"))  # fmt: skip
    assert gateway["parentSpanId"] == client_span and gateway["kind"] == SERVER
    for span in (route, prefill, decode):
        assert span["parentSpanId"] == gateway["spanId"] and span["kind"] == INTERNAL
    assert [s["service"] for s in (gateway, route, prefill, decode)] == \
        ["llmbus-gateway", "llmbus-router", "llmbus-prefill", "llmbus-decode"]
    rid = gateway["attrs"]["llmbus.request_id"]
    assert all(s["attrs"]["llmbus.request_id"] == rid for s in (route, prefill, decode))
    usage = out.usage
    assert gateway["attrs"]["gen_ai.usage.output_tokens"] == usage.completion_tokens == 5
    assert gateway["attrs"]["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert gateway["attrs"]["llmbus.outcome"] == "ok"
    assert prefill["attrs"]["llmbus.finish_reason"] == "handoff"
    assert decode["attrs"]["llmbus.finish_reason"] == "length"
    assert decode["attrs"]["gen_ai.usage.output_tokens"] == 5
    assert route["attrs"]["llmbus.lane"] == "short"
    assert [e["name"] for e in gateway["events"]] == ["first_token"]
    assert [e["name"] for e in prefill["events"]] == ["first_token"]
    assert [e["name"] for e in decode["events"]] == ["joined_batch"]
    # the waterfall, in the order each part causes the next (one clock: one machine)
    t = lambda span, key="startTimeUnixNano": int(span[key])  # noqa: E731
    first_token, joined = int(prefill["events"][0]["timeUnixNano"]), int(decode["events"][0]["timeUnixNano"])
    assert t(gateway) <= t(route) <= t(prefill) <= first_token <= t(decode) <= joined <= t(decode, "endTimeUnixNano")
    assert joined <= t(gateway, "endTimeUnixNano")
    assert collector.requests and all(path == "/v1/traces" and h["authorization"] == "Bearer t0ken"
                                      for path, h in collector.requests)


def test_a_request_without_a_traceparent_starts_a_trace_and_a_refused_one_is_an_error(stack, collector):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt="One two", max_tokens=2, temperature=0)
    root = collector.wait(lambda spans: [s for s in spans if s["name"] == f"text_completion {MODEL}"
                                         and s["attrs"].get("llmbus.request_id", "").startswith(out.id)], "its span")
    (root,) = root
    assert "parentSpanId" not in root  # a new trace
    parts = {"llmbus.route", "llmbus.prefill", "llmbus.decode"}
    spans = collector.trace(root["traceId"], parts)
    assert all(spans[n]["parentSpanId"] == root["spanId"] for n in parts)

    trace_id = secrets.token_hex(16)
    r = httpx.post(stack.base_url + "/completions", json={"model": "no-such-model", "prompt": "x"},
                   headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}, timeout=30)
    assert r.status_code == 404
    (refused,) = collector.trace(trace_id, {"text_completion no-such-model"}).values()
    assert refused["status"]["code"] == ERROR and "no-such-model" in refused["status"]["message"]
    assert refused["attrs"]["http.response.status_code"] == 404

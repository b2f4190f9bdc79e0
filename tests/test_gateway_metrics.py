"""``GET /metrics``: the gateway's request figures and the workers' registry entries, in Prometheus'
text format, after real requests through the real gateway process and bus (a scripted worker)."""

from __future__ import annotations

import httpx

from tests.test_gateway_harness import (  # noqa: F401
    gateway, gw_nats, http, model_dir, reply_script, scratch, sse_events, tokenizer, wait_for, worker,
)
from tests.metrics_text import parse
from tests.test_gateway_stream import CHAT, COMP, MSGS, _busy_worker_in_registry, _ids, _per_choice

def _scrape(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(r.text)


def test_request_figures_and_worker_entries(http, worker, tokenizer, gw_nats):
    assert not any(k.startswith("llmbus_gateway_requests_total") for k in _scrape(http))  # a fresh gateway
    reply = _ids(tokenizer, "Hello there")
    worker.script = reply_script(reply, cached=16)
    assert http.post(CHAT, json={"model": "demo", "messages": MSGS}).status_code == 200
    worker.script = _per_choice({str(i): reply_script(reply, delay=0.01) for i in range(2)})
    with http.stream("POST", COMP, json={"model": "demo", "prompt": "Hi", "n": 2, "stream": True}) as r:
        assert sse_events(r)[-1] == "[DONE]"
    worker.script = reply_script(reply, error="out of KV blocks")
    assert http.post(COMP, json={"model": "demo", "prompt": "Hi"}).status_code == 500
    assert http.post(COMP, json={"model": "demo", "prompt": "Hi", "temperature": 9}).status_code == 400

    got = _scrape(http)
    assert got['llmbus_gateway_http_requests_total{endpoint="chat",status="200"}'] == 1
    assert got['llmbus_gateway_http_requests_total{endpoint="completions",status="200"}'] == 1  # the stream
    assert got['llmbus_gateway_http_requests_total{endpoint="completions",status="500"}'] == 1
    assert got['llmbus_gateway_http_requests_total{endpoint="completions",status="400"}'] == 1
    assert got['llmbus_gateway_requests_total{model="demo",outcome="ok"}'] == 2
    assert got['llmbus_gateway_requests_total{model="demo",outcome="error"}'] == 1
    assert got['llmbus_gateway_requests_running{model="demo"}'] == 0
    assert got['llmbus_gateway_generation_tokens_total{model="demo"}'] == 3 * len(reply)
    assert got['llmbus_gateway_cached_prompt_tokens_total{model="demo"}'] == 16
    assert got['llmbus_gateway_tenant_tokens_total{tenant="",kind="completion"}'] == 3 * len(reply)  # an open gateway
    assert got['llmbus_gateway_tenant_tokens_total{tenant="",kind="cached"}'] == 16
    assert got['llmbus_gateway_prompt_tokens_total{model="demo"}'] > 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        count = got[f'llmbus_gateway_{name}_count{{model="demo"}}']
        assert count == 2 and got[f'llmbus_gateway_{name}_bucket{{model="demo",le="+Inf"}}'] == count
        buckets = [v for k, v in got.items() if k.startswith(f"llmbus_gateway_{name}_bucket")]
        assert buckets == sorted(buckets)  # cumulative

    with _busy_worker_in_registry(gw_nats, "demo"):
        got = wait_for(lambda: (s := _scrape(http)).get(
            'llmbus_worker_queue_depth{instance="busy-in-registry",role="prefill"}') and s, what="the registry entry")
    assert got['llmbus_worker_queue_depth{instance="busy-in-registry",role="prefill"}'] == 3
    assert got['llmbus_worker_free_kv_blocks{instance="busy-in-registry",role="prefill"}'] == 0


def test_a_client_that_leaves_is_counted_as_cancelled(gateway, http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "word " * 60), delay=0.05)
    with http.stream("POST", COMP, json={"model": "demo", "prompt": "x", "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    got = wait_for(lambda: (s := _scrape(http)).get('llmbus_gateway_requests_total{model="demo",outcome="cancelled"}')
                   and s, what="the cancelled request")
    assert got['llmbus_gateway_requests_running{model="demo"}'] == 0
    assert httpx.get(gateway + "/metrics").status_code == 200

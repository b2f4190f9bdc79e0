"""Per-tenant rate limits (``--tenant-limits``): the limiter as a state machine on a test clock, then
through the real gateway process on a real bus (a scripted worker) with httpx and the OpenAI client."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from services.gateway.errors import APIError
from services.gateway.limits import Limits, RateLimited, RateLimiter, TenantLimits, effective_priority
from tests.metrics_text import parse
from tests.test_gateway_harness import (  # noqa: F401
    ROOT, GatewayProcess, gw_nats, model_dir, reply_script, scratch, tokenizer, worker,
)
from tests.test_gateway_stream import COMP, _ids, _last_request


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _limiter(default: dict, tenants: dict | None = None) -> tuple[RateLimiter, Clock, list]:
    clock, refused = Clock(), []
    limiter = RateLimiter(TenantLimits.parse({"default": default, "tenants": tenants or {}}), clock,
                          on_limited=lambda t, limit: refused.append((t, limit)))
    return limiter, clock, refused


def _level(limiter: RateLimiter, tenant: str, name: str) -> float:
    return next(b.level for n, _, b in limiter._tenants[tenant].buckets if n == name)


def test_requests_per_minute_burst_then_refill_at_the_limits_pace():
    limiter, clock, refused = _limiter({"requests_per_minute": 3})
    for _ in range(3):
        limiter.admit("a", 10, 10).settle(20)
    with pytest.raises(RateLimited) as e:
        limiter.admit("a", 10, 10)
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded" and e.value.type == "requests"
    assert e.value.retry_after == pytest.approx(20.0)  # a request every 20 s
    assert e.value.headers["retry-after"] == "20" and e.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.value.headers["x-ratelimit-limit-requests"] == "3"
    limiter.admit("b", 10, 10)  # another tenant has its own buckets
    clock.t += 19.9
    with pytest.raises(RateLimited):
        limiter.admit("a", 10, 10)
    clock.t += 0.1
    limiter.admit("a", 10, 10)
    assert refused == [("a", "requests"), ("a", "requests")]


def test_tokens_are_reserved_then_settled_at_what_was_used():
    limiter, clock, _ = _limiter({"tokens_per_minute": 1000})
    first = limiter.admit("a", 100, 500)  # reserves 600
    with pytest.raises(RateLimited) as e:
        limiter.admit("a", 100, 400)  # 500 more: 400 left
    assert e.value.type == "tokens" and e.value.retry_after == pytest.approx(100 / (1000 / 60))
    first.settle(150)  # used 150 of 600: 450 back
    second = limiter.admit("a", 100, 400)
    second.settle(None)  # the client left: the reservation stands
    second.settle(0)  # a second settle changes nothing
    with pytest.raises(RateLimited) as e:
        limiter.admit("a", 200, 200)  # 1000 - 150 - 500 = 350 left
    assert e.value.headers["x-ratelimit-remaining-tokens"] == "350"
    clock.t += 3.0  # 50 tokens back
    limiter.admit("a", 200, 200)


def test_a_refusal_charges_nothing_and_the_concurrency_limit_frees_on_settle():
    limiter, _, refused = _limiter({"requests_per_minute": 10, "tokens_per_minute": 100, "max_concurrent_requests": 2})
    a = limiter.admit("t", 10, 10)
    with pytest.raises(RateLimited):
        limiter.admit("t", 50, 50)  # 100 tokens with 80 left: no request charged for it
    b = limiter.admit("t", 10, 10)
    with pytest.raises(RateLimited) as e:
        limiter.admit("t", 1, 1)
    assert e.value.type == "concurrent" and "in flight" in e.value.message
    a.settle(5)
    c = limiter.admit("t", 1, 1)
    assert _level(limiter, "t", "requests") == pytest.approx(7)  # three admitted of ten
    assert limiter._tenants["t"].in_flight == 2
    for x in (b, c):
        x.settle(0)
    assert [limit for _, limit in refused] == ["tokens", "concurrent"]


def test_a_reservation_over_the_minute_is_cut_and_a_prompt_over_it_never_runs():
    limiter, clock, _ = _limiter({"tokens_per_minute": 1000})
    big = limiter.admit("a", 200, 5000)  # reserves the whole minute, not 5200
    assert big.reserved == 1000
    big.settle(1200)  # used more than reserved: the bucket goes into debt
    assert _level(limiter, "a", "tokens") == pytest.approx(-200)
    with pytest.raises(RateLimited) as e:
        limiter.admit("a", 10, 10)
    assert e.value.retry_after == pytest.approx(220 / (1000 / 60))
    with pytest.raises(APIError) as e:
        limiter.admit("a", 1001, 1)
    assert e.value.status == 400 and e.value.code == "request_too_large"


def test_retry_after_is_the_longest_wait_and_precheck_charges_nothing():
    limiter, clock, refused = _limiter({"requests_per_minute": 1, "requests_per_day": 1, "max_concurrent_requests": 1})
    limiter.precheck("a")  # room: nothing raised, nothing charged
    first = limiter.admit("a", 5, 5)
    with pytest.raises(RateLimited) as e:
        limiter.precheck("a")
    assert e.value.type == "concurrent"
    first.settle(10)
    clock.t += 1
    with pytest.raises(RateLimited) as e:
        limiter.precheck("a")
    assert e.value.type == "requests-day" and e.value.retry_after == pytest.approx(86400 - 1)  # not the minute's 59 s
    assert e.value.headers["x-ratelimit-remaining-requests"] == "0" and e.value.headers["x-ratelimit-reset-requests"] == "59.000s"
    assert limiter._tenants["a"].in_flight == 0 and [limit for _, limit in refused] == ["concurrent", "requests-day"]


def test_daily_limits_are_quotas_that_come_back_over_the_day():
    limiter, clock, refused = _limiter({"tokens_per_minute": 1000, "tokens_per_day": 3000, "requests_per_day": 100})
    for _ in range(3):
        limiter.admit("a", 100, 900).settle(1000)
        clock.t += 60  # the minute's bucket is full again each time; the day's is not
    with pytest.raises(RateLimited) as e:
        limiter.admit("a", 100, 100)
    assert e.value.type == "tokens-day" and "per day" in e.value.message
    assert e.value.retry_after == pytest.approx((200 - 3000 * 180 / 86400) / (3000 / 86400))
    assert e.value.headers["x-ratelimit-limit-tokens-day"] == "3000" and e.value.headers["x-ratelimit-limit-tokens"] == "1000"
    assert _level(limiter, "a", "requests-day") == pytest.approx(97, abs=0.5)
    with pytest.raises(APIError, match="3000 a day"):
        _limiter({"tokens_per_day": 3000})[0].admit("a", 3001, 0)
    big = _limiter({"tokens_per_minute": 5000, "tokens_per_day": 3000})[0].admit("a", 10, 10000)
    assert big.reserved == 3000  # cut to the smallest token allowance
    assert refused == [("a", "tokens-day")]


def test_a_tenants_own_limits_override_the_default_field_by_field():
    config = TenantLimits.parse({"default": {"requests_per_minute": 5, "max_concurrent_requests": 1},
                                 "tenants": {"big": {"requests_per_minute": 500}}})
    assert config.of("big") == Limits(500, max_concurrent_requests=1)
    assert config.of("other") == config.of("") == Limits(5, max_concurrent_requests=1)
    assert TenantLimits.parse({}).of("x") == Limits()
    for bad, why in [([], "JSON object"), ({"defaults": {}}, "'default'"), ({"tenants": []}, "'tenants'"),
                     ({"default": {"rpm": 1}}, "unknown limit 'rpm'"),
                     ({"default": {"tokens_per_minute": 1.5}}, "positive integer"),
                     ({"tenants": {"a": {"max_concurrent_requests": True}}}, "tenants.a.max_concurrent_requests"),
                     ({"default": {"priority": 0.5}}, "default.priority must be an integer"),
                     ({"tenants": {"a": {"priority": 10**7}}}, "tenants.a.priority must be an integer")]:
        with pytest.raises(ValueError, match=why):
            TenantLimits.parse(bad)


def test_a_request_runs_at_its_tenants_priority_or_a_larger_one_it_asks():
    config = TenantLimits.parse({"default": {"requests_per_minute": 5},
                                 "tenants": {"vip": {"priority": -3}, "bulk": {"priority": 2}}})
    assert config.of("vip").priority == -3 and config.of("vip").requests_per_minute == 5
    assert config.priority_of("someone") == 0  # set nowhere
    assert [effective_priority(asked, config.priority_of("vip")) for asked in (None, -9, -3, 0, 7)] == [-3, -3, -3, 0, 7]
    assert [effective_priority(asked, config.priority_of("bulk")) for asked in (None, -1, 5)] == [2, 2, 5]
    assert [effective_priority(asked, config.priority_of("someone")) for asked in (None, -1, 5)] == [0, 0, 5]
    assert [effective_priority(asked, None) for asked in (None, -4, 4)] == [0, -4, 4]  # no limits: as asked


# --- through the gateway --------------------------------------------------------------------------

KEYS = {"sk-small-00001": "small", "sk-other-00001": "other", "sk-meter-00001": "meter", "sk-wide-000001": "wide",
        "sk-urgent-0001": "urgent", "sk-batch-00001": "batch"}
LIMITS = {"default": {"requests_per_minute": 1000},
          "tenants": {"small": {"requests_per_minute": 2, "tokens_per_minute": 100000, "max_concurrent_requests": 1},
                      "meter": {"tokens_per_minute": 1000, "max_concurrent_requests": 1},
                      "wide": {"tokens_per_minute": 1000},
                      "urgent": {"priority": -2}, "batch": {"priority": 3}}}


@pytest.fixture(scope="module")
def limited(gw_nats, model_dir, worker, scratch):
    keys, limits = scratch / "limits-keys.json", scratch / "limits.json"
    keys.write_text(json.dumps(KEYS))
    limits.write_text(json.dumps(LIMITS))
    proc = GatewayProcess(gw_nats, model_dir, scratch / "gateway-limits.log",
                          ("--api-keys-file", str(keys), "--tenant-limits", str(limits), "--max-model-len", "4096"))
    yield proc.url
    assert proc.stop() == 0


def _post(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(url + COMP, json={"model": "demo", "prompt": "Hi", "max_tokens": 5, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_a_tenant_over_its_limits_gets_openai_429s_and_others_do_not(limited, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "a slow answer"), delay=0.3)
    results = {}

    def slow():
        results["slow"] = _post(limited, "sk-small-00001")

    t = threading.Thread(target=slow)
    t.start()
    deadline = time.monotonic() + 20  # until the first is admitted and in flight
    while parse(httpx.get(limited + "/metrics").text).get('llmbus_gateway_requests_running{model="demo"}', 0) < 1:
        assert time.monotonic() < deadline, "the first request never started"
        time.sleep(0.02)
    busy = _post(limited, "sk-small-00001")
    assert busy.status_code == 429
    err = busy.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "concurrent" and "in flight" in err["message"]
    assert int(busy.headers["retry-after"]) >= 1
    other = _post(limited, "sk-other-00001")
    assert other.status_code == 200  # another tenant is not held back
    assert other.headers["x-ratelimit-limit-requests"] == "1000" and "x-ratelimit-limit-tokens" not in other.headers
    t.join()
    assert results["slow"].status_code == 200

    worker.script = reply_script(_ids(tokenizer, "ok"))
    second = _post(limited, "sk-small-00001", stream=True)  # its second request this minute
    assert second.status_code == 200 and second.text.rstrip().endswith("data: [DONE]")
    assert second.headers["x-ratelimit-remaining-requests"] == "0"  # as of its admission
    assert second.headers["x-ratelimit-limit-tokens"] == "100000" and second.headers["content-type"].startswith(
        "text/event-stream")
    third = _post(limited, "sk-small-00001", stream=True)
    assert third.status_code == 429 and third.json()["error"]["type"] == "requests"
    assert third.headers["x-ratelimit-limit-requests"] == "2" and third.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(third.headers["retry-after"]) <= 30  # one request every 30 s, less the time since the first
    assert float(third.headers["retry-after-ms"]) / 1000 <= int(third.headers["retry-after"])

    client = openai.OpenAI(base_url=limited + "/v1", api_key="sk-small-00001", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="demo", prompt="Hi", max_tokens=2)
    assert e.value.code == "rate_limit_exceeded"

    got = parse(httpx.get(limited + "/metrics").text)
    assert got['llmbus_gateway_rate_limited_total{tenant="small",limit="concurrent"}'] == 1
    assert got['llmbus_gateway_rate_limited_total{tenant="small",limit="requests"}'] == 2
    assert not any(k.startswith("llmbus_gateway_rate_limited_total") and 'tenant="other"' in k for k in got)
    assert got['llmbus_gateway_tenant_tokens_total{tenant="other",kind="completion"}'] > 0


def test_a_prompt_over_the_tenants_token_limit_names_its_own_field(limited):
    """A prompt that can never fit the tenant's tokens a minute is a 400 naming the field the
    prompt came in (a completions one said 'messages')."""
    headers = {"Authorization": "Bearer sk-wide-000001"}
    r = httpx.post(limited + COMP, json={"model": "demo", "prompt": [5] * 1100, "max_tokens": 1}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(limited + "/v1/chat/completions", headers=headers, json={
        "model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "word " * 1100}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert r.json()["error"]["code"] == "request_too_large"


def test_the_priority_a_request_carries_is_its_tenants_floor_or_what_it_asks(limited, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "ok"))
    for key, asked, runs in (("sk-urgent-0001", None, -2), ("sk-urgent-0001", -50, -2), ("sk-urgent-0001", 4, 4),
                             ("sk-batch-00001", None, 3), ("sk-batch-00001", -1, 3), ("sk-other-00001", -1, 0)):
        r = _post(limited, key, **({} if asked is None else {"priority": asked}))
        assert r.status_code == 200, r.text
        assert _last_request(worker, r.json()["id"])[0].priority == runs, (key, asked)
    # OpenAI's service_tier: "priority" asks for -1, "flex" for 1 (priority, when given, wins); the
    # response says the tier the request ran in
    for key, fields, runs, tier in (("sk-other-00001", {"service_tier": "priority"}, 0, "default"),
                                    ("sk-urgent-0001", {"service_tier": "flex"}, 1, "flex"),
                                    ("sk-urgent-0001", {"service_tier": "auto"}, -2, "priority"),
                                    ("sk-batch-00001", {"service_tier": "priority", "priority": 7}, 7, "flex")):
        r = _post(limited, key, **fields)
        assert r.status_code == 200 and r.json()["service_tier"] == tier, (key, fields, r.text)
        assert _last_request(worker, r.json()["id"])[0].priority == runs, (key, fields)
    headers = {"Authorization": "Bearer sk-urgent-0001"}
    r = httpx.post(limited + "/v1/responses", json={"model": "demo", "input": "Hi", "max_output_tokens": 5, "store": False},
                   headers=headers, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    assert worker.requests[-1][0].priority == -2 and r.json()["service_tier"] == "priority"
    r = httpx.post(limited + "/v1/responses", json={"model": "demo", "input": "Hi", "max_output_tokens": 5, "store": False,
                                                     "service_tier": "flex"}, headers=headers, timeout=30)  # fmt: skip
    assert worker.requests[-1][0].priority == 1 and r.json()["service_tier"] == "flex"
    for bad, code in ((10**7, "invalid_value"), ("high", "invalid_type"), (1.5, "invalid_type")):
        r = _post(limited, "sk-urgent-0001", priority=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert r.json()["error"]["code"] == code
    r = _post(limited, "sk-urgent-0001", service_tier="gold")
    assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier"


def test_a_finished_request_is_charged_its_usage_and_a_client_that_leaves_frees_its_place(limited, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "ok"))
    for _ in range(3):  # each reserves prompt + 6 x 100 of the 1,000 a minute, and is charged a few tokens
        r = _post(limited, "sk-meter-00001", max_tokens=100, n=6)
        assert r.status_code == 200, r.text
    worker.script = reply_script(_ids(tokenizer, "word " * 40), delay=0.05)
    with httpx.stream("POST", limited + COMP, json={"model": "demo", "prompt": "Hi", "max_tokens": 100, "n": 5,
                                                    "stream": True},
                      headers={"Authorization": "Bearer sk-meter-00001"}, timeout=30) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))  # then the client leaves
    worker.script = reply_script(_ids(tokenizer, "ok"))

    def admitted() -> httpx.Response:  # its place in flight comes back once the gateway sees it gone
        deadline = time.monotonic() + 10
        while (r := _post(limited, "sk-meter-00001", max_tokens=100)).status_code == 429 and \
                r.json()["error"]["type"] == "concurrent" and time.monotonic() < deadline:
            time.sleep(0.1)
        return r

    assert admitted().status_code == 200  # ~100 of the ~490 the left stream did not take
    r = _post(limited, "sk-meter-00001", max_tokens=100, n=6)
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"  # the left stream kept its ~500


def test_requests_without_max_tokens_do_not_each_take_the_whole_bucket(limited, worker, tokenizer):
    """With no max_tokens a request may run to the end of the context (4,096 here, past the
    tenant's 1,000 tokens a minute): it reserves 256 new tokens, so two run side by side."""
    worker.script = reply_script(_ids(tokenizer, "a slow answer"), delay=0.3)
    results = []
    body = {"model": "demo", "prompt": "Hi"}
    threads = [threading.Thread(target=lambda: results.append(httpx.post(
        limited + COMP, json=body, headers={"Authorization": "Bearer sk-wide-000001"}, timeout=30))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]


def test_a_bad_limits_file_stops_the_gateway_with_one_line(scratch, model_dir):
    path = scratch / "bad-limits.json"
    path.write_text(json.dumps({"tenants": {"a": {"tokens_per_minute": -5}}}))
    r = subprocess.run([sys.executable, "-m", "services.gateway", "--nats-url", "nats://127.0.0.1:1",
                        "--model", f"demo={model_dir}", "--tenant-limits", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"gateway: error: {path}: tenants.a.tokens_per_minute must be a "
                                             "positive integer, got -5"]


def test_gateways_charge_each_other_what_their_tenants_spend():
    """Two gateways' limiters (the same limits) exchanging usage reports: each counts what the
    tenant spends at the other, refunds included, and its requests in flight there while the
    other keeps saying so."""
    limits = {"requests_per_minute": 4, "tokens_per_minute": 100, "max_concurrent_requests": 3}
    a, clock, _ = _limiter(limits)
    b = RateLimiter(a.config, clock)
    first = a.admit("t", 10, 20)  # reserves 30 tokens
    second = a.admit("t", 10, 20)
    (usage,) = a.usage()
    assert (usage.tenant, usage.requests, usage.tokens, usage.in_flight) == ("t", 2, 60, 2)
    assert a.usage() == []  # nothing new since
    b.charge("gw-a", [usage])
    assert _level(b, "t", "requests") == 2 and _level(b, "t", "tokens") == 40
    b.admit("t", 5, 5).settle(10)  # the third this minute
    fourth = b.admit("t", 5, 5)  # the fourth, in flight beside a's two
    with pytest.raises(RateLimited) as e:
        b.admit("t", 5, 5)  # b counts a's two, still in flight there, and its own
    assert e.value.type == "concurrent"
    fourth.settle(10)
    with pytest.raises(RateLimited) as e:
        b.admit("t", 5, 5)  # a fifth this minute, across the two
    assert e.value.type == "requests"
    first.settle(12)  # 18 of its 30 tokens come back at a; b hears of it with a's in-flight count
    second.settle(None)  # usage unknown: the reservation stays charged
    (usage,) = a.usage()
    assert (usage.requests, usage.tokens, usage.in_flight) == (0, -18, 0)
    b.charge("gw-a", [usage])
    assert _level(b, "t", "tokens") == 100 - 60 - 10 - 10 + 18
    assert b._tenants["t"].others_in_flight(clock.t) == 0


def test_another_gateways_requests_in_flight_count_while_it_repeats_them():
    a, clock, _ = _limiter({"max_concurrent_requests": 2})
    b = RateLimiter(a.config, clock)
    a.admit("t", 1, 1)
    a.admit("t", 1, 1)
    b.charge("gw-a", a.usage())
    with pytest.raises(RateLimited) as e:
        b.admit("t", 1, 1)
    assert e.value.type == "concurrent"
    clock.t += 2.0
    assert a.usage() == [] and [u.in_flight for u in a.usage(every=True)] == [2]  # repeated while in flight
    b.charge("gw-a", a.usage(every=True))
    clock.t += 2.5
    with pytest.raises(RateLimited):
        b.admit("t", 1, 1)  # told 2.5 s ago: still counted
    clock.t += 1.0
    b.admit("t", 1, 1)  # a stopped saying so (it died): not counted any more


def test_two_gateway_processes_hold_one_tenant_to_its_limit(gw_nats, model_dir, worker, scratch, tokenizer):
    """The limits hold across gateways on one bus: a request in flight at one is counted by the
    other (``llmbus.limits``), which refuses the tenant's next with 429 until it ends."""
    keys, limits = scratch / "fleet-keys.json", scratch / "fleet-limits.json"
    keys.write_text(json.dumps({"sk-fleet-00001": "fleet"}))
    limits.write_text(json.dumps({"tenants": {"fleet": {"max_concurrent_requests": 1}}}))
    extra = ("--api-keys-file", str(keys), "--tenant-limits", str(limits))
    one = GatewayProcess(gw_nats, model_dir, scratch / "gateway-fleet-1.log", extra)
    two = GatewayProcess(gw_nats, model_dir, scratch / "gateway-fleet-2.log", extra)
    try:
        worker.script = reply_script(_ids(tokenizer, "word " * 60), delay=0.1)  # ~6 s in flight at one
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("slow", _post(one.url, "sk-fleet-00001", max_tokens=60)))
        t.start()
        deadline = time.monotonic() + 20
        while parse(httpx.get(one.url + "/metrics").text).get('llmbus_gateway_requests_running{model="demo"}', 0) < 1:
            assert time.monotonic() < deadline, "the first request never started"
            time.sleep(0.02)
        worker.script = reply_script(_ids(tokenizer, "ok"))
        deadline = time.monotonic() + 5  # the first report reaches the other gateway within a period or two
        while (r := _post(two.url, "sk-fleet-00001")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status_code == 429 and r.json()["error"]["type"] == "concurrent", r.text
        t.join()
        assert results["slow"].status_code == 200
    finally:
        assert one.stop() == 0 and two.stop() == 0


def test_saved_levels_are_taken_up_refilled_for_the_time_since():
    limits = {"requests_per_minute": 6, "tokens_per_day": 86400}
    a, clock, _ = _limiter(limits)
    wall = [5000.0]
    a.wall = lambda: wall[0]
    for _ in range(3):
        a.admit("t", 100, 0).settle(100)
    saved = a.unsaved()
    assert [(s.tenant, s.levels, s.saved_at) for s in saved] == [("t", {"requests": 3}, 5000.0),
                                                                 ("t", {"tokens-day": 86100}, 5000.0)]  # fmt: skip
    assert a.unsaved() == []  # nothing changed since
    b = RateLimiter(a.config, clock)
    b.charge("gw-a", a.usage())
    assert b.unsaved() == []  # what another gateway spent is that gateway's to save
    wall[0] += 20.0  # a new gateway, 20 s later: 2 requests and 20 tokens have come back
    c = RateLimiter(TenantLimits.parse({"default": limits}), clock, wall=lambda: wall[0])
    for each in saved:
        c.restore(each)
    assert _level(c, "t", "requests") == 5 and _level(c, "t", "tokens-day") == 86120
    c.restore(dataclasses.replace(saved[0], levels={"gone": 5}))  # a bucket its limits no longer have
    assert _level(c, "t", "requests") == 5 and _level(c, "t", "tokens-day") == 86120


def test_a_restarted_gateway_does_not_forgive_a_daily_quota(gw_nats, model_dir, worker, scratch, tokenizer):
    """The buckets outlive the gateway (``llmbus_limits``): a tenant's daily requests spent before
    a restart are still spent after it."""
    keys, limits = scratch / "daily-keys.json", scratch / "daily-limits.json"
    keys.write_text(json.dumps({"sk-daily-00001": "daily"}))
    limits.write_text(json.dumps({"tenants": {"daily": {"requests_per_day": 2}}}))
    extra = ("--api-keys-file", str(keys), "--tenant-limits", str(limits))
    worker.script = reply_script(_ids(tokenizer, "ok"))
    first = GatewayProcess(gw_nats, model_dir, scratch / "gateway-daily-1.log", extra)
    try:
        assert [_post(first.url, "sk-daily-00001").status_code for _ in range(2)] == [200, 200]
    finally:
        assert first.stop() == 0  # saves the buckets as it stops
    second = GatewayProcess(gw_nats, model_dir, scratch / "gateway-daily-2.log", extra)
    try:
        r = _post(second.url, "sk-daily-00001")
        assert r.status_code == 429 and r.json()["error"]["type"] == "requests-day", r.text
        assert int(r.headers["retry-after"]) > 40000  # a request comes back every 12 hours
    finally:
        assert second.stop() == 0

"""API keys and tenants: ``--api-keys-file`` closes /v1 to unlisted keys and salts each tenant's
prefix caches with its name, against the real gateway process on a real bus (a scripted worker)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from services.gateway.errors import APIError
from services.gateway.tenants import Tenants
from tests.test_gateway_harness import (  # noqa: F401
    ROOT, GatewayProcess, gw_nats, model_dir, reply_script, scratch, tokenizer, worker,
)
from tests.metrics_text import parse
from tests.test_gateway_stream import CHAT, COMP, MSGS, _ids, _last_request

KEYS = {"sk-alpha-0001": "alpha", "sk-alpha-0002": "alpha", "sk-beta-00001": "beta"}


@pytest.fixture(scope="module")
def keyed(gw_nats, model_dir, worker, scratch):
    path = scratch / "api-keys.json"
    path.write_text(json.dumps(KEYS))
    proc = GatewayProcess(gw_nats, model_dir, scratch / "gateway-tenants.log", ("--api-keys-file", str(path)))
    yield proc.url
    assert proc.stop() == 0


def _client(url: str, key: str | None) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {key}"} if key else {})


def test_only_listed_keys_are_answered(keyed, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "ok"))
    for key in (None, "sk-nobody-000", "sk-alpha-000"):  # none, unknown, a listed key's prefix
        with _client(keyed, key) as c:
            for r in (c.post(CHAT, json={"model": "demo", "messages": MSGS}), c.get("/v1/models")):
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert "sk-" not in r.text  # no key echoed back
    with httpx.Client(base_url=keyed, headers={"Authorization": "Basic sk-alpha-0001"}) as c:
        assert c.get("/v1/models").status_code == 401
    with _client(keyed, None) as c:  # operations endpoints stay open
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_each_tenant_salts_its_requests(keyed, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "ok"))
    salts = {}
    for key in KEYS:
        with _client(keyed, key) as c:
            r = c.post(COMP, json={"model": "demo", "prompt": "same prompt"})
            assert r.status_code == 200, r.text
            req = _last_request(worker, r.json()["id"])[0]
            assert req.tenant == req.cache_salt
            salts[key] = req.cache_salt
    assert salts == {"sk-alpha-0001": "alpha", "sk-alpha-0002": "alpha", "sk-beta-00001": "beta"}
    got = parse(httpx.get(keyed + "/metrics").text)  # usage by tenant, for billing
    reply = len(_ids(tokenizer, "ok"))
    assert got['llmbus_gateway_tenant_tokens_total{tenant="alpha",kind="completion"}'] >= 2 * reply
    assert got['llmbus_gateway_tenant_tokens_total{tenant="beta",kind="completion"}'] >= reply
    assert got['llmbus_gateway_tenant_tokens_total{tenant="beta",kind="prompt"}'] > 0


def test_a_bad_keys_file_is_a_one_line_error(tmp_path, model_dir):
    for text, message in (("{", "not JSON"), ("[]", "non-empty JSON object"), ('{"short": "a"}', "8 or more"),
                          ('{"sk-good-key-1": ""}', "tenant must be")):
        path = tmp_path / "keys.json"
        path.write_text(text)
        out = subprocess.run([sys.executable, "-m", "services.gateway", "--nats-url", "nats://127.0.0.1:1",
                              "--model", f"demo={model_dir}", "--api-keys-file", str(path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1
        assert "sk-good-key-1" not in out.stderr


def test_tenant_lookup():
    t = Tenants(KEYS)
    assert t.tenant("Bearer sk-beta-00001") == "beta" and t.tenant("bearer  sk-alpha-0002 ") == "alpha"
    for header in (None, "", "Bearer", "Bearer sk-beta-0000", "sk-beta-00001"):
        with pytest.raises(APIError) as exc:
            t.tenant(header)
        assert exc.value.status == 401


def test_up_hands_the_keys_file_to_the_gateway(tmp_path, model_dir, monkeypatch):
    import argparse

    from llmbus.launch import _plan, register

    monkeypatch.chdir(tmp_path)
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["up", "--model", f"m={model_dir}", "--api-keys-file", "keys.json"])
    gateway = next(c for c in _plan(args, "nats://127.0.0.1:4222", [("m", str(model_dir))]) if c.name == "gateway")
    assert gateway.argv[gateway.argv.index("--api-keys-file") + 1] == str(tmp_path / "keys.json")  # absolute

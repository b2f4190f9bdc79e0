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


def test_stored_responses_continue_show_and_delete_for_their_tenant_only(keyed, worker, tokenizer):
    """``store`` (on by default): a response is kept on the bus (KV bucket ``llmbus_responses``);
    ``previous_response_id`` puts its conversation, answer included, before the new input (its
    instructions do not carry over); ``GET``/``DELETE /v1/responses/{id}`` show and remove it. For
    another tenant, or once deleted, it is a 404."""
    import openai

    alpha = openai.OpenAI(base_url=keyed + "/v1", api_key="sk-alpha-0001", max_retries=0)
    alpha2 = openai.OpenAI(base_url=keyed + "/v1", api_key="sk-alpha-0002", max_retries=0)  # same tenant
    beta = openai.OpenAI(base_url=keyed + "/v1", api_key="sk-beta-00001", max_retries=0)
    worker.script = reply_script(_ids(tokenizer, "Paris is in France."))
    first = alpha.responses.create(model="demo", instructions="Be terse.", input="Where is Paris?")
    assert first.store and first.output_text == "Paris is in France."
    shown = alpha2.responses.retrieve(first.id)
    assert shown.model_dump() == first.model_dump()
    worker.script = reply_script(_ids(tokenizer, "About two million."))
    before = len(worker.requests)
    with alpha.responses.stream(model="demo", input="How many live there?", previous_response_id=first.id) as s:
        for _ in s:
            pass
        second = s.get_final_response()
    (req, _), = worker.requests[before:]
    prompt = tokenizer.decode(req.prompt_token_ids)
    assert prompt.index("Where is Paris?") < prompt.index("Paris is in France.") < prompt.index("How many live there?")
    assert "Be terse." not in prompt  # instructions belong to their own response
    assert second.store and second.previous_response_id == first.id
    assert alpha.responses.retrieve(second.id).output_text == "About two million."
    for call in (lambda: beta.responses.retrieve(first.id),
                 lambda: beta.responses.create(model="demo", input="x", previous_response_id=first.id),
                 lambda: beta.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = alpha.responses.create(model="demo", input="Forget this.", store=False)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(unstored.id)
    alpha.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        alpha.responses.create(model="demo", input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(first.id)
    assert alpha.responses.retrieve(second.id).id == second.id  # its own conversation is its own copy

"""Every request error of the gateway: OpenAI-format JSON body, right status, the field named."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from services.gateway.errors import APIError

from tests.test_gateway_harness import MAX_BODY_BYTES, MAX_MODEL_LEN, gateway, gw_nats, http, model_dir, scratch, worker  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_health_and_models(http):
    assert http.get("/health").json() == {"status": "ok"}
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [("demo", "model", MAX_MODEL_LEN)]


def test_one_model(gateway, http):
    """GET /v1/models/{model}: the card /v1/models lists, or OpenAI's 404."""
    assert http.get("/v1/models/demo").json() == http.get("/v1/models").json()["data"][0]
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve("demo").id == "demo"
    err = _error(http.get("/v1/models/org/nope"), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found") and "org/nope" in err["message"]


def test_a_client_gone_mid_body_is_no_server_error(gateway, http, scratch, request):
    """A client that hangs up while sending its body gets no 500 and logs no error: nothing failed."""
    log = scratch / f"gateway-{request.module.__name__}.log"
    seen = log.stat().st_size
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 500\r\n\r\n{\"model\":")
    assert http.get("/health").json() == {"status": "ok"}  # still serving, and the disconnect handled by now
    time.sleep(0.5)
    with open(log, "rb") as f:
        f.seek(seen)
        new = f.read().decode(errors="replace")
    assert "ERROR" not in new and "Traceback" not in new, new


def test_malformed_json(http):
    err = _error(http.post(CHAT, content=b'{"model": "demo",', headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"


@pytest.mark.parametrize("body", [[1, 2], "text", 3])
def test_body_not_an_object(http, body):
    assert _error(http.post(CHAT, json=body), 400)["code"] == "invalid_request_body"


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": MSGS}, "model"),
    (CHAT, {"model": "demo"}, "messages"),
    (COMP, {"model": "demo"}, "prompt"),
    (CHAT, {"model": "demo", "messages": [{"content": "x"}]}, "messages[0].role"),
    (CHAT, {"model": "demo", "messages": [{"role": "user"}]}, "messages[0].content"),
])
def test_missing_fields(http, path, body, param):
    err = _error(http.post(path, json=body), 400)
    assert (err["param"], err["code"]) == (param, "missing_required_parameter")


@pytest.mark.parametrize("path,field,value", [
    (CHAT, "model", 7),
    (CHAT, "messages", "hello"),
    (CHAT, "max_tokens", "10"),
    (CHAT, "max_completion_tokens", 2.5),
    (CHAT, "temperature", "hot"),
    (CHAT, "stream", "yes"),
    (CHAT, "seed", True),
    (CHAT, "stop", [1, 2]),
    (CHAT, "logprobs", 1),
    (COMP, "prompt", {"text": "x"}),
    (COMP, "logprobs", True),
    (COMP, "top_k", 1.5),
])
def test_wrong_types(http, path, field, value):
    body = {"model": "demo", "messages": MSGS} if path == CHAT else {"model": "demo", "prompt": "hi"}
    body[field] = value
    err = _error(http.post(path, json=body), 400)
    assert (err["param"], err["code"]) == (field, "invalid_type")


@pytest.mark.parametrize("field,value", [
    ("temperature", 2.5), ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("top_k", -2), ("min_p", 2),
    ("repetition_penalty", 0), ("n", 0), ("n", 129), ("stop", ["a", ""]), ("logprobs", 21), ("seed", 2**63),
    ("seed", -(2**63) - 1),
])
def test_invalid_values(http, field, value):
    err = _error(http.post(COMP, json={"model": "demo", "prompt": "hi", field: value}), 400)
    assert err["param"] == field and err["type"] == "invalid_request_error"


def test_chat_specific_rules(http):
    err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "top_logprobs": 2}), 400)
    assert err["param"] == "top_logprobs"
    err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "stream_options": {"include_usage": True}}), 400)
    assert err["param"] == "stream_options"
    err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "stream": True,
                                       "stream_options": {"include_usage": "yes"}}), 400)
    assert err["param"] == "stream_options.include_usage" and "include_usage" in err["message"]
    # both spellings of the completion's limit are checked, whichever wins
    err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "max_completion_tokens": 4, "max_tokens": -3}), 400)
    assert err["param"] == "max_tokens"
    err = _error(http.post(CHAT, json={"model": "demo", "messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert err["param"] == "messages[0].role"
    err = _error(http.post(CHAT, json={"model": "demo", "messages": [{"role": "user", "content": "x", "name": 5}]}), 400)
    assert (err["param"], err["code"]) == ("messages[0].name", "invalid_type")
    err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "ignore_eos": True,
                                       "response_format": {"type": "json_object"}}), 400)  # fmt: skip
    assert err["param"] == "ignore_eos" and "guide" in err["message"]
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    err = _error(http.post(CHAT, json={"model": "demo", "messages": [{"role": "user", "content": image}]}), 400)
    assert err["param"] == "messages[0].content[0]"
    err = _error(http.post(CHAT, json={"model": "demo", "messages": []}), 400)
    assert err["param"] == "messages"
    err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "tools": [{"type": "function"}]}), 400)
    assert err["param"] == "tools[0]"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "tools": [tool]}), 400)
    assert (err["param"], err["code"]) == ("tools", "unsupported_parameter")  # this gateway has no --tool-parser
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "tools": [tool], "tool_choice": choice}), 400)
        assert (err["param"], err["code"]) == ("tools", "unsupported_parameter")
    bad = [{"type": "function", "function": {"name": "no spaces"}}, {"type": "function", "function": {"name": "f", "parameters": 3}}]
    for t in bad:
        assert _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "tools": [t]}), 400)["param"].startswith("tools[0]")
    msgs = MSGS + [{"role": "tool", "content": "sunny"}]  # a tool result names its call
    assert _error(http.post(CHAT, json={"model": "demo", "messages": msgs}), 400)["param"] == f"messages[{len(MSGS)}].tool_call_id"
    # audio output is refused however it is asked for; text alone is what every request gets
    err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, "modalities": ["text", "audio"]}), 400)
    assert (err["param"], err["code"]) == ("modalities", "unsupported_parameter")
    from services.gateway.openai_request import parse_chat

    assert parse_chat({"model": "demo", "messages": MSGS, "modalities": ["text"]}, 4).kind == "chat"
    # an integer past 64 bits (which the JSON parser reads as a float) is called too large, not "a number"
    for name in ("seed", "max_tokens"):
        err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, name: 2**64}), 400)
        assert err["param"] == name and "too large" in err["message"], err


def test_guided_output_requests_that_cannot_be_served(http):
    def err(**fields):
        return _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, **fields}), 400)

    schema = {"type": "object", "properties": {"share": {"type": "number", "minimum": 0.5}}}
    for fmt, param in ((3, "response_format"), ({"type": "xml"}, "response_format"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "response_format.json_schema.schema")):
        assert err(response_format=fmt)["param"] == param, fmt
    e = err(response_format={"type": "json_schema", "json_schema": {"name": "code", "schema": schema}})
    assert e["param"] == "response_format.json_schema.schema" and "whole number" in e["message"]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    e = err(tools=[tool], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert e["param"] == "tool_choice" and "get_time" in e["message"]
    assert err(tool_choice="required")["param"] == "tool_choice"  # no tools to call
    assert err(tools=[tool], tool_choice="sometimes")["param"] == "tool_choice"
    bounded = {"type": "function", "function": {"name": "lookup", "parameters": schema}}
    e = err(tools=[tool, bounded], tool_choice="required")
    assert e["param"] == "tools[1].function.parameters" and "minimum" in e["message"]
    e = err(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a)\\1"}}})
    assert e["param"] == "response_format.json_schema.schema" and "backreferences" in e["message"]
    e = err(tools=[tool], tool_choice="required", response_format={"type": "json_object"})
    assert e["param"] == "response_format"
    # the extras of clients written for vLLM
    for fields, param in (({"guided_regex": "(a)\\1"}, "guided_regex"), ({"guided_grammar": "root ::= x"}, "guided_grammar"),
                          ({"guided_regex": ""}, "guided_regex"),
                          ({"guided_choice": []}, "guided_choice"), ({"guided_choice": ["a", 1]}, "guided_choice"),
                          ({"guided_json": "{not json"}, "guided_json"), ({"guided_json": [1]}, "guided_json"),
                          ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
                          ({"structured_outputs": {"grammar": "a"}}, "structured_outputs"),
                          ({"guided_choice": ["a"], "guided_json": {}}, "guided_choice"),
                          ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
                          # a guide no output can follow: refused here, before a worker's engine meets it
                          ({"guided_regex": "[^\\s\\S]"}, "guided_regex"), ({"guided_json": {"$ref": "#"}}, "guided_json"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
                              "$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}}}},
                           "response_format.json_schema.schema")):  # fmt: skip
        assert err(**fields)["param"] == param, fields
    deep: dict = {}
    for _ in range(900):  # deeper than Python's recursion allows to compile or even to serialize
        deep = {"items": deep}  # (an array: small enough for this gateway's 16 KiB bodies)
    e = err(response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}})
    assert e["param"] == "response_format.json_schema.schema" and "nested too deeply" in e["message"]


def test_prompt_token_ids_out_of_vocabulary(http):
    err = _error(http.post(COMP, json={"model": "demo", "prompt": [1, 2, 10**9]}), 400)
    assert err["param"] == "prompt" and "vocabulary" in err["message"]
    err = _error(http.post(COMP, json={"model": "demo", "prompt": ["a", [1, 10**9]]}), 400)
    assert err["param"] == "prompt[1]" and "vocabulary" in err["message"]
    for batch in (["a", 3], [[1, 2], []], ["a", [1, "x"]]):
        assert _error(http.post(COMP, json={"model": "demo", "prompt": batch}), 400)["param"] == "prompt"
    err = _error(http.post(COMP, json={"model": "demo", "prompt": ["a"] * 100, "n": 3}), 400)
    assert err["param"] == "n" and "300 choices" in err["message"]


def test_unknown_model_404(http):
    err = _error(http.post(CHAT, json={"model": "nope", "messages": MSGS}), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found")


def test_prompt_too_long(http):
    err = _error(http.post(COMP, json={"model": "demo", "prompt": list(range(5, 5 + MAX_MODEL_LEN))}), 400)
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    err = _error(http.post(COMP, json={"model": "demo", "prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN}), 400)
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    err = _error(http.post(CHAT, json={"model": "demo", "messages": [{"role": "user", "content": "word " * 300}]}), 400)
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded")
    for name in ("max_tokens", "max_completion_tokens"):  # the error names the field the client sent
        err = _error(http.post(CHAT, json={"model": "demo", "messages": MSGS, name: MAX_MODEL_LEN}), 400)
        assert (err["param"], err["code"]) == (name, "context_length_exceeded") and f"'{name}'" in err["message"]
    # the Responses API names its own fields
    err = _error(http.post("/v1/responses", json={"model": "demo", "input": "Hi", "max_output_tokens": MAX_MODEL_LEN}), 400)
    assert (err["param"], err["code"]) == ("max_output_tokens", "context_length_exceeded")
    assert "'max_output_tokens'" in err["message"] and "max_completion_tokens" not in err["message"]
    err = _error(http.post("/v1/responses", json={"model": "demo", "input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "no spaces here", "schema": {}}}}), 400)  # fmt: skip
    assert err["param"] == "text.format.name" and "response_format" not in err["message"]


def test_a_huge_prompt_is_refused_from_its_head(model_dir, http, monkeypatch):
    """A prompt of many times the context's characters is refused once its head alone is over
    twice the context: the rest (here ~60x the head) is never tokenized, so a megabyte prompt
    costs the gateway milliseconds, not seconds of a thread and a core."""
    from services.gateway import prepare
    from services.gateway.config import ModelSpec
    from services.gateway.models import ServedModel
    from services.gateway.openai_request import parse_chat, parse_completion

    model = ServedModel.load(ModelSpec("demo", str(model_dir), MAX_MODEL_LEN))
    encoded: list[int] = []
    real = type(model.tokenizer).encode
    monkeypatch.setattr(type(model.tokenizer), "encode",
                        lambda self, text, **kw: encoded.append(len(text)) or real(self, text, **kw))
    head_chars = prepare.HEAD_CHARS_PER_TOKEN * MAX_MODEL_LEN
    text = "a word or two, " * (4 * head_chars)
    for req in (parse_completion({"model": "demo", "prompt": text}, 4),
                parse_chat({"model": "demo", "messages": [{"role": "user", "content": text}]}, 4)):
        with pytest.raises(APIError) as exc:
            prepare.prepare(req, model, 60.0)
        assert exc.value.code == "context_length_exceeded" and "alone are" in exc.value.message
        assert encoded == [head_chars]
        encoded.clear()
    # a long text whose head is not enough (the vocabulary's longest word again and again: ~11
    # characters a token) gets its exact count
    tok = model.tokenizer
    dense = max((tok.decode([i]) for i in range(tok.vocab_size)), key=len)
    long = dense * (head_chars // len(dense) + 1) + " word" * MAX_MODEL_LEN
    assert len(real(tok, long[:head_chars], add_special_tokens=True)) <= 2 * MAX_MODEL_LEN
    with pytest.raises(APIError) as exc:
        prepare.prepare(parse_completion({"model": "demo", "prompt": long}, 4), model, 60.0)
    assert exc.value.code == "context_length_exceeded" and "alone are" not in exc.value.message
    assert encoded == [head_chars, len(long)]
    # and through HTTP, the same OpenAI error
    err = _error(http.post(COMP, json={"model": "demo", "prompt": text[:MAX_BODY_BYTES - 100]}), 400)
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded") and "alone are" in err["message"]


def test_body_too_large_is_json_413(http):
    big = {"model": "demo", "prompt": "x" * (MAX_BODY_BYTES + 10)}
    err = _error(http.post(COMP, json=big), 413)
    assert err["code"] == "request_too_large"


def test_unknown_route_and_wrong_method(http):
    assert _error(http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert _error(http.get(COMP), 405)["code"] == "method_not_allowed"


def test_openai_client_maps_errors(gateway):
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=MSGS)
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="demo", prompt=list(range(5, 5 + MAX_MODEL_LEN)))
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="demo", messages=MSGS, n=200)
    assert exc.value.param == "n"


def test_a_port_in_use_is_a_one_line_error(model_dir):
    """The gateway binds its port before it touches the bus: a port in use, or a host that is not
    this machine's, is a one-line error and exit 2 (uvicorn's own failure came as tracebacks)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host in ("127.0.0.1", "203.0.113.7"):  # the second: TEST-NET-3, never this machine's
            proc = subprocess.run([sys.executable, "-m", "services.gateway", "--nats-url", "nats://127.0.0.1:1",
                                   "--model", f"demo={model_dir}", "--host", host, "--port", str(port)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 2 and f"cannot listen on {host}:{port}" in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr


def test_a_scored_prompt_must_fit_one_bus_message():
    """echo with logprobs sends the prompt's entries in one token event: a prompt too long for that
    is a clear 400, sized by the logprobs asked for."""
    from services.gateway.prepare import SCORED_BYTES, _check_scored_length

    _check_scored_length(SCORED_BYTES // 56, 1, "prompt")
    with pytest.raises(APIError) as exc:
        _check_scored_length(SCORED_BYTES // 56 + 1, 1, "prompt[2]")
    assert (exc.value.status, exc.value.param) == (400, "prompt[2]") and "logprobs=1" in exc.value.message
    with pytest.raises(APIError):
        _check_scored_length(4000, 20, "prompt")

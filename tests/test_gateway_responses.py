"""The Responses API's requests as the chat requests that serve them, and its refusals
(``services/gateway/responses.py``); the answers through the real stack are in tests/e2e."""

from __future__ import annotations

import pytest

from services.gateway.errors import APIError
from services.gateway.responses import ResponseShapes, parse_responses
from services.gateway.shapes import Usage


def test_instructions_and_input_become_chat_messages():
    req, echo = parse_responses({"model": "m", "instructions": "Be brief.", "input": "Hi", "max_output_tokens": 7,
                                 "temperature": 0.5, "metadata": {"k": "v"}}, 4)
    assert req.kind == "chat" and req.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    assert req.max_tokens == 7 and req.sampling["temperature"] == 0.5 and not req.stream
    assert echo["max_output_tokens"] == 7 and echo["metadata"] == {"k": "v"} and echo["text"] == {"format": {"type": "text"}}
    req, _ = parse_responses({"model": "m", "stream": True, "input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}]}, 4)
    assert [(m["role"], m["content"]) for m in req.messages] == [("system", "Rules."), ("user", "ab"), ("assistant", "c")]
    assert req.stream and req.include_usage


def test_text_format_guides_as_response_format_does():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req, echo = parse_responses({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                                                                  "schema": schema, "strict": True}}}, 4)
    assert req.sampling["guide"] and echo["text"]["format"]["name"] == "n"
    req, _ = parse_responses({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}}, 4)
    assert req.sampling["guide"]


@pytest.mark.parametrize("body, param, code", [
    ({"model": "m"}, "input", "missing_required_parameter"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools", "unsupported_parameter"),
    ({"model": "m", "input": "x", "background": True}, "background", "unsupported_parameter"),
    ({"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, "input[0]",
     "unsupported_parameter"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]", "unsupported_parameter"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"model": "m", "input": []}, "input", "invalid_value"),
    ({"model": "m", "input": "x", "text": "json"}, "text", "invalid_type"),
])
def test_what_it_cannot_serve_is_a_400_naming_the_responses_field(body, param, code):
    with pytest.raises(APIError) as e:
        parse_responses(body, 4)
    assert e.value.status == 400 and e.value.param == param
    if code:
        assert e.value.code == code
    assert "max_completion_tokens" not in e.value.message


def test_a_response_object_has_openais_fields():
    shapes = ResponseShapes("m", {"instructions": None, "max_output_tokens": 5, "temperature": 1.0, "top_p": 1.0,
                                  "text": {"format": {"type": "text"}}, "metadata": {}, "user": None}, created=7)
    body = shapes.response("completed", "hello", "length", Usage(3, 5, 2))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 5,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    assert shapes.event("response.created", response={}).startswith(b"event: response.created\ndata: ")
    assert b'"sequence_number":1' in shapes.event("response.in_progress")

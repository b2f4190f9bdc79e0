"""The Responses API's requests as the chat requests that serve them, and its refusals
(``services/gateway/responses.py``); the answers through the real stack are in tests/e2e."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.errors import APIError
from services.gateway.generation import Piece
from services.gateway.responses import ResponseShapes, events, parse_responses
from services.gateway.shapes import Usage


def test_instructions_and_input_become_chat_messages():
    req, echo, _ = parse_responses({"model": "m", "instructions": "Be brief.", "input": "Hi", "max_output_tokens": 7,
                                 "temperature": 0.5, "metadata": {"k": "v"}}, 4)
    assert req.kind == "chat" and req.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    assert req.max_tokens == 7 and req.sampling["temperature"] == 0.5 and not req.stream
    assert echo["max_output_tokens"] == 7 and echo["metadata"] == {"k": "v"} and echo["text"] == {"format": {"type": "text"}}
    req, _, _ = parse_responses({"model": "m", "stream": True, "input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}]}, 4)
    assert [(m["role"], m["content"]) for m in req.messages] == [("system", "Rules."), ("user", "ab"), ("assistant", "c")]
    assert req.stream and req.include_usage


def test_text_format_guides_as_response_format_does():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req, echo, _ = parse_responses({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                                                                  "schema": schema, "strict": True}}}, 4)
    assert req.sampling["guide"] and echo["text"]["format"]["name"] == "n"
    req, _, _ = parse_responses({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}}, 4)
    assert req.sampling["guide"]


@pytest.mark.parametrize("body, param, code", [
    ({"model": "m"}, "input", "missing_required_parameter"),
    ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "unsupported_parameter"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", None),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}},
     "tool_choice", None),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", None),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "input[0].arguments", None),
    ({"model": "m", "input": [{"type": "function_call_output", "output": "o"}]}, "input[0].call_id", "invalid_type"),
    ({"model": "m", "input": "x", "background": True}, "background", "unsupported_parameter"),
    ({"model": "m", "input": [{"type": "reasoning", "summary": []}]}, "input[0]", "unsupported_parameter"),
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
    assert "max_completion_tokens" not in e.value.message and ".function." not in e.value.message


TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"type": "function", "name": "get_time", "strict": False}]


def test_function_tools_and_their_turns_become_chats():
    req, echo, _ = parse_responses({"model": "m", "tools": TOOLS, "input": [
        {"role": "user", "content": "Weather in Oslo and the time?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]}]}, 4)
    assert req.tools == ({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                           "parameters": TOOLS[0]["parameters"]}},
                         {"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    assert req.forced_tools == ()
    user, assistant, out1, out2 = req.messages
    assert assistant["content"] == "Checking."  # its calls are the same turn's
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in assistant["tool_calls"]] == [
        ("call_1", "get_weather", {"city": "Oslo"}), ("call_2", "get_time", {})]
    assert (out1, out2) == ({"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                            {"role": "tool", "content": "noon", "tool_call_id": "call_2"})  # fmt: skip
    assert echo["tools"][0] == {**TOOLS[0], "strict": None} and echo["tools"][1]["strict"] is False
    assert (echo["tool_choice"], echo["parallel_tool_calls"]) == ("auto", True)
    # calls alone open the assistant turn; a named tool_choice forces that function, "required" any
    req, echo, _ = parse_responses({"model": "m", "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"},
                                 "parallel_tool_calls": False, "input": [
        {"type": "function_call", "call_id": "c", "name": "get_time", "arguments": ""}]}, 4)
    assert req.messages[0]["role"] == "assistant" and req.messages[0]["tool_calls"][0]["id"] == "c"
    assert req.forced_tools == ("get_time",)  # (the gateway guides its decoding to a call)
    assert echo["tool_choice"] == {"type": "function", "name": "get_time"} and echo["parallel_tool_calls"] is False
    req, _, _ = parse_responses({"model": "m", "tools": TOOLS[:1], "tool_choice": "required", "input": "x"}, 4)
    assert req.forced_tools == ("get_weather",)
    req, _, _ = parse_responses({"model": "m", "tools": TOOLS, "tool_choice": "none", "input": "x"}, 4)
    assert req.tools == ()


def _chat_body(content, calls, finish="tool_calls") -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": content, "tool_calls": calls},
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 9}}


CALL = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_tool_calls_are_function_call_items():
    shapes = ResponseShapes("m", {"tools": TOOLS})
    body = shapes.from_chat(_chat_body("Sure.", [CALL]))
    assert body["status"] == "completed" and [i["type"] for i in body["output"]] == ["message", "function_call"]
    item = body["output"][1]
    assert (item["call_id"], item["name"], item["arguments"], item["status"]) == ("call_9", "get_weather",
                                                                                  '{"city": "Oslo"}', "completed")
    assert item["id"].startswith("fc_") and body["tools"] == TOOLS
    body = shapes.from_chat(_chat_body(None, [CALL]))  # a call alone: no empty message item
    assert [i["type"] for i in body["output"]] == ["function_call"]


def _streamed(shapes, pieces) -> list[dict]:
    async def source():
        for i, p in enumerate(pieces):
            yield 0, p

    async def collect():
        return [json.loads(chunk.split(b"data: ", 1)[1]) async for chunk in events(source, shapes)]

    return asyncio.run(collect())


def test_streamed_calls_are_items_after_the_message_done():
    """Each item is added, streamed and done before the next is added (OpenAI's order), in the
    unstreamed answer's order: the message (all its text, that after a call too), then the calls."""
    shapes = ResponseShapes("m", {"tools": TOOLS})
    evs = _streamed(shapes, [Piece("\n"), Piece("Sure."), Piece(" ", tool_calls=(CALL,)), Piece("Then."),
                             Piece("", finish_reason="tool_calls", usage=Usage(4, 9))])
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["output_index"] for e in evs[2:-1]] == [0] * 8 + [1] * 4
    assert [e["delta"] for e in evs[4:7]] == ["\nSure.", " ", "Then."]  # blank before the text waits for it
    added, delta, done = evs[10], evs[11], evs[12]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert delta["item_id"] == done["item_id"] == added["item"]["id"] and done["arguments"] == CALL["function"]["arguments"]
    final = evs[-1]["response"]
    assert final["output"] == [evs[9]["item"], evs[13]["item"]]  # the items as done, in their order
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "\nSure. Then." and final["usage"]["output_tokens"] == 9
    # only calls (and blanks): no message item at all
    evs = _streamed(ResponseShapes("m", {"tools": TOOLS}), [Piece("\n", tool_calls=(CALL,)), Piece("\n"),
                                                           Piece("", finish_reason="tool_calls", usage=Usage(4, 9))])
    assert [e["type"] for e in evs][2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                                            "response.function_call_arguments.done", "response.output_item.done",
                                            "response.completed"]  # fmt: skip
    assert [i["type"] for i in evs[-1]["response"]["output"]] == ["function_call"]
    # blanks and no call: a message all the same, as the unstreamed answer has
    shapes = ResponseShapes("m", {"tools": TOOLS})
    evs = _streamed(shapes, [Piece("\n"), Piece("", finish_reason="stop", usage=Usage(4, 1))])
    assert [e["type"] for e in evs][2:] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.delta", "response.output_text.done",
                                            "response.content_part.done", "response.output_item.done",
                                            "response.completed"]  # fmt: skip
    assert evs[-1]["response"]["output"] == shapes.from_chat(_chat_body("\n", None, "stop"))["output"]


def test_a_response_object_has_openais_fields():
    shapes = ResponseShapes("m", {"instructions": None, "max_output_tokens": 5, "temperature": 1.0, "top_p": 1.0,
                                  "text": {"format": {"type": "text"}}, "metadata": {}, "user": None}, created=7)
    body = shapes.response("completed", [shapes.message("hello", "incomplete")], "length", Usage(3, 5, 2))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 5,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    assert shapes.event("response.created", response={}).startswith(b"event: response.created\ndata: ")
    assert body["store"] is False  # nothing keeps it
    assert b'"sequence_number":1' in shapes.event("response.in_progress")


def test_a_response_to_be_stored_says_so_from_its_first_event_and_at_the_end_whether_it_was():
    async def kept(response: dict) -> bool:
        return True

    async def lost(response: dict) -> bool:
        return False

    for keep, stored in ((kept, True), (lost, False)):
        evs = _streamed(ResponseShapes("m", {}, keep=keep), [Piece("Hi"), Piece("", finish_reason="stop", usage=Usage(2, 1))])
        assert [e["response"]["store"] for e in evs if "response" in e] == [True, True, stored]

"""OpenAI's Responses API (``POST /v1/responses``): a request becomes a chat request (its
``instructions`` a system message, its ``input`` the messages) served by the same pipeline, and its
answer is shaped as a ``response`` object, or streamed as Responses events.

Supported: ``input`` (a string, or items: messages ``{"role", "content"}`` whose content is a string
or ``input_text``/``output_text`` parts, ``function_call`` items (an assistant turn's calls) and
``function_call_output`` items (a tool message)), ``instructions``, ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``, ``text.format`` (text, json_object, json_schema: guided, as
chat's ``response_format``), function ``tools`` with ``tool_choice`` (read with the gateway's
``--tool-parser``, as chat's; a call comes back as a ``function_call`` output item),
``parallel_tool_calls`` (echoed), ``user``/``metadata`` (carried), ``store`` (default true: the
answer is kept, ``services/gateway/stored.py``) and ``previous_response_id`` (a stored answer's
conversation comes before ``input``; its ``instructions`` do not carry over), and the sampling
extras chat takes (``seed``, ``top_k``...). Refused with 400: ``conversation``, tools other than
functions, ``reasoning``, ``background``, and other input items.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway import fields as f
from services.gateway.errors import APIError, invalid, wrong_type
from services.gateway.generation import Piece
from services.gateway.openai_request import OpenAIRequest, parse_chat
from services.gateway.shapes import Usage

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
UNSUPPORTED = ("conversation", "reasoning", "prompt")
# chat's names for what a Responses request calls otherwise, for its errors
_PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


@dataclass
class ResponsesCall:
    """A Responses request as the chat pipeline serves it: what its response echoes back, and
    ``keep`` (the response -> whether it was stored), None when it is not to be stored."""

    echo: dict
    keep: Callable[[dict], Awaitable[bool]] | None = None


def parse_responses(body: Any, max_stop: int, history: list[dict] | None = None) -> tuple[OpenAIRequest, dict, list[dict]]:
    """The chat request that serves a Responses request, what its response echoes back, and its
    conversation as chat messages (``history``, a stored response's, then its ``input``; not its
    ``instructions``)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, code="invalid_json")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], ""):
            raise APIError(400, f"'{name}' is not supported by this server.", param=name, code="unsupported_parameter")
    if body.get("background"):
        raise APIError(400, "'background' is not supported by this server.", param="background",
                       code="unsupported_parameter")
    instructions = f.get_str(body, "instructions")
    conversation = list(history or []) + _input(body.get("input"))
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "user", "seed", "top_k", "min_p",
                                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                                 "stop", "stop_token_ids", "logit_bias", "priority", "service_tier") if k in body}  # fmt: skip
    chat["messages"] = messages
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if t.get(k) is not None}} for t in tools]  # fmt: skip
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise wrong_type("text", "an object", body["text"])
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    try:
        req = parse_chat(chat, max_stop)
    except APIError as exc:
        if exc.param in _PARAMS:
            exc.param = _PARAMS[exc.param]
            exc.message = exc.message.replace("'max_completion_tokens'", "'max_output_tokens'")
        elif exc.param and exc.param.startswith("response_format.json_schema."):  # text.format holds the fields
            exc.param = "text.format." + exc.param.removeprefix("response_format.json_schema.")
            exc.message = exc.message.replace("response_format.json_schema.", "text.format.")
        elif exc.param and exc.param.startswith("tools["):  # chat's tools[i].function.x is tools[i].x here
            exc.param = exc.param.replace(".function", "", 1)
            exc.message = exc.message.replace(".function.", ".")
        raise
    if req.max_tokens is not None:  # (a context-length refusal names it as this request did)
        req = dataclasses.replace(req, max_tokens_param="max_output_tokens")
    echo = {"instructions": instructions, "max_output_tokens": req.max_tokens,
            "temperature": req.sampling["temperature"], "top_p": req.sampling["top_p"],
            "text": {"format": fmt or {"type": "text"}}, "metadata": f.get_dict(body, "metadata") or {},
            "user": req.user, "tools": tools, "tool_choice": choice if choice is not None else "auto",
            "parallel_tool_calls": f.get_bool(body, "parallel_tool_calls", True),
            "store": f.get_bool(body, "store", True), "previous_response_id": body.get("previous_response_id") or None}  # fmt: skip
    return req, echo, conversation


def answer_turn(response: dict) -> list[dict]:
    """A response's output as the chat messages of its turn (for the conversation stored with it)."""
    return _input(response["output"]) if response["output"] else []


def _tools(raw: Any) -> list[dict]:
    """Function tools, as the response echoes them (chat checks their names and schemas)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise wrong_type("tools", "an array", raw)
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"'tools[{i}]' must be a function tool {{'type': 'function', 'name': ...}}; other "
                           "tools (web search, file search, MCP...) are not supported by this server.",
                           param=f"tools[{i}]", code="unsupported_parameter")  # fmt: skip
        out.append({"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("parameters"), "strict": tool.get("strict")})  # fmt: skip
    return out


def _tool_choice(choice: Any) -> Any:
    """``tool_choice`` in chat's terms: a named function is ``{"type": "function", "name"}`` here."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}.",
                          "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _input(raw: Any) -> list[dict]:
    if raw is None:
        raise APIError(400, "Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a string or a non-empty array of items.", "input")
    out: list[dict] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call":  # a call the model made: its assistant turn's (one turn holds all its calls)
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": "", "tool_calls": []})
            out[-1].setdefault("tool_calls", []).append(_call(item, where))
        elif kind == "function_call_output":  # what the client's function returned
            if not isinstance(item.get("call_id"), str):
                raise wrong_type(f"{where}.call_id", "a string", item.get("call_id"))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _content(item.get("output"), f"{where}.output")})
        elif kind == "message" and item.get("role") in ROLES:
            out.append({"role": ROLES[item["role"]], "content": _content(item.get("content"), f"{where}.content")})
        else:
            raise APIError(400, f"'{where}' must be a message {{'role': 'user' | 'assistant' | 'system' | 'developer', "
                           "'content': ...}, a function_call or a function_call_output; other input items are not "
                           "supported by this server.", param=where, code="unsupported_parameter")  # fmt: skip
    return out


def _call(item: dict, where: str) -> dict:
    """A ``function_call`` input item as chat's tool call (chat checks its arguments)."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise wrong_type(f"{where}.{name}", "a string", item.get(name))
    try:
        orjson.loads(item["arguments"] or "{}")
    except orjson.JSONDecodeError:
        raise invalid(f"'{where}.arguments' must be a JSON string.", f"{where}.arguments") from None
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(where, "a string or an array of text parts", content)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            raise APIError(400, f"'{where}[{j}]' must be an input_text or output_text part; other parts (images, "
                           "files) are not supported by this server.", param=f"{where}[{j}]",
                           code="unsupported_parameter")  # fmt: skip
        texts.append(part["text"])
    return "".join(texts)


def _response_format(fmt: Any) -> dict:
    """``text.format`` as chat's ``response_format`` (Responses puts the schema's fields at the top)."""
    if not isinstance(fmt, dict):
        raise wrong_type("text.format", "an object", fmt)
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}  # fmt: skip
    return fmt


class ResponseShapes:
    """The ``response`` object and its stream events for one request."""

    def __init__(self, model: str, echo: dict, created: int | None = None,
                 keep: Callable[[dict], Awaitable[bool]] | None = None) -> None:  # fmt: skip
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model, self.echo, self.keep = model, echo, keep
        self.created = created if created is not None else int(time.time())
        self.seq = 0

    def response(self, status: str, output: list[dict] | None = None, finish: str | None = None,
                 usage: Usage | None = None) -> dict:  # fmt: skip
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": None, "model": self.model, "output": output or [],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "previous_response_id": None,
                "service_tier": "default", "usage": None, **self.echo,
                "store": self.keep is not None}  # fmt: skip (finish says whether it was)
        if finish == "length":
            body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        if usage is not None:
            body["usage"] = {"input_tokens": usage.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                             "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": usage.prompt_tokens + usage.completion_tokens}  # fmt: skip
        return body

    def message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": []}

    @staticmethod
    def function_call(call: dict) -> dict:
        """A chat tool call as a completed ``function_call`` output item (its chat id is the ``call_id``)."""
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    async def finish(self, response: dict) -> dict:
        """The final ``response``, stored when it is to be (``store`` says whether it was)."""
        if self.keep is not None and response["status"] in ("completed", "incomplete"):
            response["store"] = True  # (as kept)
            response["store"] = await self.keep(response)
        return response

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def from_chat(self, chat: dict) -> dict:
        """A non-streamed chat completion body as a ``response``: its text a message item (unless it
        is empty beside calls), then a ``function_call`` item per tool call."""
        choice = chat["choices"][0]
        u = chat["usage"]
        usage = Usage(u["prompt_tokens"], u["completion_tokens"], u.get("prompt_tokens_details", {}).get("cached_tokens", 0))
        text, calls = choice["message"].get("content") or "", choice["message"].get("tool_calls") or []
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output = [self.message(text, status)] if text.strip() or not calls else []
        output += [self.function_call(c) for c in calls]
        return self.response("completed", output, choice["finish_reason"], usage)


async def events(pieces: Callable[[], AsyncIterator[tuple[int, Piece]]], shapes: ResponseShapes) -> AsyncIterator[bytes]:
    """The Responses stream of one answer: created, in_progress, then its output items, each added,
    streamed and done before the next is added (as OpenAI streams them), in the order of the
    unstreamed answer's output: the message item (its text part added, a delta per piece of text,
    the text, part and item done), then a ``function_call`` item per tool call (added, its
    arguments, done); then completed (or incomplete, when max_output_tokens ended it, or failed
    with the error). Without tools the message item opens at once; with tools, at its first text
    that is not blank (an answer that is only calls and blanks has none), and the calls wait for
    the answer's end, since text may follow them."""
    ev = shapes.event
    yield ev("response.created", response=shapes.response("in_progress"))
    yield ev("response.in_progress", response=shapes.response("in_progress"))
    out = _Output(shapes)
    if not shapes.echo.get("tools"):
        for chunk in out.open_message():
            yield chunk
    async with contextlib.aclosing(pieces()) as stream:
        async for _, piece in stream:
            for chunk in out.piece(piece):
                yield chunk
            if out.final is not None:  # NOTE: stored before it is told: the client may continue it at once
                status, response = out.final
                yield ev(f"response.{status}", response=await shapes.finish(response))
            if piece.error is not None or piece.finish_reason is not None:
                return


class _Output:
    """A streamed answer's output items so far, and the events each piece makes.

    NOTE: items never interleave: the message item, open while text may come, is done before the
    first ``function_call`` item is added, so calls are held to the answer's end (the parsers give
    them whole, and an answer's calls are mostly its end anyway)."""

    def __init__(self, shapes: ResponseShapes) -> None:
        self.shapes = shapes
        self.items: list[dict | None] = []  # in output_index order; None: the message, still open
        self.message_index: int | None = None
        self.text: list[str] = []
        self.held = ""  # with tools: blank text before the message opens (dropped if no text follows)
        self.calls: list[dict] = []  # chat tool calls so far, held to the end
        self.final: tuple[str, dict] | None = None  # the last event's status and response, once finished

    def open_message(self) -> list[bytes]:
        ev, mid = self.shapes.event, self.shapes.message_id
        self.message_index = len(self.items)
        self.items.append(None)
        return [ev("response.output_item.added", output_index=self.message_index, item=self.shapes.message(None, "in_progress")),
                ev("response.content_part.added", item_id=mid, output_index=self.message_index, content_index=0,
                   part=self.shapes.part(""))]  # fmt: skip

    def piece(self, piece: Piece) -> list[bytes]:
        shapes = self.shapes
        if piece.error is not None:
            error = piece.error.body()["error"]
            failed = shapes.response("failed")
            failed["error"] = {"code": error.get("code") or "server_error", "message": error["message"]}
            return [shapes.event("response.failed", response=failed)]
        out: list[bytes] = []
        text = piece.text
        if text and self.message_index is None:  # (with tools) the answer's first text: blank between calls waits
            self.held, text = ("", self.held + text) if text.strip() else (self.held + text, "")
            if text:
                out += self.open_message()
        out += self._text(text)
        self.calls += piece.tool_calls
        if piece.finish_reason is not None:
            status = "incomplete" if piece.finish_reason == "length" else "completed"
            if self.message_index is None and not self.calls:  # blanks alone are a message, as unstreamed
                out += self.open_message() + self._text(self.held)
            if self.message_index is not None:
                out += self._close_message(status)
            for call in self.calls:
                out += self._call(call)
            self.final = (status, shapes.response(status, self.items, piece.finish_reason, piece.usage))
        return out

    def _text(self, text: str) -> list[bytes]:
        if not text:
            return []
        self.text.append(text)
        return [self.shapes.event("response.output_text.delta", item_id=self.shapes.message_id,
                                  output_index=self.message_index, content_index=0, delta=text, logprobs=[])]  # fmt: skip

    def _close_message(self, status: str) -> list[bytes]:
        ev, shapes = self.shapes.event, self.shapes
        whole, i, mid = "".join(self.text), self.message_index, shapes.message_id
        self.items[i] = shapes.message(whole, status)
        return [ev("response.output_text.done", item_id=mid, output_index=i, content_index=0, text=whole, logprobs=[]),
                ev("response.content_part.done", item_id=mid, output_index=i, content_index=0, part=shapes.part(whole)),
                ev("response.output_item.done", output_index=i, item=self.items[i])]  # fmt: skip

    def _call(self, call: dict) -> list[bytes]:
        """A call's ``function_call`` item, added, its arguments (whole: the parser gives whole calls), done."""
        ev, item, index = self.shapes.event, self.shapes.function_call(call), len(self.items)
        self.items.append(item)
        fid, args = item["id"], item["arguments"]
        return [ev("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}),
                ev("response.function_call_arguments.delta", item_id=fid, output_index=index, delta=args),
                ev("response.function_call_arguments.done", item_id=fid, output_index=index, arguments=args),
                ev("response.output_item.done", output_index=index, item=item)]  # fmt: skip

"""OpenAI's Responses API (``POST /v1/responses``), for text: a request becomes a chat request (its
``instructions`` a system message, its ``input`` the messages) served by the same pipeline, and its
answer is shaped as a ``response`` object, or streamed as Responses events.

Supported: ``input`` (a string, or messages ``{"role", "content"}`` whose content is a string or
``input_text``/``output_text`` parts), ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, ``stream``, ``text.format`` (text, json_object, json_schema: guided, as chat's
``response_format``), ``user``/``metadata`` (carried), ``store`` (nothing is stored: a response
cannot be fetched or continued later), and the sampling extras chat takes (``seed``, ``top_k``...).
Refused with 400: ``previous_response_id`` and ``conversation`` (nothing is stored), ``tools``,
``reasoning``, ``background``, and input items other than messages.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from services.gateway import fields as f
from services.gateway.errors import APIError, invalid, wrong_type
from services.gateway.generation import Piece
from services.gateway.openai_request import OpenAIRequest, parse_chat
from services.gateway.shapes import Usage

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
UNSUPPORTED = ("previous_response_id", "conversation", "tools", "reasoning", "prompt")
# chat's names for what a Responses request calls otherwise, for its errors
_PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def parse_responses(body: Any, max_stop: int) -> tuple[OpenAIRequest, dict]:
    """The chat request that serves a Responses request, and what its response echoes back."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, code="invalid_json")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], ""):
            raise APIError(400, f"'{name}' is not supported by this server.", param=name, code="unsupported_parameter")
    if body.get("background"):
        raise APIError(400, "'background' is not supported by this server.", param="background",
                       code="unsupported_parameter")
    instructions = f.get_str(body, "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _input(body.get("input"))
    chat = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "user", "seed", "top_k", "min_p",
                                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                                 "stop", "stop_token_ids", "logit_bias") if k in body}  # fmt: skip
    chat["messages"] = messages
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
        raise
    echo = {"instructions": instructions, "max_output_tokens": req.max_tokens,
            "temperature": req.sampling["temperature"], "top_p": req.sampling["top_p"],
            "text": {"format": fmt or {"type": "text"}}, "metadata": f.get_dict(body, "metadata") or {},
            "user": req.user}  # fmt: skip
    return req, echo


def _input(raw: Any) -> list[dict]:
    if raw is None:
        raise APIError(400, "Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a string or a non-empty array of messages.", "input")
    out = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in ROLES:
            raise APIError(400, f"'{where}' must be a message {{'role': 'user' | 'assistant' | 'system' | 'developer', "
                           "'content': ...}; other input items are not supported by this server.",
                           param=where, code="unsupported_parameter")  # fmt: skip
        out.append({"role": ROLES[item["role"]], "content": _content(item.get("content"), f"{where}.content")})
    return out


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

    def __init__(self, model: str, echo: dict, created: int | None = None) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model, self.echo = model, echo
        self.created = created if created is not None else int(time.time())
        self.seq = 0

    def response(self, status: str, text: str | None = None, finish: str | None = None,
                 usage: Usage | None = None) -> dict:  # fmt: skip
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": None, "model": self.model, "output": [],
                "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "previous_response_id": None,
                "store": False, "usage": None, **self.echo}  # fmt: skip
        if text is not None:
            body["output"] = [self.message(text, "completed" if finish != "length" else "incomplete")]
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

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def from_chat(self, chat: dict) -> dict:
        """A non-streamed chat completion body as a ``response``."""
        choice = chat["choices"][0]
        u = chat["usage"]
        usage = Usage(u["prompt_tokens"], u["completion_tokens"], u.get("prompt_tokens_details", {}).get("cached_tokens", 0))
        return self.response("completed", choice["message"].get("content") or "", choice["finish_reason"], usage)


async def events(pieces: Callable[[], AsyncIterator[tuple[int, Piece]]], shapes: ResponseShapes) -> AsyncIterator[bytes]:
    """The Responses stream of one answer: created, in_progress, the message item and its text part
    added, a delta per piece of text, the text, part and item done, then completed (or incomplete,
    when max_output_tokens ended it, or failed with the error)."""
    ev = shapes.event
    yield ev("response.created", response=shapes.response("in_progress"))
    yield ev("response.in_progress", response=shapes.response("in_progress"))
    yield ev("response.output_item.added", output_index=0, item=shapes.message(None, "in_progress"))
    yield ev("response.content_part.added", item_id=shapes.message_id, output_index=0, content_index=0,
             part=shapes.part(""))
    text: list[str] = []
    async with contextlib.aclosing(pieces()) as stream:
        async for _, piece in stream:
            for chunk in _piece_events(piece, shapes, text):
                yield chunk
            if piece.error is not None or piece.finish_reason is not None:
                return


def _piece_events(piece: Piece, shapes: ResponseShapes, text: list[str]) -> list[bytes]:
    """The events one piece makes (``text``: the answer's text so far, appended to)."""
    ev = shapes.event
    out: list[bytes] = []
    if piece.error is not None:
        error = piece.error.body()["error"]
        failed = shapes.response("failed")
        failed["error"] = {"code": error.get("code") or "server_error", "message": error["message"]}
        return [ev("response.failed", response=failed)]
    if piece.text:
        text.append(piece.text)
        out.append(ev("response.output_text.delta", item_id=shapes.message_id, output_index=0, content_index=0,
                      delta=piece.text, logprobs=[]))
    if piece.finish_reason is not None:
        whole = "".join(text)
        status = "incomplete" if piece.finish_reason == "length" else "completed"
        out += [ev("response.output_text.done", item_id=shapes.message_id, output_index=0, content_index=0,
                   text=whole, logprobs=[]),
                ev("response.content_part.done", item_id=shapes.message_id, output_index=0, content_index=0,
                   part=shapes.part(whole)),
                ev("response.output_item.done", output_index=0, item=shapes.message(whole, status)),
                ev(f"response.{status}", response=shapes.response(status, whole, piece.finish_reason, piece.usage))]
    return out

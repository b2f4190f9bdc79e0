"""Server-sent events: the chunk sequence of one streamed response, and the ASGI response that
sends it while watching for the client to hang up."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import AsyncContextManager

import logging

import orjson

from services.gateway.generation import Piece
from services.gateway.shapes import Shapes, Usage

DONE = b"data: [DONE]\n\n"
log = logging.getLogger("llmbus.gateway")


def event(body: dict) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def chunks(pieces: Callable[[], AsyncIterator[tuple[int, Piece]]], choices: int, shapes: Shapes,
                 include_usage: bool, n: int = 1) -> AsyncIterator[bytes]:
    """OpenAI's stream of ``choices`` choices' ``pieces()``: (chat) a role chunk per choice, content
    chunks, a chunk with finish_reason per choice (each chunk names its choice by ``index``; choices
    interleave as their tokens come), a usage chunk with empty choices when asked, then ``[DONE]``.
    A failure of any choice ends it with an error event."""
    if shapes.kind == "chat":
        for i in range(choices):
            yield event(shapes.chunk("", None, None, first=True, include_usage=include_usage, index=i))
    usages: dict[int, Usage] = {}
    calls = [0] * choices  # tool calls sent per choice
    async with contextlib.aclosing(pieces()) as stream:
        async for i, piece in stream:
            if piece.error is not None:
                yield event(piece.error.body())
                break
            if piece.text or piece.logprobs or piece.tool_calls:
                numbered = list(enumerate(piece.tool_calls, start=calls[i]))
                calls[i] += len(numbered)
                yield event(shapes.chunk(piece.text, None, piece.logprobs, include_usage=include_usage, index=i,
                                         tool_calls=numbered))
            if piece.finish_reason is not None:
                empty = None if shapes.kind == "chat" else ""
                yield event(shapes.chunk(empty, piece.finish_reason, None, include_usage=include_usage, index=i))
                if piece.usage is not None:
                    usages[i] = piece.usage
        else:
            if include_usage and len(usages) == choices:
                yield event(shapes.usage_chunk(Usage.of_choices([usages[i] for i in range(choices)], n)))
    yield DONE


class SSEResponse:
    """An ASGI response streaming ``body`` as text/event-stream inside ``guard()`` (the per-request
    abort context). A client disconnect cancels the body at once, even while no token arrives."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, body: AsyncIterator[bytes], guard: Callable[[], AsyncContextManager],
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        self.body = body
        self.guard = guard
        if headers:  # NOTE: extra headers (the tenant's x-ratelimit-*) after the stream's own
            self.headers = self.headers + [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        async with self.guard():
            sender = asyncio.ensure_future(self._send_all(send))
            listener = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (sender, listener):
                    task.cancel()
                for task in (sender, listener):
                    with contextlib.suppress(asyncio.CancelledError, OSError):
                        try:
                            await task
                        except Exception as exc:  # a send to a closed socket, or a bug: log, do not raise
                            log.info("stream ended early: %s: %s", type(exc).__name__, exc)
                with contextlib.suppress(Exception):
                    await self.body.aclose()

    async def _send_all(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        async for data in self.body:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass

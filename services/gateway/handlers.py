"""Serving one completion or chat request: prepare it, submit it to the bus, and answer with SSE
or one JSON body. The per-request abort context covers everything after the submit."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import orjson
from starlette.requests import Request
from starlette.responses import Response

from services.gateway.aborts import abort_unless_finished
from llmbus.model.tokenizer import IncrementalDetokenizer
from services.gateway.bus_client import GatewayBus
from services.gateway.config import GatewayConfig
from services.gateway.errors import APIError
from services.gateway.generation import Generation
from services.gateway.models import ModelRegistry
from services.gateway.openai_request import OpenAIRequest
from services.gateway.prepare import prepare
from services.gateway.shapes import Shapes, TokenLogprob
from services.gateway.sse import SSEResponse, chunks
from services.gateway.token_stream import TokenStream


@dataclass
class Gateway:
    """What every handler needs: passed in, never global."""

    config: GatewayConfig
    models: ModelRegistry
    bus: GatewayBus | None = None  # set once the NATS connection is up


async def serve(gw: Gateway, http: Request, req: OpenAIRequest):
    model = gw.models.get(req.model)
    # NOTE: rendering and tokenizing a large prompt takes a while: keep it off the event loop
    prepared = await asyncio.to_thread(prepare, req, model, gw.config.request_timeout_s)
    if gw.bus is None:
        raise APIError(503, "the gateway is not connected to the bus yet", type="server_error",
                       code="service_unavailable")
    rid = prepared.request.request_id
    bus = gw.bus
    stream = TokenStream(rid, gw.config.token_timeout_s, busy=lambda worker: bus.workers_busy(model.name, worker),
                         deadline=prepared.request.deadline)
    tok = model.tokenizer
    gen = Generation(stream, IncrementalDetokenizer(tok, prepared.request.prompt_token_ids),
                     tok.token_bytes,
                     stops=req.stop, logprobs=req.logprobs is not None,
                     prompt_tokens=len(prepared.request.prompt_token_ids))
    shapes = Shapes(req.kind, rid, model.name, prepared.created)
    sub = await gw.bus.submit(prepared.request, stream)

    def guard():
        return abort_unless_finished(gw.bus, rid, sub, gen)

    if req.stream:
        return SSEResponse(chunks(gen, shapes, req.include_usage), guard)
    async with guard():
        body = await _until_disconnect(http, _collect(gen, shapes))
    if body is None:  # the client hung up; the guard has published the abort
        return Response(status_code=499)
    return Response(orjson.dumps(body), media_type="application/json")


async def _collect(gen: Generation, shapes: Shapes) -> dict:
    text: list[str] = []
    logprobs: list[TokenLogprob] | None = [] if gen.wants_logprobs else None
    async for piece in gen.pieces():
        if piece.error is not None:
            raise piece.error
        text.append(piece.text)
        if logprobs is not None and piece.logprobs:
            logprobs.extend(piece.logprobs)
        if piece.finish_reason is not None:
            return shapes.response("".join(text), piece.finish_reason, logprobs, piece.usage)
    raise APIError(500, "the token stream ended without a finish", type="server_error", code="internal_error")


async def _until_disconnect(http: Request, coro) -> dict | None:
    """Run ``coro``; if the client disconnects first, cancel it and return None."""
    work = asyncio.ensure_future(coro)

    async def hung_up() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (listener, work):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    return None if work.cancelled() else work.result()

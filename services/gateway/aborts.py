"""Per-request cleanup as a context manager: whatever ends the request (client disconnect, stop
string, broken token stream, gateway error), its events stop being routed to it and, unless the
workers finished the request themselves, an Abort is published so they free its blocks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from services.gateway.bus_client import GatewayBus, Listening
from services.gateway.generation import Generation

log = logging.getLogger("llmbus.gateway")


@contextlib.asynccontextmanager
async def abort_unless_finished(bus: GatewayBus, request_id: str, sub: Listening,
                                generation: Generation) -> AsyncIterator[None]:
    reason = "client_disconnected"
    try:
        yield
    except Exception:
        reason = "gateway_error"
        raise
    finally:
        sub.close()
        if not generation.finished:
            if generation.stopped_by_string:
                reason = "stop_string"
            elif generation.failed:
                reason = "token_stream_failed"
            # NOTE: shielded, so the abort still goes out when the handler itself is being cancelled
            await _shielded(_abort(bus, request_id, reason))


async def release_ended(bus: GatewayBus, request_id: str, sub: Listening, generation: Generation) -> None:
    """A choice that has had its last piece while others of its request go on: stop routing its
    events and, if the workers are still generating it (a stop string ended it here), abort it
    now rather than when the whole request ends."""
    sub.close()
    if not generation.finished and generation.stopped_by_string:
        generation.finished = True  # its abort is out: the request's guard sends no second one
        await _shielded(_abort(bus, request_id, "stop_string"))


async def _abort(bus: GatewayBus, request_id: str, reason: str) -> None:
    try:
        await bus.abort(request_id, reason)
        log.info("aborted %s (%s)", request_id, reason)
    except Exception as exc:
        log.warning("could not publish the abort for %s: %s", request_id, exc)


async def _shielded(coro) -> None:
    """Await ``coro`` in its own task: if we are cancelled meanwhile, it still runs to the end."""
    await asyncio.shield(asyncio.ensure_future(coro))

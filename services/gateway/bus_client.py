"""The gateway's side of the bus, the only gateway module that touches NATS.

Submitting a request subscribes to its token subject FIRST, then publishes the GenerateRequest to
JetStream with ``Nats-Msg-Id = request_id`` (dedup on retries).

NOTE: the SUB and the publish go out on the same connection in that order, and the server handles
one connection's protocol lines in order, so no token event can be published before we listen.
"""

from __future__ import annotations

import nats
from nats.aio.subscription import Subscription
from nats.js.errors import NoStreamResponseError

from llmbus.bus import subjects
from llmbus.protocol import Abort, GenerateRequest, encode
from services.gateway.errors import server_error
from services.gateway.token_stream import TokenStream


class GatewayBus:
    def __init__(self, nc: nats.NATS, publish_timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=publish_timeout_s)

    async def submit(self, request: GenerateRequest, stream: TokenStream) -> Subscription:
        """Listen on the request's token subject, then enqueue the request. Returns the
        subscription (the caller unsubscribes). Raises APIError 503 when the bus refuses."""

        async def on_token(msg) -> None:
            stream.push(msg.data)

        sub = await self.nc.subscribe(request.token_subject, cb=on_token)
        try:
            await self.js.publish(subjects.request_subject(request.model), encode(request),
                                  headers={subjects.MSG_ID_HEADER: request.request_id})
        except NoStreamResponseError:
            await _quiet_unsubscribe(sub)
            raise server_error("the request queue does not exist (is the router's stream set up?)", 503,
                               code="service_unavailable") from None
        except Exception as exc:  # timeouts, disconnects: the client sees 503, not a traceback
            await _quiet_unsubscribe(sub)
            raise server_error(f"could not enqueue the request: {type(exc).__name__}: {exc}", 503,
                               code="service_unavailable") from None
        return sub

    async def abort(self, request_id: str, reason: str) -> None:
        """Tell every worker to stop ``request_id`` and free its blocks (core NATS, at most once)."""
        await self.nc.publish(subjects.abort(request_id), encode(Abort(request_id, reason)))


async def _quiet_unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception:  # the connection may be closing; nothing more to free
        pass

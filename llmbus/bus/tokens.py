"""Sending and reading TokenEvents on either kind of token subject.

A request names where its events go (``GenerateRequest.token_subject``):

- ``llmbus.tok.<request_id>``: one ``TokenEvent`` message per event (tools that submit their own
  requests and follow one stream);
- ``llmbus.toks.<gateway instance>``: ``TokenEvents`` messages, each carrying every event for that
  subject the publisher produced in one event-loop turn - one engine step's tokens for all of a
  gateway's requests in one message instead of one per request. At batch 32 that is 1 message per
  step instead of 32 through the worker's client, nats-server and the gateway's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgpack
from nats.errors import MaxPayloadError

from llmbus.bus import subjects
from llmbus.protocol import ProtocolError, TokenEvent, TokenEvents, encode
from llmbus.protocol.codec import from_raw

log = logging.getLogger("llmbus.tokens")

MAX_BATCH_EVENTS = 256  # per message: a batch with logprobs stays far below NATS's 1 MiB payload limit


class TokenPublisher:
    """Publishes TokenEvents in the order given; events for a batch subject are held until the
    current task yields, then leave as one ``TokenEvents`` message per subject.

    NOTE: one flush task at a time, draining what was queued before it and while it ran, so a
    request's events keep their order across flushes."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self._pending: dict[str, list[TokenEvent]] = {}
        self._flushing: asyncio.Task | None = None

    async def publish(self, subject: str, event: TokenEvent) -> None:
        if not subjects.is_token_batches(subject):
            await self.nc.publish(subject, encode(event))
            return
        self._pending.setdefault(subject, []).append(event)
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending:
                pending, self._pending = self._pending, {}
                for subject, events in pending.items():
                    for i in range(0, len(events), MAX_BATCH_EVENTS):
                        await self._send(subject, events[i : i + MAX_BATCH_EVENTS])
        finally:
            self._flushing = None

    async def _send(self, subject: str, events: list[TokenEvent]) -> None:
        try:
            await self.nc.publish(subject, encode(TokenEvents(events)))
        except MaxPayloadError:
            if len(events) > 1:  # one by one: only an event too big itself is lost, not the batch
                for event in events:
                    await self._send(subject, [event])
            else:  # its request's gateway finds the gap or the silence
                log.warning("token event %d of %s is bigger than the server takes", events[0].seq, events[0].request_id)
        except Exception as exc:  # a closed connection: the gateway's silence timeout reports it
            log.warning("could not publish %d token events on %s: %s", len(events), subject, exc)

    async def drain(self) -> None:
        """Wait until every event handed to ``publish`` has been given to the connection."""
        while self._flushing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._flushing)


def read_batch(data: bytes) -> list[tuple[str | None, TokenEvent | ProtocolError]]:
    """A ``TokenEvents`` payload as ``(request_id, event)`` pairs, each event checked on its own: a
    malformed one becomes ``(its request_id if readable, ProtocolError)``, so one bad event fails
    only its request. A payload that is not a TokenEvents map at all gives ``[(None, error)]``."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
        items = raw["events"]
        if not isinstance(items, list):
            raise TypeError(f"events is a {type(items).__name__}")
    except Exception as exc:
        return [(None, ProtocolError(f"TokenEvents: unreadable payload ({exc})"))]
    out: list[tuple[str | None, TokenEvent | ProtocolError]] = []
    for i, item in enumerate(items):
        rid = _request_id(item)
        try:
            out.append((rid, from_raw(TokenEvent, item)))
        except ProtocolError as exc:
            out.append((rid, ProtocolError(f"TokenEvents.events[{i}]: {exc}")))
    return out


def _request_id(item: Any) -> str | None:
    rid = item.get("request_id") if isinstance(item, dict) else None
    return rid if isinstance(rid, str) else None

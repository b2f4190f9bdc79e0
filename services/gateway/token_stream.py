"""A request's TokenEvents in ``seq`` order, with gap, silence and garbage detection.

The bus subscription pushes raw payloads into :meth:`TokenStream.push`; the request handler reads
:meth:`TokenStream.next`. No NATS here, so the ordering rules are testable on their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from llmbus.protocol import ProtocolError, TokenEvent, decode


log = logging.getLogger("llmbus.gateway")


class StreamFailure(Exception):
    """The token stream broke (gap, silence, bad payload); ``code`` names the cause."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class TokenStream:
    """``busy(last_worker)``, when given, is asked after each silent ``silence_timeout_s`` (with the
    sender of the last event, "" before the first): while it says the workers are busy, silence is
    queueing (the request waits behind others, in a stream or for blocks) and the wait goes on, up
    to ``deadline`` (unix seconds). Without it, or past the deadline, silence fails the stream."""

    def __init__(self, request_id: str, silence_timeout_s: float, *,
                 busy: Callable[[str], Awaitable[bool]] | None = None, deadline: float | None = None) -> None:
        if silence_timeout_s <= 0:
            raise ValueError(f"silence_timeout_s must be > 0, got {silence_timeout_s}")
        self.request_id = request_id
        self.silence_timeout_s = silence_timeout_s
        self.busy = busy
        self.deadline = deadline
        self.last_worker = ""  # who sent the last event
        self._queue: asyncio.Queue[bytes | TokenEvent | ProtocolError] = asyncio.Queue()
        self._next_seq = 0

    def push(self, payload: bytes | TokenEvent | ProtocolError) -> None:
        """Called by the bus for every event addressed to this request: an encoded TokenEvent, one
        already read out of a batch, or the error that made a batch entry unreadable."""
        self._queue.put_nowait(payload)

    async def _queued(self) -> bool:
        if self.busy is None or self.deadline is not None and time.time() >= self.deadline:
            return False
        return await self.busy(self.last_worker)

    async def next(self) -> TokenEvent:
        """The next event in order. Duplicates (seq already seen) are skipped.

        NOTE: core NATS keeps one publisher's order, and a request has one publisher at a time, so
        a seq beyond the expected one means an event was lost: that is a failure, not a reorder.
        """
        while True:
            try:
                # NOTE: asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that
                # races with a completed get(), and a disconnected client's stream would run on
                async with asyncio.timeout(self.silence_timeout_s):
                    payload = await self._queue.get()
            except TimeoutError:
                if await self._queued():
                    log.debug("%s: silent for %gs while the workers are busy: still queued", self.request_id,
                              self.silence_timeout_s)
                    continue
                raise StreamFailure(f"no token event for {self.silence_timeout_s:g}s (expected seq "
                                    f"{self._next_seq}); the workers stopped answering", "timeout") from None
            try:
                if isinstance(payload, ProtocolError):
                    raise payload
                event = payload if isinstance(payload, TokenEvent) else decode(TokenEvent, payload)
            except ProtocolError as exc:
                raise StreamFailure(f"malformed token event: {exc}", "bad_event") from None
            if event.request_id != self.request_id:
                raise StreamFailure(f"token event for {event.request_id!r} on {self.request_id!r}'s subject",
                                    "bad_event")
            if event.seq < self._next_seq:
                if not event.worker:  # a worker that stopped handed the request on: no holder for now
                    self.last_worker = ""
                continue
            if event.seq > self._next_seq:
                raise StreamFailure(f"token events {self._next_seq}..{event.seq - 1} were lost", "gap")
            self._next_seq += 1
            self.last_worker = event.worker
            return event

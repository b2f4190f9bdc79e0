"""Pulling work from a durable JetStream consumer only as fast as the caller can take it.

Contract for a job ``msg`` from :meth:`PullWorker.fetch` (or ``messages``):
- wrap the work in ``async with worker.working(msg):`` - it calls ``msg.in_progress()`` every
  ``heartbeat_s`` so AckWait does not expire on a long job;
- then exactly one of ``msg.ack()`` (done: the result is durably published), ``msg.nak(delay=s)``
  (transient failure: redeliver after s), ``msg.term()`` (poison: never redeliver).
- ``is_last_delivery(msg)``: the server will not redeliver after this attempt; fail the request
  clearly (a TokenEvent with finish_reason "error") instead of nak-ing it into silence.

``RecentIds`` remembers the last ids a consumer settled or was told about (an abort can arrive
before the work it cancels; a redelivery can follow work already done).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgpack
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from llmbus.bus import subjects
from llmbus.protocol import ProtocolError, TokenEvent, check_token_subject, decode
from llmbus.protocol.messages import INVALID_REQUEST

log = logging.getLogger("llmbus.worker")


# the wait for each job the consumer reported pending: another replica may have taken it meanwhile
_READY_WAIT_S = 0.05


async def read_job(record: type, msg: Msg, what: str,
                   on_malformed: Callable[[ProtocolError], Awaitable[None]] | None = None):  # fmt: skip
    """``msg``'s ``record``, or None once it is termed: a malformed payload never gets better.
    ``on_malformed(exc)`` runs first (to tell the request's client, ``malformed_failure``)."""
    try:
        return decode(record, msg.data)
    except ProtocolError as exc:
        log.warning("dropping malformed %s: %s", what, exc)
        if on_malformed is not None:
            with contextlib.suppress(Exception):
                await on_malformed(exc)
        await msg.term()
        return None


def malformed_failure(data: bytes, message: str, worker: str,
                      code: str = INVALID_REQUEST) -> tuple[str, TokenEvent] | None:  # fmt: skip
    """For a payload that is no valid GenerateRequest but names its request: the subject its
    client listens on (its ``token_subject`` when that is one it may ask for) and the final error
    event to send there (``code``: by default ``invalid_request``, the request's fault). None when
    it names none."""
    try:
        raw = msgpack.unpackb(data, raw=False)
        rid = raw["request_id"]
        subject = subjects.tokens(rid)
        with contextlib.suppress(ValueError):  # a subject it cannot have asked for: its own
            subject = check_token_subject(raw.get("token_subject") or subject, rid)
        return subject, TokenEvent.failure(rid, message, worker=worker, code=code)
    except Exception:
        return None


class RecentIds:
    """The last ``size`` ids seen, oldest forgotten first."""

    def __init__(self, size: int = 10000) -> None:
        self.size = size
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, rid: str) -> None:
        self._ids[rid] = None
        while len(self._ids) > self.size:
            self._ids.popitem(last=False)

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids


class PullWorker:
    def __init__(self, sub: JetStreamContext.PullSubscription, *, max_deliver: int, heartbeat_s: float = 5.0) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self._sub = sub
        self.max_deliver = max_deliver
        self.heartbeat_s = heartbeat_s
        # jobs the consumer reported pending after the last one it gave; 0 once a pull came back
        # empty. Stale while nobody pulls (another replica may take them meanwhile).
        self.backlog = 0

    @classmethod
    async def bind(cls, js: JetStreamContext, stream: str, consumer: str, *, max_deliver: int, heartbeat_s: float = 5.0):
        """Bind to an existing durable consumer (create it first with llmbus.bus.streams)."""
        sub = await js.pull_subscribe_bind(consumer, stream=stream)
        return cls(sub, max_deliver=max_deliver, heartbeat_s=heartbeat_s)

    async def fetch(self, capacity: int, timeout: float = 1.0) -> list[Msg]:
        """Up to ``capacity`` jobs: those ready now, or the first to arrive within ``timeout`` s;
        [] when none (or capacity < 1). See ``messages``."""
        msgs: list[Msg] = []
        async for msg in self.messages(lambda: capacity - len(msgs), timeout):
            msgs.append(msg)
        return msgs

    async def messages(self, room: Callable[[], int], timeout: float = 1.0) -> AsyncIterator[Msg]:
        """Jobs while ``room()`` > 0, asked before each: the first to arrive within ``timeout`` s,
        then as many more as the consumer reports pending. A caller that counts each job it is
        given (before it asks for the next) stops the pull where its room ends, whatever a job
        costs it.

        NOTE: one message at a time: the first within ``timeout``, then each pending one within
        ``_READY_WAIT_S``. nats-py's ``fetch(n)`` for n > 1 returns only when n messages came or
        the pull request expired, so a lone job published while a worker waited could sit in its
        queue for the rest of the wait (a real server: 74-143 ms in about 1 of 10-30 publishes at
        n = 64, 1 ms at n = 1; a decode worker's handoff 150-230 ms, which was the p99 of short
        requests' TPOT). A ``fetch(n)`` cut short also leaves the rest of its batch to land in the
        local queue, which its next call takes whole, past any room; a ``fetch(1)`` cut short
        leaves at most one, which the next call takes first."""
        if room() < 1:
            await asyncio.sleep(min(timeout, 0.05))
            return
        # NOTE: jobs reported pending are there already (unless another replica took them): a pull
        # that finds none must not hold the room for the whole wait
        wait = _READY_WAIT_S if self.backlog else timeout
        while room() > 0:
            try:
                msgs = await self._sub.fetch(1, timeout=wait)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):  # NOTE: nats raises either on an empty fetch
                self.backlog = 0
                return
            self.backlog = msgs[-1].metadata.num_pending if msgs else 0
            for msg in msgs:
                yield msg
            if not self.backlog:
                return
            wait = _READY_WAIT_S  # a burst: the rest are there already (unless another replica took them)

    @contextlib.asynccontextmanager
    async def working(self, msg: Msg) -> AsyncIterator[None]:
        """Keep ``msg`` from being redelivered (in_progress heartbeats) while the block runs."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(self.heartbeat_s)
                with contextlib.suppress(Exception):  # a lost heartbeat only risks a redelivery
                    await msg.in_progress()

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def is_last_delivery(self, msg: Msg) -> bool:
        return msg.metadata.num_delivered >= self.max_deliver

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

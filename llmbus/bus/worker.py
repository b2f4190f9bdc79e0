"""Pulling work from a durable JetStream consumer only as fast as the caller can take it.

Contract for a job ``msg`` from :meth:`PullWorker.fetch`:
- wrap the work in ``async with worker.working(msg):`` - it calls ``msg.in_progress()`` every
  ``heartbeat_s`` so AckWait does not expire on a long job;
- then exactly one of ``msg.ack()`` (done: the result is durably published), ``msg.nak(delay=s)``
  (transient failure: redeliver after s), ``msg.term()`` (poison: never redeliver).
- ``is_last_delivery(msg)``: the server will not redeliver after this attempt; fail the request
  clearly (a TokenEvent with finish_reason "error") instead of nak-ing it into silence.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext


class PullWorker:
    def __init__(self, sub: JetStreamContext.PullSubscription, *, max_deliver: int, heartbeat_s: float = 5.0) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self._sub = sub
        self.max_deliver = max_deliver
        self.heartbeat_s = heartbeat_s

    @classmethod
    async def bind(cls, js: JetStreamContext, stream: str, consumer: str, *, max_deliver: int, heartbeat_s: float = 5.0):
        """Bind to an existing durable consumer (create it first with llmbus.bus.streams)."""
        sub = await js.pull_subscribe_bind(consumer, stream=stream)
        return cls(sub, max_deliver=max_deliver, heartbeat_s=heartbeat_s)

    async def fetch(self, capacity: int, timeout: float = 1.0) -> list[Msg]:
        """Up to ``capacity`` jobs, waiting at most ``timeout`` s; [] when none (or capacity < 1)."""
        if capacity < 1:
            await asyncio.sleep(min(timeout, 0.05))
            return []
        try:
            return await self._sub.fetch(capacity, timeout=timeout)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # NOTE: nats raises either on an empty fetch
            return []

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

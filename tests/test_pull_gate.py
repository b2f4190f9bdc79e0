"""The urgent-queue gate of ``EngineWorker.pull`` and ``PullWorker.messages``, with a stand-in
subscription (what nats-py's pull subscription returns, no server): a pull after pending jobs does
not wait out an empty queue, and an urgent loop that ends frees the others' room."""

from __future__ import annotations

import asyncio
import types

import nats.errors
import pytest

from llmbus.bus.worker import _READY_WAIT_S, PullWorker
from llmbus.worker.base import EngineWorker


class _Sub:
    """Answers each fetch from ``script``: a list of messages, or an exception to raise."""

    def __init__(self, script) -> None:
        self.script, self.waits = list(script), []

    async def fetch(self, n: int, timeout: float):
        self.waits.append(timeout)
        step = self.script.pop(0) if self.script else nats.errors.TimeoutError()
        if isinstance(step, BaseException):
            raise step
        return step


def _msg(pending: int):
    return types.SimpleNamespace(metadata=types.SimpleNamespace(num_pending=pending))


def _drain(worker: PullWorker, room: int = 8) -> list:
    async def go():
        out: list = []
        async for m in worker.messages(lambda: room - len(out), timeout=0.5):
            out.append(m)
        return out

    return asyncio.run(go())


def test_a_pull_after_jobs_were_reported_pending_waits_briefly():
    sub = _Sub([[_msg(1)], [_msg(0)]])
    worker = PullWorker(sub, max_deliver=5)
    assert len(_drain(worker)) == 2 and worker.backlog == 0 and sub.waits == [0.5, _READY_WAIT_S]
    sub.script = [[_msg(3)]]
    _drain(worker, room=1)  # room for one: three more left pending
    assert worker.backlog == 3
    sub.waits.clear()
    assert _drain(worker) == [] and sub.waits == [_READY_WAIT_S]  # another replica took them
    assert worker.backlog == 0


class _Worker(EngineWorker):
    held = 0

    async def on_abort(self, msg) -> None:
        pass


def test_an_urgent_loop_that_ends_does_not_hold_the_other_queues():
    worker = _Worker.__new__(_Worker)  # (only what pull reads)
    stop = asyncio.Event()
    worker.ctx = types.SimpleNamespace(stop=stop)
    worker.loop = types.SimpleNamespace(error=None)
    worker.report = lambda: None
    worker._urgent, worker._pulled, worker._takes_running = [], [0, 0], 0
    urgent = PullWorker(_Sub([[_msg(5)], RuntimeError("consumer deleted")]), max_deliver=5)

    async def take(msg) -> None:
        pass

    async def go():
        with pytest.raises(RuntimeError, match="consumer deleted"):
            await worker.pull(urgent, lambda jobs, tokens: 8 - jobs, take, urgent=True)

    asyncio.run(go())
    assert urgent.backlog == 0 and worker._urgent == []

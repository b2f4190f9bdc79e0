"""Runs an ``Engine`` on its own thread so the asyncio side keeps serving the bus.

The engine is single-threaded: every call on it (add, abort, import, export) goes through
``call()``, which runs the function on the engine thread between two steps and returns its result
to the event loop. Step outputs reach ``on_outputs`` on the event loop, in step order.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from llmbus.engine.engine import Engine, StepOutput

T = TypeVar("T")
log = logging.getLogger("llmbus.engine_loop")


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[StepOutput]], Any],
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._calls.put(None)
        self._thread.join(timeout)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        if self.error is not None:
            raise RuntimeError(f"the engine thread died: {self.error!r}")
        fut: asyncio.Future = self._loop.create_future()
        self._calls.put((fn, fut))
        return await fut

    def _settle(self, fut: asyncio.Future, result=None, exc: BaseException | None = None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=0.05) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            try:
                result = fn(self.engine)
            except BaseException as exc:  # the caller gets it; the engine goes on
                self._loop.call_soon_threadsafe(self._settle, fut, None, exc)
            else:
                self._loop.call_soon_threadsafe(self._settle, fut, result)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_calls(block=not self.engine.has_unfinished())
                if self._stop.is_set() or not self.engine.has_unfinished():
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)
        except BaseException as exc:
            log.exception("engine thread failed")
            self.error = exc
            self._loop.call_soon_threadsafe(self._on_outputs, [])

"""The skeleton every llmbus service runs in: connect, set up streams, serve, report, drain.

``run_service(options, body)``:
1. SIGINT/SIGTERM set ``ctx.stop`` (an ``asyncio.Event``), a second one ``ctx.hurry`` (workers stop
   without letting what they hold finish); an ``AsyncExitStack`` owns the connection.
2. Connects, creates streams/consumers idempotently, opens the registry bucket.
3. Runs ``body(ctx)``. The body subscribes, then calls ``await ctx.ready()``, which writes the
   instance's :class:`InstanceInfo` to the registry and prints ``llmbus-ready <role> <instance_id>``
   on stdout (what ``llmbus up`` waits for). A heartbeat re-puts the entry every ``heartbeat_s``
   with the figures the body last passed to ``ctx.report()``. The body returns once ``ctx.stop`` is set.
   Meanwhile the service answers ``llmbus.metrics.<instance_id>`` with the families of the sources
   the body gave ``ctx.add_metrics()``.
4. On exit: the registry entry is deleted and the connection drained (pending publishes flushed,
   subscriptions finish their callbacks). Returns a process exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from llmbus import aio, tracing
from llmbus.bus import subjects
from llmbus.bus.connection import DEFAULT_NATS_URL, NATS_URL_ENV, connect, default_nats_url
from llmbus.bus.streams import StreamLimits, ensure_registry, ensure_streams
from llmbus.protocol import InstanceInfo, MetricFamily, MetricsReply, check_id, encode
from llmbus.protocol.messages import ROLES

READY_PREFIX = "llmbus-ready"
log = logging.getLogger("llmbus.service")


@dataclass(frozen=True)
class ServiceOptions:
    role: str
    nats_url: str
    instance_id: str = ""  # "" -> "<role>-<random>"
    models: tuple[str, ...] = ()
    heartbeat_s: float = 2.0
    limits: StreamLimits = field(default_factory=StreamLimits)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.nats_url:
            raise ValueError("nats_url is required")
        if self.instance_id:
            check_id("instance_id", self.instance_id)
        else:
            object.__setattr__(self, "instance_id", f"{self.role}-{secrets.token_hex(4)}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.heartbeat_s * 2 > self.limits.registry_ttl_s:
            raise ValueError("heartbeat_s must be at most half of limits.registry_ttl_s")


class ServiceContext:
    def __init__(self, options: ServiceOptions, nc, js, registry, stack: contextlib.AsyncExitStack) -> None:
        self.options = options
        self.role = options.role
        self.instance_id = options.instance_id
        self.nc, self.js, self.registry, self.stack = nc, js, registry, stack
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()  # a second SIGINT/SIGTERM: stop without waiting for held work
        self.is_ready = False
        self._models = list(options.models)
        self._free_blocks = 0
        self._queue_depth = 0
        self._total_blocks = 0
        self._prefix: tuple[str, str, int] = ("", "", 0)
        self._metric_sources: list[Callable[[], Iterable[MetricFamily]]] = []

    def signalled(self) -> None:
        """SIGINT/SIGTERM: the first stops the service, a second hurries its stop along."""
        (self.hurry if self.stop.is_set() else self.stop).set()

    def add_metrics(self, source: Callable[[], Iterable[MetricFamily]]) -> None:
        """``source()``, called at each metrics request on the event loop, gives families this
        service answers with (counters since start, gauges as of the call)."""
        self._metric_sources.append(source)

    def metrics(self) -> MetricsReply:
        families: list[MetricFamily] = []
        for source in self._metric_sources:
            try:
                families.extend(source())
            except Exception:  # one broken source must not hide the others
                log.exception("a metrics source failed")
        return MetricsReply(self.instance_id, self.role, families)

    def report(self, *, free_blocks: int | None = None, queue_depth: int | None = None, models: list[str] | None = None,
               total_blocks: int | None = None, prefix: tuple[str, str, int] | None = None) -> None:  # fmt: skip
        """Figures for the next registry heartbeat. ``prefix``: (prefix_model, kv_format, block_size)
        of a worker's prefix cache (InstanceInfo says what they mean)."""
        if prefix is not None:
            self._prefix = prefix
        if total_blocks is not None:
            self._total_blocks = total_blocks
        if free_blocks is not None:
            self._free_blocks = free_blocks
        if queue_depth is not None:
            self._queue_depth = queue_depth
        if models is not None:
            self._models = list(models)

    def info(self) -> InstanceInfo:
        return InstanceInfo(self.instance_id, self.role, self._models, self._free_blocks, self._queue_depth,
                            socket.gethostname(), time.time(), os.getpid(), self._total_blocks,
                            block_size=self._prefix[2], kv_format=self._prefix[1], prefix_model=self._prefix[0])  # fmt: skip

    @property
    def registry_key(self) -> str:
        return subjects.registry_key(self.role, self.instance_id)

    async def heartbeat(self) -> None:
        await self.registry.put(self.registry_key, encode(self.info()))

    async def ready(self) -> None:
        await self.heartbeat()
        self.is_ready = True
        print(f"{READY_PREFIX} {self.role} {self.instance_id}", flush=True)


Body = Callable[[ServiceContext], Awaitable[None]]


async def run_service(options: ServiceOptions, body: Body) -> int:
    """Raises TracingConfigError on tracing settings it cannot use (``llmbus.tracing``),
    ConnectionError when NATS cannot be reached."""
    loop = asyncio.get_running_loop()
    if tracing.setup(options.role, options.instance_id):
        log.info("tracing on: spans go where OTEL_* says")
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(asyncio.to_thread, tracing.shutdown)  # the last spans leave after the drain
        nc = await connect(options.nats_url, name=f"{options.role}:{options.instance_id}")
        stack.push_async_callback(_drain, nc)
        js = nc.jetstream()
        await ensure_streams(js, options.limits, options.models)
        registry = await ensure_registry(js, options.limits)
        ctx = ServiceContext(options, nc, js, registry, stack)
        await _answer_metrics(ctx)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not on the main thread
                loop.add_signal_handler(sig, ctx.signalled)
                stack.callback(loop.remove_signal_handler, sig)
        beat = asyncio.create_task(_heartbeats(ctx))
        try:
            await body(ctx)
            return 0
        except Exception:
            log.exception("%s %s failed", options.role, options.instance_id)
            return 1
        finally:
            beat.cancel()
            with contextlib.suppress(BaseException):
                await beat
            with contextlib.suppress(Exception):
                await registry.delete(ctx.registry_key)


def serve(options: ServiceOptions, body: Body) -> int:
    """Run a service from its command line: the exit code, or 1 with a one-line message when NATS
    cannot be reached (2 for a setting it cannot use)."""
    try:
        return aio.run(run_service(options, body))
    except ConnectionError as exc:
        print(f"{options.role}: error: {exc}", file=sys.stderr)
        return 1
    except tracing.TracingConfigError as exc:
        print(f"{options.role}: error: {exc}", file=sys.stderr)
        return 2


async def _heartbeats(ctx: ServiceContext) -> None:
    while True:
        await asyncio.sleep(ctx.options.heartbeat_s)
        if ctx.is_ready:
            try:
                await ctx.heartbeat()
            except Exception as exc:  # a missed beat is retried; the entry's TTL covers a few
                log.warning("registry heartbeat failed: %s", exc)


async def _answer_metrics(ctx: ServiceContext) -> None:
    async def answer(msg) -> None:
        if msg.reply:
            with contextlib.suppress(Exception):  # the asker gave up and left: nothing to do
                await msg.respond(encode(ctx.metrics()))

    sub = await ctx.nc.subscribe(subjects.metrics(ctx.instance_id), cb=answer)
    ctx.stack.push_async_callback(sub.unsubscribe)


async def _drain(nc, drain_s: float = 10.0, close_s: float = 5.0) -> None:
    """Let the subscriptions finish the messages they hold and the publishes reach the server (within
    ``drain_s``), then close the connection (within ``close_s``): the process is exiting either way."""
    await _bounded(nc.drain(), drain_s)  # (refused at once mid-reconnect)
    if not nc.is_closed:
        await _bounded(nc.close(), close_s)


async def _bounded(coro, timeout: float) -> None:
    """Run ``coro`` for ``timeout`` seconds at most, then cancel it until it ends; what it raises is
    dropped.

    NOTE: not asyncio.wait_for, which waits out the cancelled coroutine: nats-py's drain swallows
    the first cancel and goes on to a flush (10 s) and a close that awaits the transport's
    wait_closed, which need never return (a server mid-restart, or too busy to read; in CI a kvpool
    outlived its SIGTERM for minutes, and a whole `llmbus up` its 90 s to stop)."""
    task = asyncio.ensure_future(coro)
    await asyncio.wait({task}, timeout=timeout)
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it
        return
    _quiet_cancelled()
    for _ in range(20):  # (two do for a drain)
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
        if task.done():
            break
    else:
        log.warning("gave up waiting for %s at shutdown", getattr(coro, "__qualname__", coro))
    del task
    gc.collect()


def _quiet_cancelled() -> None:
    """From here on (the process is exiting) drop a cancelled future's "exception was never
    retrieved": a cut-short drain leaves nats-py's gather of its subscriptions' drains so. It can
    sit in a reference cycle, which ``_bounded`` then collects at once, not at some later allocation:
    a finalizer that runs Python code in the middle of a compile trips CPython 3.11's AST recursion
    check (pytest stopped with an INTERNALERROR)."""
    loop = asyncio.get_running_loop()
    handler = loop.get_exception_handler()

    def quiet(loop, context) -> None:
        if isinstance(context.get("exception"), asyncio.CancelledError):
            return
        if handler is not None:
            handler(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(quiet)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=default_nats_url(),
                        help=f"NATS server(s), comma-separated; credentials as nats://user:password@host:port or "
                             f"nats://token@host:port (default ${NATS_URL_ENV}, else {DEFAULT_NATS_URL}; the variable "
                             "keeps credentials off the command line)")  # fmt: skip
    parser.add_argument("--instance-id", default="", help="this instance's id (default: <role>-<random>)")
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")


def setup_logging(level: str) -> None:
    name = level.upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    logging.basicConfig(level=name, format="%(asctime)s %(name)s %(levelname)s %(message)s")

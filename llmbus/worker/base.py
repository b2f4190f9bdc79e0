"""What the prefill and decode services share: the engine thread, the kvpool client, the token
publisher, the pull loop, the registry report and the memory of recent aborts."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from llmbus import tracing
from llmbus.bus import subjects
from llmbus.bus.kvclient import KVPoolClient
from llmbus.bus.service import ServiceContext
from llmbus.bus.tokens import TokenPublisher
from llmbus.bus.worker import PullWorker, RecentIds, malformed_failure
from llmbus.engine.engine import Engine, StepOutput
from llmbus.metrics import labelled, scalar
from llmbus.protocol import Abort, GenerateRequest, MetricFamily, ProtocolError, StoreReply, TokenEvent, decode, encode
from llmbus.protocol.messages import INVALID_REQUEST
from llmbus.worker.engine_loop import EngineLoop

log = logging.getLogger("llmbus.worker")

MAX_STORES = 8  # best-effort kvpool stores a worker has in flight at most
DEADLINE_CHECK_S = 1.0  # how often, at least, a publisher checks its requests' deadlines
# at stop, how long the requests a worker holds may run to their end: under `llmbus up`'s 30 s
# before SIGKILL and Kubernetes' default 30 s grace
DRAIN_S = 20.0


class EngineWorker(abc.ABC):
    def __init__(self, ctx: ServiceContext, engine: Engine, model: str, *, drain_s: float = DRAIN_S) -> None:
        if drain_s < 0:
            raise ValueError(f"drain_s must be >= 0 s, got {drain_s}")
        self.ctx = ctx
        self.engine = engine
        self.model = model
        self.drain_s = drain_s
        self.draining = False  # stopped: taking nothing new, letting what it holds finish
        self.recent_aborts = RecentIds()
        self.kv = KVPoolClient(ctx.nc, owner=ctx.instance_id)
        self.tokens = TokenPublisher(ctx.nc)
        self.loop: EngineLoop | None = None
        self._tasks: set[asyncio.Task] = set()  # background work, held until done
        self.stores_in_flight = 0
        self.spans: dict = {}  # request id -> its span here, while tracing is on
        self._urgent: list[PullWorker] = []  # the urgent queues this worker pulls (pull(urgent=True))
        # NOTE: every puller's room counts these: a burst that reaches several queues at once must
        # not fill the budget once per puller
        self._pulled = [0, 0]  # jobs pulled (by any pull loop) whose takes have not started, their cost
        self._takes_running = 0  # takes in flight, of every pull loop
        self.handed_on = 0  # requests queued again as resume jobs when this worker stopped (hand_on)
        ctx.add_metrics(self.metric_families)

    def trace(self, req: GenerateRequest, name: str, **attributes) -> None:
        """Open this worker's span of a traced request (``llmbus.tracing``); it ends with the request's
        final event here (``publish``), its abort, or ``end_span``."""
        if req.traceparent and tracing.enabled() and req.request_id not in self.spans:
            self.spans[req.request_id] = tracing.start(name, req.traceparent, attributes={
                "llmbus.request_id": req.request_id, "gen_ai.request.model": req.model,
                "gen_ai.usage.input_tokens": len(req.prompt_token_ids), "llmbus.instance": self.ctx.instance_id,
                **attributes})  # fmt: skip

    def end_span(self, rid: str, error: str = "", **attributes) -> None:
        """End ``rid``'s span here, if it has one (idempotent)."""
        span = self.spans.pop(rid, None)
        if span is not None:
            span.set_attributes(attributes)
            if error:
                tracing.fail(span, error)
            span.end()

    def metric_families(self) -> list[MetricFamily]:
        """The engine's counters, and its gauges as of now (read off the engine thread: each is one
        length or count, possibly a step old)."""
        engine = self.engine
        gauges = [
            ("llmbus_engine_requests_running", "Sequences in the engine's running batch.", engine.num_running),
            ("llmbus_engine_requests_waiting", "Sequences waiting to join the batch.", engine.num_waiting),
            ("llmbus_engine_kv_blocks_free", "Free KV blocks (cached prefix blocks no sequence holds count as free).",
             engine.num_free_blocks),
            ("llmbus_engine_kv_blocks", "KV blocks in the engine's cache.", engine.runner.num_blocks),
        ]
        families = [scalar(*g) for g in gauges] + engine.stats.families() + [scalar(
            "llmbus_worker_requests_handed_on_total",
            "Requests this worker stopped holding before their end (its shutdown) and queued again as resume "
            "jobs, continued by another worker from the tokens their clients had.", self.handed_on, "counter")]
        return [labelled(f, model=self.model) for f in families]

    def start_engine(self, on_outputs: Callable[[list[StepOutput]], None]) -> None:
        self.loop = EngineLoop(self.engine, asyncio.get_running_loop(), on_outputs)
        self.loop.start()
        self.ctx.stack.callback(self.loop.stop)
        self.ctx.stack.callback(self.kv.close)
        self.ctx.stack.push_async_callback(self.tokens.drain)  # runs before the connection closes

    async def subscribe_aborts(self) -> None:
        sub = await self.ctx.nc.subscribe(subjects.ABORTS_WILDCARD, cb=self._on_abort_msg)
        self.ctx.stack.push_async_callback(sub.unsubscribe)

    async def _on_abort_msg(self, msg) -> None:
        try:
            rid = decode(Abort, msg.data).request_id
        except ProtocolError:
            return
        self.recent_aborts.add(rid)
        await self.on_abort(rid)
        self.end_span(rid, **{"llmbus.finish_reason": "abort"})

    @abc.abstractmethod
    async def on_abort(self, rid: str) -> None:
        """Stop ``rid`` if this worker holds it."""

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` in the background, held until it is done."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settle(self, timeout: float = 5.0) -> None:
        """At stop: let background work end (a best-effort kvpool store holds a lease until it
        does), for ``timeout`` seconds at most."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    def spawn_store(self, coro) -> bool:
        """Run a best-effort kvpool store in the background, unless ``MAX_STORES`` are in flight:
        each holds a copy of its blocks while kvpool answers (up to four 5 s calls), so a slow kvpool
        must not pile them up. A store skipped only loses that prefix's reuse. Whether it runs."""
        if self.stores_in_flight >= MAX_STORES:
            coro.close()
            log.debug("skipping a kvpool store: %d in flight", self.stores_in_flight)
            return False
        self.stores_in_flight += 1

        async def run() -> None:
            try:
                await coro
            finally:
                self.stores_in_flight -= 1

        self.spawn(run())
        return True

    @staticmethod
    async def next_or_none(queue: asyncio.Queue):
        """The queue's next item, or None after DEADLINE_CHECK_S: a publisher's wait, so that it
        checks its requests' deadlines even while the engine sends it nothing.
        NOTE: asyncio.timeout, not wait_for: on 3.11 wait_for can swallow shutdown's cancel."""
        try:
            async with asyncio.timeout(DEADLINE_CHECK_S):
                return await queue.get()
        except TimeoutError:
            return None

    async def end_past_deadline(self, held: dict, now: float | None = None) -> list:
        """End the requests in ``held`` (id -> record with ``request`` and ``next_seq``) whose
        deadline has passed: each is removed from ``held`` and gets its final event, ``abort``
        with the reason, at its next seq; returns the records. Called from the task that publishes
        their events, so no event of theirs can follow; the caller stops them in the engine.

        NOTE: the gateway's deadline (its --request-timeout) bounds how long a request whose client
        is gone, and whose abort was lost, can hold a batch slot and blocks."""
        now = time.time() if now is None else now
        ended = [rid for rid, rec in held.items() if rec.request.deadline is not None and rec.request.deadline < now]
        records = [held.pop(rid) for rid in ended]
        for rec in records:
            await self.end_with_abort(rec.request, rec.next_seq, "the request's deadline passed")
        return records

    async def end_with_abort(self, req: GenerateRequest, seq: int, why: str) -> None:
        """A request this worker ends on its own: its final event, ``abort`` with ``why``, at
        ``seq``; remembered as aborted, so nothing of it is taken or published again."""
        log.info("ending %s: %s", req.request_id, why)
        await self.publish(req, TokenEvent(req.request_id, seq, finish_reason="abort", error=why,
                                           worker=self.ctx.instance_id, prompt_tokens=len(req.prompt_token_ids)))
        self.recent_aborts.add(req.request_id)

    async def hand_on(self, req: GenerateRequest, output_token_ids: list[int], next_seq: int, subject: str,
                      why: str) -> None:  # fmt: skip
        """A request this worker stops holding before its end (``why``: its shutdown), whose client
        already has ``output_token_ids`` in events up to ``next_seq``: queued again on ``subject``
        as a resume job, which the next worker to take it continues from those tokens, at
        ``next_seq`` (started again from its first token instead, a sampled request's text would
        change course where this worker's ended). Where the bus will not take it, the client gets
        a final error event instead."""
        rid = req.request_id
        if rid in self.recent_aborts:  # aborted meanwhile: nobody waits for it
            return
        try:
            # NOTE: its last events leave first: the worker that takes the job sends from next_seq on,
            # and one of those arriving before them would be a gap to the gateway
            await self.tokens.drain()
            await self.ctx.nc.flush(timeout=5)
            resumed = dataclasses.replace(req, resume_token_ids=list(output_token_ids), resume_seq=next_seq)
            # NOTE: an id of its own, this worker's too: the bus drops a message whose id it saw in
            # the last two minutes, and a worker that takes it may stop before its next token
            msg_id = f"{rid}.resume.{next_seq}.{self.ctx.instance_id}"
            if (await self.ctx.js.publish(subject, encode(resumed), headers={subjects.MSG_ID_HEADER: msg_id})).duplicate:
                raise RuntimeError(f"the bus already had a resume job {msg_id}")
            # the gateway forgets this worker as the request's holder (a repeat of its last seq, from
            # no worker): its silence till the next worker's token is queueing, not a dead worker
            if next_seq:
                await self.publish(req, TokenEvent(rid, next_seq - 1, prompt_tokens=len(req.prompt_token_ids)))
        except Exception as exc:
            log.warning("could not hand %s on: %s", rid, exc)
            await self.publish(req, TokenEvent.failure(rid, why, seq=next_seq, worker=self.ctx.instance_id,
                                                        prompt_tokens=len(req.prompt_token_ids)))  # fmt: skip
            return
        self.handed_on += 1
        log.info("handed %s on after %d tokens (%s)", rid, len(output_token_ids), why)
        self.end_span(rid, **{"llmbus.finish_reason": "handed_on"})

    @property
    @abc.abstractmethod
    def held(self) -> int:
        """Requests this worker holds (its registry queue depth)."""

    def report(self) -> None:
        bm = self.engine.block_manager
        prefix = (bm.model_id, bm.kv_format, bm.block_size) if bm.enable_prefix_caching else ("", "", 0)
        self.ctx.report(free_blocks=self.engine.num_free_blocks, queue_depth=self.held,
                        total_blocks=self.engine.runner.num_blocks, prefix=prefix)  # fmt: skip

    def tell_malformed(self, msg) -> Callable[[Exception], Awaitable[None]]:
        """``read_job``'s ``on_malformed`` for a GenerateRequest job: the request's client, when the
        payload names its request, gets a final ``invalid_request`` error (as the router's would)."""
        async def tell(exc: Exception) -> None:
            if (told := malformed_failure(msg.data, f"malformed request: {exc}", self.ctx.instance_id)) is not None:
                await self.tokens.publish(*told)

        return tell

    def check_model(self, req: GenerateRequest) -> None:
        """A request names the model this worker serves: one published to its subjects for
        another (by a tool, not the router, which checks) is refused, not served by the wrong model."""
        if req.model != self.model:
            raise ValueError(f"this worker serves model {self.model!r}, not {req.model!r}")

    async def refuse(self, req: GenerateRequest, msg, exc: Exception) -> None:
        """End a job the engine would not take: its span and a final error event (``invalid_request``
        when the request is at fault, a ValueError), then ``term``."""
        rid = req.request_id
        bad = isinstance(exc, ValueError)
        if not bad:
            log.warning("could not take job %s: %r", rid, exc)
        text = f"invalid request: {exc}" if bad else f"{self.ctx.role} could not take the request: {exc!r}"
        self.end_span(rid, text, **{"llmbus.finish_reason": "error"})
        await self.publish(req, TokenEvent.failure(rid, text, worker=self.ctx.instance_id,
                                                    prompt_tokens=len(req.prompt_token_ids),
                                                    code=INVALID_REQUEST if bad else ""))  # fmt: skip
        await msg.term()

    async def pull(self, worker: PullWorker, capacity: Callable[[int, int], int], take: Callable[..., Awaitable[None]],
                   *, cost: Callable[[Msg], int] | None = None, counts_at_once: bool = False,
                   urgent: bool = False) -> None:  # fmt: skip
        """Fetch only as many jobs as ``capacity(jobs, tokens)`` allows, less those still being
        taken, and run ``take`` on each as its own task, until stopped. Room is asked again before
        each job of a pull, with the ``jobs`` this worker's pull loops have pulled and not yet begun
        to take, and their summed ``cost`` (prefill: their prompt tokens), as ``tokens``: a burst of long prompts stops at the prompt-token budget, not
        at the free batch slots counted before it came. ``counts_at_once``: a take has its job
        counted in ``capacity`` before its first wait (prefill registers it), so takes in flight
        are not subtracted again. ``urgent``: ``worker`` is an urgent queue (priority below 0). While
        one reports jobs pending, the other queues' pulls find no room: the urgent jobs take what
        frees first, wherever the rest of the stream's backlog began.

        NOTE: a pull's takes start together, once it ends: each waits for the engine thread between
        two steps (admission), and started one by one as they came (a network round
        trip apart), the first would start a step alone and the burst split across steps. Taken one
        after another, a burst of N jobs needed N steps to reach the batch."""
        taking: set[asyncio.Task] = set()
        pulled = self._pulled

        if urgent:
            self._urgent.append(worker)

        def room() -> int:
            if self.ctx.stop.is_set() or not urgent and any(w.backlog for w in self._urgent):
                return 0
            return capacity(pulled[0], pulled[1]) - (0 if counts_at_once else self._takes_running)

        try:
            while not self.ctx.stop.is_set():
                if self.loop.error is not None:
                    log.error("engine thread died; stopping")
                    self.ctx.stop.set()
                    return
                batch, tokens = [], 0
                try:
                    async for msg in worker.messages(room, timeout=0.5):
                        if self.ctx.stop.is_set():  # it came as the worker stopped: another replica's, at once
                            with contextlib.suppress(Exception):
                                await msg.nak()
                            continue
                        batch.append(msg)
                        tokens += (c := cost(msg) if cost is not None else 0)
                        pulled[0] += 1
                        pulled[1] += c
                finally:
                    pulled[0] -= len(batch)
                    pulled[1] -= tokens
                for msg in batch:
                    task = asyncio.create_task(take(msg))
                    taking.add(task)
                    self._takes_running += 1
                    task.add_done_callback(self._finished_take(taking))
                await asyncio.sleep(0)  # NOTE: the takes start (and claim their jobs) before room is asked again
                self.report()
        finally:
            if urgent:  # NOTE: a loop that ended (a fetch error) must not hold the others' room at 0
                worker.backlog = 0
                self._urgent.remove(worker)
            if taking:  # let takes in flight finish (a step or two), so shutdown sees their jobs
                _, late = await asyncio.wait(taking, timeout=10.0)
                for task in late:
                    task.cancel()

    def check_engine(self) -> None:
        """Raise when the engine thread died: the service then exits 1, not 0 (a supervisor, or
        ``llmbus up``, must see a failure, not a clean stop)."""
        if self.loop is not None and self.loop.error is not None:
            raise RuntimeError(f"the engine thread died: {self.loop.error!r}")

    async def drain(self, pullers: list[asyncio.Task]) -> None:
        """Once stopped: take nothing new (``pullers``, the ``pull`` loops, end with the pull in
        flight, whose wait is at most 0.5 s, and give back a job it brings; what waits in the
        streams is another replica's), and let the requests held run to their end, for ``drain_s``
        at most (a second signal, ``ctx.hurry``, or a dead engine thread cuts it short). A rolling
        restart then fails no request a worker had started.

        NOTE: not cancelled: a cancelled fetch leaves its pull request open on the server, and a job
        it then delivers sits unacked for the consumer's whole ack wait before anyone gets it."""
        self.draining = True
        self.report()  # (a prefill worker's room is 0 now: routers stop sending it requests by name)
        await asyncio.gather(*pullers, return_exceptions=True)
        started = time.monotonic()
        while self.held and not self.ctx.hurry.is_set() and self.loop.error is None:
            left = started + self.drain_s - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.05)):
                    await self.ctx.hurry.wait()
        if self.held:
            log.warning("stopping with %d requests unfinished (drained %.1f s of %.0f)", self.held,
                        time.monotonic() - started, self.drain_s)  # fmt: skip

    async def publish(self, req: GenerateRequest, event: TokenEvent) -> None:
        """Send ``event`` where ``req`` asked (``llmbus.bus.tokens``: batched per gateway, or alone).
        Never raises: one request's event that cannot leave (a closed connection) must not stop the
        task that publishes everyone's; its client sees the gap, or its gateway's silence timeout."""
        try:
            await self.tokens.publish(req.token_subject or subjects.tokens(req.request_id), event)
        except Exception as exc:
            log.warning("could not publish event %d of %s: %s", event.seq, req.request_id, exc)
        if self.spans and (span := self.spans.get(req.request_id)) is not None:
            if event.seq == 0 and event.token_ids:
                span.add_event("first_token")
            if event.finish_reason is not None:
                self.end_span(req.request_id, event.error or "", **{
                    "llmbus.finish_reason": event.finish_reason, "gen_ai.usage.output_tokens": event.completion_tokens,
                    "llmbus.cached_tokens": event.cached_tokens})  # fmt: skip

    async def write_rows(self, lease, kv) -> None:
        """Write ``Engine.read_blocks`` rows ``[n, layers, bytes]`` into lease blocks 0..n-1, each
        zero-padded to the lease's block size."""
        import torch

        n_blocks = kv.shape[0]
        rows = kv.reshape(n_blocks, -1)
        pad = lease.block_bytes - rows.shape[1]
        if pad < 0:
            raise ValueError(f"a KV block is {rows.shape[1]} bytes but kvpool blocks are {lease.block_bytes}")
        if pad:
            rows = torch.nn.functional.pad(rows, (0, pad))
        await self.kv.write_blocks(lease, 0, rows.contiguous().numpy().data)

    async def store_rows(self, rows, hashes: list[bytes], *, parent_hash: bytes | None = None,
                         request_id: str = "", ttl_s: float = 60.0) -> StoreReply:
        """Put ``Engine.read_blocks`` rows in kvpool's prefix tiers under the chain ``hashes`` (the
        first block's parent ``parent_hash``): a lease, the write, ``store``, the lease released."""
        lease = await self.kv.allocate(rows.shape[0], ttl_s=ttl_s, request_id=request_id)
        try:
            await self.write_rows(lease, rows)
            return await self.kv.store(lease, hashes, parent_hash=parent_hash, kv_format=self.engine.config.kv_format,
                                       block_bytes=rows[0].numel())  # fmt: skip
        finally:
            with contextlib.suppress(Exception):
                await self.kv.release(lease.lease_id)

    @staticmethod
    def lease_rows(raw: bytes | bytearray, n_blocks: int, lease_block_bytes: int, num_layers: int, layer_bytes: int):
        """The inverse of ``write_rows``: ``n_blocks`` lease blocks read back as ``Engine.read_blocks``
        rows ``[n, layers, bytes]`` (each block's zero padding dropped); a bytearray is used in
        place, bytes copied once (torch wants a writable buffer)."""
        import torch

        buf = raw if isinstance(raw, bytearray) else bytearray(raw)
        rows = torch.frombuffer(buf, dtype=torch.uint8).reshape(n_blocks, lease_block_bytes)
        return rows[:, : num_layers * layer_bytes].reshape(n_blocks, num_layers, layer_bytes)

    def _finished_take(self, taking: set[asyncio.Task]) -> Callable[[asyncio.Task], None]:
        def done(task: asyncio.Task) -> None:
            taking.discard(task)
            self._takes_running -= 1
            if not task.cancelled() and task.exception() is not None:  # takes report their own failures
                log.error("taking a job failed", exc_info=task.exception())

        return done

"""The decode service: pulls handoffs only while it has free KV blocks and batch slots, moves the
handed-off KV from kvpool into its own paged cache, joins the continuous batch, and streams one
TokenEvent per step per request until the request finishes or is aborted.

A handoff taken when the cache has too few free blocks for it waits, first come first served,
with its KV in kvpool (its lease renewed) until finished requests free enough; while one waits the
worker pulls no more, so the rest stay in the stream for other replicas.

Per handoff: malformed or unusable -> a final error TokenEvent, lease released, ``term``; otherwise
the blocks are read (shared memory on the same host, the bus elsewhere), the sequence is imported,
the lease released, and the handoff acked. An Abort stops a request at once and frees its blocks.

Whole requests (``llmbus.prefill.<lane>.<model>.whole``: short prompts the router sends here instead of to the
prefill pool, conditional disaggregation): the engine prefills and decodes them itself, its
TokenEvents start at seq 0, and the job is acked once the engine has it. A request the engine
refuses (too long, bad parameters) is a final error event, then ``term``.

A finished request's full blocks (prompt and output, those still in this engine's prefix cache)
are committed to kvpool's tiers, skipping what kvpool already holds, so a later request that
continues the conversation skips their prefill. A kvpool failure only costs that reuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from llmbus.bus import subjects
from llmbus.bus.kvclient import KVPoolError
from llmbus.bus.service import ServiceContext
from llmbus.bus.streams import (ensure_decode_consumer, ensure_urgent_handoff_consumer, ensure_urgent_whole_consumer,
                                ensure_whole_consumer)
from llmbus.bus.worker import PullWorker, read_job
from llmbus.engine.engine import Engine, OutOfBlocks, StepOutput
from llmbus.protocol import GenerateRequest, Handoff, Lease, TokenEvent
from llmbus.protocol.messages import LANES
from llmbus.worker.base import DEADLINE_CHECK_S, DRAIN_S, EngineWorker
from llmbus.worker.events import token_event

log = logging.getLogger("llmbus.decode")


class _Stopping(Exception):
    """The worker is shutting down: a handoff not yet joined goes back to the stream."""


@dataclass
class Active:
    request: GenerateRequest
    next_seq: int
    output_token_ids: list[int] = field(default_factory=list)
    whole: bool = False  # prefilled here (a whole request), not handed off


class DecodeWorker(EngineWorker):
    def __init__(self, ctx: ServiceContext, engine: Engine, model: str, *, min_free_fraction: float = 0.05,
                 drain_s: float = DRAIN_S) -> None:  # fmt: skip
        super().__init__(ctx, engine, model, drain_s=drain_s)
        self.min_free_blocks = max(1, int(engine.runner.num_blocks * min_free_fraction))
        self.active: dict[str, Active] = {}
        self.events: asyncio.Queue = asyncio.Queue()
        self.jobs: PullWorker | None = None  # the handoff consumer, once bound
        self._waiting: list[str] = []  # takes waiting for room, first come first served
        self._taking: set[str] = set()  # request ids of every take in progress
        self._reserved = 0  # blocks promised to takes past their wait
        self._room = asyncio.Event()  # set (and replaced) whenever room may have appeared

    @property
    def held(self) -> int:
        return len(self.active)

    @property
    def total_blocks(self) -> int:
        return self.engine.runner.num_blocks

    @property
    def capacity(self) -> int:
        """Handoffs this worker can take now: free batch slots, while enough blocks are free and no
        handoff taken waits for room (the rest wait in the stream, where another replica can take
        them)."""
        if self._waiting or self.engine.num_free_blocks < self.min_free_blocks:
            return 0
        return max(0, self.engine.config.max_num_seqs - len(self.active))

    async def _room_for(self, handoff: Handoff, need: int, *, ahead: bool = False) -> bool:
        """Wait, first come first served (``ahead``: at the head of the line, for a take that had
        its turn and must wait again), until the cache has ``need`` free blocks besides those
        promised to other takes, and no sequence preempted for blocks waits to resume (it goes
        first), and promise them to this one (``_unreserve`` gives them back).
        Meanwhile the handoff's KV waits in kvpool: its lease is renewed. False if the request was
        aborted or its deadline passed while it waited (its final event is then out); _Stopping
        when the worker is shutting down."""
        req = handoff.request
        rid = req.request_id
        self._waiting.insert(0, rid) if ahead else self._waiting.append(rid)
        renewed = time.monotonic()
        try:
            while True:
                if self.ctx.stop.is_set():
                    raise _Stopping
                room = self._room  # NOTE: taken before the check, so a step's notice between the two is not lost
                if (self._waiting[0] == rid and not self.engine.resuming
                        and self.engine.num_free_blocks - self._reserved >= need):
                    self._reserved += need
                    return True
                if rid in self.recent_aborts or await self.end_past_deadline({rid: Active(req, handoff.next_seq)}):
                    return False
                if time.monotonic() - renewed > handoff.lease.ttl_s / 3:
                    try:
                        await self.kv.renew(handoff.lease.lease_id, handoff.lease.ttl_s)
                        renewed = time.monotonic()
                    except KVPoolError as exc:  # gone for good, or kvpool slow to answer: try again
                        if exc.code == "unknown_lease":
                            raise
                        log.debug("could not renew the lease of %s yet: %s", rid, exc)
                await self._room_notice(room)
        finally:
            self._waiting.remove(rid)
            self._notify_room()  # the next in line may fit now

    @staticmethod
    async def _room_notice(room: asyncio.Event) -> None:
        """Until ``room`` is set, or DEADLINE_CHECK_S (deadlines, aborts and leases are checked then)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DEADLINE_CHECK_S):
                await room.wait()

    def _unreserve(self, blocks: int) -> None:
        self._reserved -= blocks
        self._notify_room()

    def _notify_room(self) -> None:
        """Wake the takes waiting for room (blocks were freed, or promised blocks were used)."""
        room, self._room = self._room, asyncio.Event()
        room.set()

    async def run(self) -> None:
        limits = self.ctx.options.limits
        self.start_engine(self._on_outputs)
        consumer = await ensure_decode_consumer(self.ctx.js, self.model, limits)
        worker = self.jobs = await PullWorker.bind(self.ctx.js, subjects.DECODE_STREAM, consumer,
                                                   max_deliver=limits.max_deliver)
        self.ctx.stack.push_async_callback(worker.close)
        urgent = await PullWorker.bind(self.ctx.js, subjects.DECODE_STREAM,
                                       await ensure_urgent_handoff_consumer(self.ctx.js, self.model, limits),
                                       max_deliver=limits.max_deliver)  # fmt: skip
        self.ctx.stack.push_async_callback(urgent.close)
        wholes = []  # (puller, urgent)
        for lane in LANES:
            for ensure, urgent_queue in ((ensure_whole_consumer, False), (ensure_urgent_whole_consumer, True)):
                whole = await PullWorker.bind(self.ctx.js, subjects.PREFILL_STREAMS[lane],
                                              await ensure(self.ctx.js, lane, self.model, limits),
                                              max_deliver=limits.max_deliver)  # fmt: skip
                self.ctx.stack.push_async_callback(whole.close)
                wholes.append((whole, urgent_queue))
        await self.subscribe_aborts()
        self.report()
        await self.ctx.ready()
        def room(jobs: int, tokens: int) -> int:
            return self.capacity - jobs

        pullers = [asyncio.create_task(self.pull(worker, room, self._take)),
                   asyncio.create_task(self.pull(urgent, room, self._take, urgent=True)),
                   *(asyncio.create_task(self.pull(w, room, self._take_whole, urgent=u)) for w, u in wholes)]
        publisher = asyncio.create_task(self._publisher())
        try:
            await self.ctx.stop.wait()
        finally:
            # NOTE: a handoff still waiting for room goes back to the stream at once (_Stopping)
            await self.drain(pullers)
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
            for act in list(self.active.values()):  # continued elsewhere, from the tokens its client has
                req = act.request
                lane = req.lane or "short"
                subject = (subjects.whole_lane_subject if act.whole else subjects.lane_subject)(lane, self.model, req.priority)
                await self.hand_on(req, act.output_token_ids, act.next_seq, subject, "the decode worker shut down")
            self.active.clear()
            await self.settle()
        self.check_engine()

    async def _take(self, msg) -> None:
        if (handoff := await read_job(Handoff, msg, "handoff")) is None:
            return
        req = handoff.request
        rid = req.request_id
        if rid in self.recent_aborts or rid in self.active or rid in self._taking:
            with contextlib.suppress(Exception):
                await msg.ack()  # aborted already, or a redelivery of a handoff this worker holds
                if rid in self.recent_aborts and rid not in self._taking:  # nobody else will read it
                    await self.kv.release(handoff.lease.lease_id)
            return
        self._taking.add(rid)  # NOTE: from here to the end of the take, so a redelivery cannot take it twice
        self.trace(req, "llmbus.decode", **{"llmbus.prefill_worker": handoff.prefill_worker})
        keep_lease = False
        try:
            if handoff.kv_format != self.engine.config.kv_format:
                raise ValueError(f"handoff KV is {handoff.kv_format}, this decode worker runs {self.engine.config.kv_format}")
            computed = handoff.state.get("num_computed_tokens")
            if type(computed) is not int or computed < 1:
                raise ValueError(f"handoff has {computed!r} computed tokens")
            blocks = self.engine.layout.num_blocks_for(computed)
            if blocks > self.total_blocks:
                raise ValueError(f"the request needs {blocks} KV blocks; this decode worker's cache has {self.total_blocks}")
            async with self.jobs.working(msg):
                try:
                    joined = await self._join(handoff, min(blocks + 1, self.total_blocks))  # and one to grow into
                except (asyncio.CancelledError, _Stopping) as exc:  # shutdown
                    if rid in self.active:  # it may have joined the batch: ours to end (run() tells the client)
                        with contextlib.suppress(Exception):
                            await msg.ack()
                    else:  # another replica takes it, lease and all
                        keep_lease = True
                        with contextlib.suppress(Exception):
                            await msg.nak()
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    return
            if not joined:  # aborted, or past its deadline, before it joined: its end is out
                await msg.ack()
                return
        except Exception as exc:
            # ended while it was taken (its deadline, an abort): its final event is out, no second one
            if self.active.pop(rid, None) is None and rid in self.recent_aborts:
                log.debug("handoff %s ended while taken: %s", rid, exc)
                await msg.term()
                return
            log.warning("cannot take handoff %s: %s", rid, exc)
            await self.publish(req, TokenEvent.failure(rid, f"decode could not take the request: {exc}",
                                                        seq=handoff.next_seq, worker=self.ctx.instance_id,
                                                        prompt_tokens=len(req.prompt_token_ids)))  # fmt: skip
            await msg.term()
            return
        finally:
            self._taking.discard(rid)
            if rid not in self.active:  # it never joined (or already ended): its span ends here
                self.end_span(rid)
            if not keep_lease:
                with contextlib.suppress(Exception):
                    await self.kv.release(handoff.lease.lease_id)
        await msg.ack()

    async def _take_whole(self, msg) -> None:
        """A short prompt to prefill and decode here (no handoff)."""
        if (req := await read_job(GenerateRequest, msg, "request", self.tell_malformed(msg))) is None:
            return
        rid = req.request_id
        if rid in self.recent_aborts or rid in self.active or rid in self._taking:
            with contextlib.suppress(Exception):
                await msg.ack()  # aborted already, or a redelivery of a request this worker holds
            return
        self.trace(req, "llmbus.decode", **{"llmbus.whole": True})
        # NOTE: registered first: the engine may emit its first token before we resume
        act = self.active[rid] = Active(req, req.resume_seq, list(req.resume_token_ids), whole=True)

        def admit(e: Engine) -> None:
            if self.active.get(rid) is act:  # not aborted meanwhile (on_abort found nothing to stop)
                e.add_request(rid, req.prompt_token_ids, req.sampling.to_params(), req.cache_salt, priority=req.priority,
                              output_token_ids=req.resume_token_ids)

        try:
            self.check_model(req)
            await self.loop.call(admit)
        except Exception as exc:  # ValueError: the request's fault; anything else: ours, but it ends it too
            if self.active.pop(rid, None) is None:  # aborted meanwhile: its end is out
                await msg.ack()
            else:
                await self.refuse(req, msg, exc)
            return
        self.report()
        with contextlib.suppress(Exception):  # NOTE: the engine has it: a lost ack only redelivers it, acked as ours
            await msg.ack()

    async def _join(self, handoff: Handoff, need: int) -> bool:
        """Wait for room, read the handoff's KV from kvpool (once) and import the sequence; False if
        it was aborted or its deadline passed first. An import that still finds too few blocks
        (steps since the wait took them) waits again, at the head of the line."""
        req = handoff.request
        rid = req.request_id
        params = req.sampling.to_params()
        kv, again = None, False
        while True:
            if not await self._room_for(handoff, need, ahead=again):
                return False
            try:
                if kv is None:
                    lease = await self._confirmed(handoff.lease)
                    raw = await self.kv.read_blocks(lease)
                    if rid in self.recent_aborts:  # NOTE: aborted during the read: on_abort found nothing to stop
                        return False
                    n, layers, layer_bytes = handoff.kv_shape
                    kv = self.lease_rows(raw, n, lease.block_bytes, layers, layer_bytes)
                if self.ctx.stop.is_set():
                    raise _Stopping
                # NOTE: registered first: the engine may emit its first token before we resume
                self.active[rid] = Active(req, handoff.next_seq, list(handoff.output_token_ids))
                await self.loop.call(lambda e: e.import_sequence(handoff.state, kv, params, req.priority))
                if (span := self.spans.get(rid)) is not None:  # NOTE: here, before its tokens' events run
                    span.add_event("joined_batch")  # after waiting for room and reading the KV
                return True
            except OutOfBlocks:
                self.active.pop(rid, None)
                again = True
                await self._room_notice(self._room)
            finally:
                self._unreserve(need)

    async def _confirmed(self, lease: Lease) -> Lease:
        """kvpool's own record of a handoff's lease (renewed for the read). The handoff came off the
        bus: its block handles and segment are read only as kvpool granted them, so a forged lease
        cannot point this worker at blocks (another request's KV) or sizes it was not given."""
        granted = await self.kv.renew(lease.lease_id, lease.ttl_s)
        if (granted.blocks, granted.block_bytes, granted.shm_name) != (lease.blocks, lease.block_bytes, lease.shm_name):
            raise ValueError(f"the handoff's lease {lease.lease_id} is not as kvpool granted it")
        return granted

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        self.events.put_nowait(outputs)

    async def _publisher(self) -> None:
        """One task publishes every TokenEvent, so each request's events leave in seq order."""
        while True:
            for out in await self.next_or_none(self.events) or ():
                act = self.active.get(out.request_id)
                if act is None:
                    continue
                reason = out.finish_reason
                if reason == "abort":
                    self.active.pop(out.request_id, None)
                    continue
                await self.publish(act.request, token_event(out, act.next_seq, self.ctx.instance_id, reason))
                act.next_seq += 1
                act.output_token_ids += out.new_token_ids
                if reason is not None:
                    self.active.pop(out.request_id, None)
                    if reason != "error":
                        self.spawn_store(self._commit_prefix(act))
            for act in await self.end_past_deadline(self.active):
                self.spawn(self.loop.call(lambda e, rid=act.request.request_id: e.abort(rid)))
            self._notify_room()
            self.report()

    async def _commit_prefix(self, act: Active) -> None:
        """Store the finished sequence's full blocks that kvpool lacks (best effort)."""
        if not self.engine.config.enable_prefix_caching:
            return
        req = act.request
        tokens = req.prompt_token_ids + act.output_token_ids
        bs = self.engine.layout.block_size
        full = (len(tokens) - 1) // bs  # the last sampled token has no KV
        hashes = self.engine.prefix_hashes(tokens[: full * bs], req.cache_salt)
        try:
            have = (await self.kv.lookup(hashes)).pool_blocks if hashes else len(hashes)
            if have >= len(hashes):
                return
            kv = await self.loop.call(lambda e: e.export_cached(hashes, have))
            n = kv.shape[0]
            if n == 0:
                return
            await self.store_rows(kv, hashes[have : have + n], parent_hash=hashes[have - 1] if have else None,
                                  request_id=req.request_id)  # fmt: skip
        except Exception as exc:
            log.debug("kvpool did not take the blocks of %s: %s", req.request_id, exc)

    async def on_abort(self, rid: str) -> None:
        if self.active.pop(rid, None) is not None:
            await self.loop.call(lambda e: e.abort(rid))
            self._notify_room()
            self.report()

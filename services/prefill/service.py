"""The prefill service: pulls prompts as its engine has room, prefills them in batches (chunked),
samples the first token, and hands the sequence and its KV to the decode pool.

Per job (a GenerateRequest on the lane streams):
- malformed payload or invalid request -> a final error TokenEvent, then ``term``;
- otherwise the engine prefills it (``prefill_only``); ``in_progress`` heartbeats keep it ours;
- first token sampled: publish TokenEvent seq 0; if that already finished the request (eos, stop id,
  max_tokens == 1) it is the final event and the job is acked. Else the KV blocks go into a kvpool
  lease, a Handoff is published to the decode stream (Nats-Msg-Id = request_id), and only then is
  the job acked. A failure there releases the lease and fails the request clearly.
- an Abort for a job in flight stops it in the engine (blocks freed at once) and acks the job.

Prefix reuse (kvpool's tiers): before a prompt reaches the engine, its reusable block hashes
(rooted at model, KV format and the request's cache_salt) are checked against this engine's own
cache; kvpool ``fetch`` hands back the longest further run from its CPU/SSD tiers in the tier-0
format, which ``Engine.import_prefix`` loads as cached blocks: the engine computes only the rest,
and usage reports them as cached tokens. After prefill the prompt's full blocks, already in the
handoff lease, are committed to kvpool (``store``). A kvpool failure only costs the reuse, never
the request. What this worker's own cache gains and loses goes to kvpool's index as KV events, so
the router sends a prompt here (``llmbus.prefill.<lane>.<model>.at.<instance_id>``, pulled beside the lanes)
when this cache holds most of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import msgpack

from llmbus.bus import subjects
from llmbus.bus.kvclient import KVPoolError
from llmbus.bus.service import ServiceContext
from llmbus.bus.streams import ensure_direct_consumer, ensure_prefill_consumer, ensure_urgent_consumer
from llmbus.bus.worker import PullWorker, read_job
from llmbus.engine.engine import Engine, StepOutput
from llmbus.kv.formats import kv_block_bytes
from llmbus.protocol import GenerateRequest, Handoff, TokenEvent, WorkerLoad, encode
from llmbus.protocol.messages import LANES
from llmbus.worker.base import DRAIN_S, EngineWorker
from llmbus.worker.events import cache_events, token_event

log = logging.getLogger("llmbus.prefill")

_LEASE_RETRY_S = 0.05  # first wait for a full kvpool; doubled each time, up to
_LEASE_RETRY_MAX_S = 1.0
MAX_TAKEN = 256  # request ids one WorkerLoad lists as taken (more go in the next)


class _Stopping(Exception):
    """The worker stopped while a handoff waited for kvpool room: its request is handed on."""


class DeadlinePassed(Exception):
    """The request's deadline passed while it waited: it ends with ``abort``, as a worker ends any
    request at its deadline."""


@dataclass
class Job:
    msg: object
    request: GenerateRequest
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    next_seq: int = 0  # seq of the next TokenEvent (from the request's resume_seq)
    output_token_ids: list[int] = field(default_factory=list)  # what its client has
    finishing: asyncio.Task | None = None  # handing off: its first token out, the handoff under way
    cached_tokens: int = 0  # of its prompt, found in tier 0 or kvpool when taken (not computed here)


def _prompt_tokens(msg) -> int:
    """A pulled job's prompt length, read before it is taken (0 for one that does not decode)."""
    try:
        prompt = msgpack.unpackb(msg.data, raw=False).get("prompt_token_ids")
    except Exception:
        return 0
    return len(prompt) if isinstance(prompt, list) else 0


class PrefillWorker(EngineWorker):
    def __init__(self, ctx: ServiceContext, engine: Engine, model: str, *, lanes: tuple[str, ...] = LANES,
                 lease_ttl_s: float = 120.0, colocated: bool = False, drain_s: float = DRAIN_S) -> None:  # fmt: skip
        """``colocated``: decode here too instead of handing off (one worker does both phases)."""
        super().__init__(ctx, engine, model, drain_s=drain_s)
        self.colocated = colocated
        self.events: asyncio.Queue = asyncio.Queue()
        self.lanes = lanes
        self.lease_ttl_s = lease_ttl_s
        self.releasing = False  # stopped, its jobs given back: a handoff waiting for room hands on instead
        self._max_ttl: float | None = None  # kvpool's --max-ttl, once asked
        self.jobs: dict[str, Job] = {}
        self._jobs_changed = asyncio.Event()
        self._taken: list[str] = []  # ids of requests sent here by name, taken since the last WorkerLoad

    @property
    def held(self) -> int:
        return len(self.jobs)

    @property
    def _block_bytes(self) -> int:
        return kv_block_bytes(self.engine.layout, self.engine.config.kv_format)

    @property
    def capacity(self) -> int:
        """Jobs this worker can take now: batch slots left, while blocks remain and the prompt tokens
        already taken fill less than two steps' token budget (the rest wait in the stream, where
        another replica can take them)."""
        return self.room(0, 0)

    def room(self, jobs: int, tokens: int) -> int:
        """``capacity`` with ``jobs`` more pulled, of ``tokens`` prompt tokens, not yet taken."""
        cfg = self.engine.config
        if self.draining or self.engine.num_free_blocks < 1 or self.pending_tokens + tokens >= 2 * cfg.max_num_batched_tokens:
            return 0
        return max(0, cfg.max_num_seqs - len(self.jobs) - jobs)

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens the jobs held have yet to compute before their first token here: neither
        computed, nor found cached, nor in the engine's running step (``Engine.prompt_tokens_left``,
        and the prefix the job's lookup found before the engine schedules it), so the worker pulls
        the next step's jobs while a step runs instead of after it (a burst of 16 prompts reached
        the engine in steps of four, then one, then four), and pulls on past prompts it finds
        cached (they cost a step next to nothing: the scheduler lets them ride along). A resumed job's
        tokens so far count: they are computed again. Handing off, every job held counts whole
        after its first token too: one whose handoff waits for kvpool room holds its KV until
        there is room, and prefill stops pulling instead of computing more with nowhere to go."""
        total = 0
        for rid, job in self.jobs.items():
            whole = len(job.request.prompt_token_ids) + len(job.request.resume_token_ids)
            if job.next_seq != job.request.resume_seq:  # its first token is out
                total += 0 if self.colocated else whole
            elif (left := self.engine.prompt_tokens_left(rid)) is None:  # not in the engine yet
                total += whole - job.cached_tokens
            else:  # (the engine counts cached tokens once it schedules the job: until then, ours)
                total += min(left, whole - job.cached_tokens)
        return total

    async def run(self) -> None:
        limits = self.ctx.options.limits
        write_back = self.colocated and self.engine.config.enable_prefix_caching
        caching = self.engine.config.enable_prefix_caching
        if write_back:  # before the engine thread starts: it calls back from there
            self.engine.keep_evicted()
        if caching:
            self.engine.track_cache_changes()
        self.start_engine(self._on_outputs)
        queues = []  # (stream, consumer, urgent)
        for lane in self.lanes:  # each lane's shared and urgent queues, and the work the router sends
            # this worker alone there, for the prefix its cache holds
            stream = subjects.PREFILL_STREAMS[lane]
            queues.append((stream, await ensure_prefill_consumer(self.ctx.js, lane, self.model, limits), False))
            queues.append((stream, await ensure_urgent_consumer(self.ctx.js, lane, self.model, limits), True))
            queues.append((stream, await ensure_direct_consumer(self.ctx.js, lane, self.ctx.instance_id, limits), False))
        workers = []
        for stream, consumer, urgent in queues:
            w = await PullWorker.bind(self.ctx.js, stream, consumer, max_deliver=limits.max_deliver)
            self.ctx.stack.push_async_callback(w.close)
            workers.append((w, urgent))
        await self.subscribe_aborts()
        self.report()
        await self.ctx.ready()
        # NOTE: every pull loop counts the jobs any loop is pulling and their prompt tokens (cost);
        # a take registers its job (in self.jobs, which room reads) before its first wait
        pullers = [asyncio.create_task(self.pull(w, self.room, lambda m, w=w: self._take(w, m), cost=_prompt_tokens,
                                                 counts_at_once=True, urgent=urgent)) for w, urgent in workers]  # fmt: skip
        tasks = [asyncio.create_task(self._announce(caching)), asyncio.create_task(self._keep_direct())]
        if self.colocated:
            tasks.append(asyncio.create_task(self._colocated_publisher()))
        if write_back:
            tasks.append(asyncio.create_task(self._write_back()))
        try:
            await self.ctx.stop.wait()
        finally:
            await self.drain(pullers)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._release_all()
            await self.settle()
        self.check_engine()

    async def _take(self, worker: PullWorker, msg) -> None:
        if (req := await read_job(GenerateRequest, msg, "job", self.tell_malformed(msg))) is None:
            return
        rid = req.request_id
        if msg.subject.endswith(f".at.{self.ctx.instance_id}"):  # sent here by name: routers count it till told
            self._taken.append(rid)
            self._jobs_changed.set()
        if rid in self.recent_aborts or rid in self.jobs:
            await msg.ack()  # aborted before it reached us, or a redelivery of a job we hold
            return
        # NOTE: registered before the engine sees it: its first output can arrive before we resume
        job = self.jobs[rid] = Job(msg, req, next_seq=req.resume_seq, output_token_ids=list(req.resume_token_ids))
        self._jobs_changed.set()
        self.trace(req, "llmbus.prefill", **{"llmbus.lane": req.lane, "llmbus.colocated": self.colocated})
        job.stack.callback(self.end_span, rid)  # whatever ends the job ends its span
        await job.stack.enter_async_context(worker.working(msg))
        try:
            self.check_model(req)
            params = req.sampling.to_params()
            hashes, local, kv = await self._cached_prefix(req)
            job.cached_tokens = (local + (0 if kv is None else kv.shape[0])) * self.engine.layout.block_size

            def admit(e: Engine) -> None:
                # NOTE: an abort that came while the prefix was looked up found nothing to stop in
                # the engine (on_abort already acked the job): it must not start now
                if self.jobs.get(rid) is not job:
                    return
                if kv is not None:  # NOTE: same engine call as add_request: nothing evicts it in between
                    e.import_prefix(hashes[local : local + kv.shape[0]], kv, protect=hashes[:local])
                e.add_request(rid, req.prompt_token_ids, params, req.cache_salt, prefill_only=not self.colocated,
                              priority=req.priority, output_token_ids=req.resume_token_ids)

            await self.loop.call(admit)
        except Exception as exc:  # ValueError: the request's fault; anything else: ours, but it ends the job too
            if self._aborted(job):  # on_abort acked it and closed its stack
                return
            self.jobs.pop(rid, None)
            await self.refuse(req, msg, exc)  # (its span's end before the stack's own end_span)
            await job.stack.aclose()

    async def _cached_prefix(self, req: GenerateRequest):
        """(reusable hashes, blocks already in tier 0, KV rows from kvpool or None). Nothing for a
        request that scores its prompt (prompt_logprobs): it computes every position."""
        if not self.engine.config.enable_prefix_caching or req.sampling.prompt_logprobs is not None:
            return [], 0, None
        hashes = self.engine.reusable_prefix_hashes(req.prompt_token_ids, req.cache_salt)
        # NOTE: read here, not between two steps on the engine thread: membership tests of the hash
        # index, each atomic, at worst a step stale (as the admission after the kvpool fetch always
        # was). Asked there, a job pulled while a step ran waited for its end to look, and for the
        # next step's end to be admitted.
        local = self.engine.local_prefix_blocks(hashes)
        if local >= len(hashes):
            return hashes, local, None
        try:
            reply = await self.kv.fetch(hashes, start=local, kv_format=self.engine.config.kv_format,
                                        ttl_s=self.lease_ttl_s, request_id=req.request_id,
                                        block_bytes=self._block_bytes)  # fmt: skip
        except Exception as exc:  # KVPoolError, or an old kvpool: compute instead
            log.debug("no prefix from kvpool for %s: %s", req.request_id, exc)
            return hashes, local, None
        if reply.lease is None:
            return hashes, local, None
        try:
            raw = await self.kv.read_blocks(reply.lease, 0, reply.num_blocks)
        except Exception as exc:  # the pool restarted, the lease expired: compute instead
            log.debug("could not read the prefix of %s from kvpool: %s", req.request_id, exc)
            return hashes, local, None
        finally:
            with contextlib.suppress(Exception):
                await self.kv.release(reply.lease.lease_id)
        layers = self.engine.layout.num_layers
        width = self._block_bytes // layers  # one layer's block in this cache's format
        try:
            return hashes, local, self.lease_rows(raw, reply.num_blocks, reply.lease.block_bytes, layers, width)
        except (ValueError, RuntimeError) as exc:  # a reply that does not add up: kvpool's fault, not the request's
            log.warning("kvpool's prefix for %s does not fit this engine: %s", req.request_id, exc)
            return hashes, local, None

    async def _store_from_tier0(self, req: GenerateRequest) -> None:
        """A request that ended on its first token never hands off, so its prompt's full blocks reach
        kvpool from this worker's own cache instead. Best effort: a failure only loses the reuse."""
        bs = self.engine.layout.block_size
        full = len(req.prompt_token_ids) // bs
        if not self.engine.config.enable_prefix_caching or full == 0:
            return
        hashes = self.engine.prefix_hashes(req.prompt_token_ids[: full * bs], req.cache_salt)
        try:
            kv = await self.loop.call(lambda e: e.export_cached(hashes))
            n = kv.shape[0]
            if n == 0:
                return
            await self.store_rows(kv, hashes[:n], request_id=req.request_id, ttl_s=self.lease_ttl_s)
        except Exception as exc:
            log.debug("could not store the prefix of %s: %s", req.request_id, exc)

    async def _commit_prefix(self, req: GenerateRequest, lease, n_blocks: int, num_computed: int) -> None:
        """Cache the prompt's full blocks (the lease's first rows) in kvpool."""
        bs = self.engine.layout.block_size
        full = min(n_blocks, num_computed // bs)
        if not self.engine.config.enable_prefix_caching or full == 0:
            return
        hashes = self.engine.prefix_hashes(req.prompt_token_ids[: full * bs], req.cache_salt)
        try:
            await self.kv.store(lease, hashes, kv_format=self.engine.config.kv_format, block_bytes=self._block_bytes)
        except Exception as exc:
            log.debug("kvpool did not take the prefix of %s: %s", req.request_id, exc)

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        if not self.colocated:
            # NOTE: shortest prompts first: each handoff's engine export and kvpool calls queue in
            # this order, and a short prompt prefilled in the same step as a long one should not
            # wait behind the long one's megabytes of KV (its first token is already out)
            outputs = sorted(outputs, key=lambda o: len(job.request.prompt_token_ids)
                             if (job := self.jobs.get(o.request_id)) else 0)  # fmt: skip
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            if self.colocated:
                self.events.put_nowait((job, out))
                continue
            if self.releasing:  # NOTE: its token is not sent: the job goes back whole (_release_all)
                continue
            job.finishing = self.spawn(self._finish(job, out))

    def _aborted(self, job: Job) -> bool:
        """Whether ``on_abort`` took the job: it stopped the sequence, acked the message and closed
        the job's stack (a gateway aborts a request as soon as a stop string ends it, often right
        after its first token, while the handoff is under way)."""
        return self.jobs.get(job.request.request_id) is not job

    async def _finish(self, job: Job, out: StepOutput) -> None:
        req = job.request
        rid = req.request_id
        first = job.next_seq  # 0, or a resumed request's next
        try:
            if out.finish_reason != "handoff":  # finished on its first token, aborted, or failed
                if out.finish_reason != "abort":
                    await self.publish(req, token_event(out, first, self.ctx.instance_id, out.finish_reason))
                if not self._aborted(job):  # NOTE: term: a job the step failed on must not fail another worker too
                    await (job.msg.term() if out.finish_reason == "error" else job.msg.ack())
                if out.finish_reason not in ("abort", "error"):
                    self.spawn_store(self._store_from_tier0(req))
                return
            await self.publish(req, token_event(out, first, self.ctx.instance_id, None))
            job.next_seq, job.output_token_ids = first + 1, job.output_token_ids + out.new_token_ids
            if self._aborted(job):
                return
            state, kv = await self.loop.call(lambda e: e.export_sequence(rid))
            if self._aborted(job):
                return
            # NOTE: an abort from here on finds the handoff published or about to be: the decode
            # worker drops it (its recent aborts) and releases its lease
            await self._hand_off(job, out, state, kv)
            self.end_span(rid, **{"llmbus.finish_reason": "handoff", "llmbus.cached_tokens": out.num_cached_tokens})
            if not self._aborted(job):
                try:
                    await job.msg.ack()
                except Exception as exc:  # NOTE: decode has the request now: no failure event, which
                    # would end the client's stream (and so its abort) while decode runs on for nobody
                    log.debug("could not ack the handed-off job %s: %s", rid, exc)
        except _Stopping:
            await self._hand_on(job)
        except DeadlinePassed as exc:
            await self.end_with_abort(req, first + 1, str(exc))
            with contextlib.suppress(Exception):
                await job.msg.ack()
        except Exception as exc:
            if self._aborted(job):  # e.g. the export found the sequence gone: nothing failed
                log.debug("prefill of %s ended by its abort: %r", rid, exc)
                return
            if isinstance(exc, KVPoolError) and exc.code == "unavailable":  # kvpool down: one line a job, no traceback
                log.warning("prefill of %s failed: %s", rid, exc)
            else:
                log.exception("prefill of %s failed", rid)
            await self.publish(req, TokenEvent.failure(rid, f"prefill failed: {exc}", seq=first + 1,
                                                        worker=self.ctx.instance_id,
                                                        prompt_tokens=len(req.prompt_token_ids)))  # fmt: skip
            with contextlib.suppress(Exception):
                await job.msg.term()
        finally:
            if not self._aborted(job):
                del self.jobs[rid]
            await job.stack.aclose()
            self.report()

    def report(self) -> None:
        super().report()
        self._jobs_changed.set()

    async def _colocated_publisher(self) -> None:
        """Colocated mode: one task publishes every TokenEvent, in seq order; a job is acked when its
        request finishes."""
        while True:
            job, out = await self.next_or_none(self.events) or (None, None)
            if job is not None and not self._aborted(job):  # an aborted job's last outputs go nowhere
                req = job.request
                if out.finish_reason != "abort":
                    await self.publish(req, token_event(out, job.next_seq, self.ctx.instance_id, out.finish_reason))
                job.next_seq += 1
                job.output_token_ids += out.new_token_ids
                if out.finish_reason is not None:
                    self.jobs.pop(req.request_id, None)
                    await self._let_go(job, term=out.finish_reason == "error")
            for ended in await self.end_past_deadline(self.jobs):
                self.spawn(self._stop(ended))

    async def _stop(self, job: Job) -> None:
        """Stop a job no longer in ``jobs`` in the engine, and let it go."""
        rid = job.request.request_id
        await self.loop.call(lambda e: e.abort(rid))
        await self._let_go(job)

    async def _let_go(self, job: Job, term: bool = False) -> None:
        """Ack (``term``: terminate, a job the engine failed on) a job taken out of ``jobs`` and
        close what it held."""
        with contextlib.suppress(Exception):
            await (job.msg.term() if term else job.msg.ack())
        await job.stack.aclose()
        self.report()

    async def _write_back(self, period_s: float = 0.25) -> None:
        """Colocated mode: prompt blocks reach kvpool when this worker's cache evicts them, not when
        each request ends. Storing every finished prompt (export, lease, copy, store: four copies
        and four bus round trips) cost ~6% of large-model c32 throughput on 2 cores for prefixes
        that never left tier 0; a worker that keeps a prefix serves it itself when a repeat comes
        its way (the router sends repeats here). Best effort, like every kvpool store."""
        while True:
            await asyncio.sleep(period_s)
            if self.engine.num_evicted:
                evicted = await self.loop.call(lambda e: e.take_evicted())
                for chain in _chains(evicted):
                    await self._store_chain(chain)

    async def _announce(self, caching: bool, period_s: float = 0.1) -> None:
        """What changed: this worker's load (WorkerLoad, for the routers' instance choice) as soon as
        a job is taken or let go, and every ``period_s`` what its cache gained and lost (KV events,
        tier 0, for kvpool's index, which the router asks where a prompt is cached). Fire and
        forget: both are hints."""
        last, drained = None, time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period_s):  # a job taken or let go wakes it at once
                    await self._jobs_changed.wait()
            self._jobs_changed.clear()
            load = WorkerLoad(self.ctx.instance_id, len(self.jobs), self.capacity, self._taken[:MAX_TAKEN])
            if (load.requests, load.room) != last or load.taken:  # NOTE: before anything waits for the engine thread
                with contextlib.suppress(Exception):  # NATS reconnecting: the next change says it again
                    await self.ctx.nc.publish(subjects.load(self.ctx.instance_id), encode(load))
                    last = (load.requests, load.room)
                    del self._taken[: len(load.taken)]
                    if self._taken:  # more than one report holds
                        self._jobs_changed.set()
            if not caching or time.monotonic() - drained < period_s or not self.engine.num_cache_changes:
                continue
            drained = time.monotonic()
            changes = await self.loop.call(lambda e: e.take_cache_changes())
            if (batch := cache_events(self.ctx.instance_id, changes, self.engine.layout.block_size)) is not None:
                with contextlib.suppress(Exception):  # kvpool's index is a hint: this batch is lost
                    await self.ctx.nc.publish(subjects.KVPOOL_EVENTS, encode(batch))

    async def _keep_direct(self) -> None:
        """Make this worker's direct consumer again every few heartbeats (idempotent): a router that
        took this worker for gone (its heartbeats failed for a registry TTL) deleted it, and the
        pulls would find nothing until it is back."""
        while True:
            await asyncio.sleep(2 * self.ctx.options.heartbeat_s)
            for lane in self.lanes:
                with contextlib.suppress(Exception):  # NATS reconnecting: the next round
                    await ensure_direct_consumer(self.ctx.js, lane, self.ctx.instance_id, self.ctx.options.limits)

    async def _store_chain(self, chain: list[tuple[bytes, bytes, object]]) -> None:
        import torch

        try:
            await self.store_rows(torch.stack([row for _, _, row in chain]), [h for h, _, _ in chain],
                                  parent_hash=chain[0][1], ttl_s=self.lease_ttl_s)  # fmt: skip
        except Exception as exc:
            log.debug("could not write back %d evicted blocks: %s", len(chain), exc)

    async def _lease(self, job: Job, n_blocks: int):
        """A kvpool lease of ``n_blocks`` for the handoff of ``job``. While kvpool is full (the
        decode workers are behind, and its leases wait in their stream) the job waits, retrying,
        until it is aborted or its deadline passes (DeadlinePassed); the lease lasts until that
        deadline, as the handoff may wait in the stream that long (at most kvpool's --max-ttl).

        NOTE: a waiting job still counts against this worker's capacity, so prefill stops pulling
        while kvpool is full instead of computing KV that has nowhere to go."""
        req = job.request
        wait = _LEASE_RETRY_S
        while True:
            if self.releasing:  # NOTE: nothing of it published yet: another worker can take it on
                raise _Stopping
            ttl = self.lease_ttl_s
            if req.deadline is not None:
                ttl = min(max(ttl, req.deadline - time.time() + ttl), await self._max_lease_ttl())
            try:
                return await self.kv.allocate(n_blocks, ttl_s=ttl, request_id=req.request_id)
            except KVPoolError as exc:
                if exc.code != "exhausted" or self._aborted(job):
                    raise
                if n_blocks > (await self.kv.stats()).capacity_blocks:
                    raise KVPoolError(f"the request's {n_blocks} KV blocks exceed kvpool's whole capacity", "exhausted") from None
                if req.deadline is not None and time.time() + wait > req.deadline:
                    raise DeadlinePassed("the request's deadline passed while kvpool had no room for its KV") from None
                log.debug("kvpool is full; %s waits %.2fs for %d blocks", req.request_id, wait, n_blocks)
                await asyncio.sleep(wait)
                wait = min(2 * wait, _LEASE_RETRY_MAX_S)

    async def _max_lease_ttl(self) -> float:
        """kvpool's --max-ttl, asked once (a kvpool that does not say: the lease TTL alone)."""
        if self._max_ttl is None:
            self._max_ttl = (await self.kv.stats()).max_ttl_s or self.lease_ttl_s
        return self._max_ttl

    async def _hand_off(self, job: Job, out: StepOutput, state: dict, kv) -> None:
        req = job.request
        n_blocks, num_layers, layer_bytes = kv.shape
        lease = await self._lease(job, n_blocks)
        if self._aborted(job):  # NOTE: while it waited: decode would drop the handoff anyway
            with contextlib.suppress(Exception):
                await self.kv.release(lease.lease_id)
            return
        try:
            await self.write_rows(lease, kv)
            await self._commit_prefix(req, lease, n_blocks, state["num_computed_tokens"])
            handoff = Handoff(
                request=req,
                output_token_ids=list(state["output_token_ids"]),
                num_computed_tokens=state["num_computed_tokens"],
                lease=lease,
                state=state,
                kv_shape=[n_blocks, num_layers, layer_bytes],
                kv_format=self.engine.config.kv_format,
                prefill_worker=self.ctx.instance_id,
                next_seq=job.next_seq,  # (its first token out: first + 1)
                num_cached_tokens=out.num_cached_tokens,
            )
            # NOTE: a resumed request's handoff is not its first one's (the bus would drop it as a
            # duplicate); a redelivered job's second handoff still is its first's
            msg_id = f"{req.request_id}.resume.{req.resume_seq}" if req.resume_seq else req.request_id
            ack = await self.ctx.js.publish(subjects.handoff_subject(self.model, req.priority), encode(handoff),
                                            headers={subjects.MSG_ID_HEADER: msg_id})  # fmt: skip
        except BaseException:
            with contextlib.suppress(Exception):
                await self.kv.release(lease.lease_id)
            raise
        if ack.duplicate:  # a redelivered job handed off twice: decode reads the first lease, not this one
            with contextlib.suppress(Exception):
                await self.kv.release(lease.lease_id)

    async def on_abort(self, rid: str) -> None:
        job = self.jobs.pop(rid, None)
        if job is not None:
            await self._stop(job)

    async def _hand_on(self, job: Job) -> None:
        """Hand a job whose client has tokens from here on (``EngineWorker.hand_on``) to its lane's
        shared (or urgent) queue, also one that came by name
        (``llmbus.prefill.<lane>.<model>.at.<instance>``), and ack it."""
        req = job.request
        subject = subjects.lane_subject(req.lane or job.msg.subject.split(".")[2], self.model, req.priority)
        await self.hand_on(req, job.output_token_ids, job.next_seq, subject, "the prefill worker shut down")
        with contextlib.suppress(Exception):
            await job.msg.ack()

    async def _release_all(self) -> None:
        """On shutdown, give unfinished jobs back to the stream so another replica takes them: as
        they came, or one whose client has tokens from here as a resume job, continued from them,
        in its lane's shared (or urgent) queue (colocated; handing off, one whose handoff waits
        for kvpool room gives up waiting for it, ``_lease``)."""
        self.releasing = True
        finishing = [job.finishing for job in self.jobs.values() if job.finishing is not None]
        if finishing:  # (a handoff under way ends in a moment; one waiting for room, within a retry)
            await asyncio.wait(finishing, timeout=5.0)
        for job in list(self.jobs.values()):
            req = job.request
            if job.finishing is not None and not job.finishing.done():
                log.warning("stopping while the handoff of %s is still under way", req.request_id)
                continue  # (its own: neither nak'ed nor handed on beside it)
            if self.colocated and job.next_seq > req.resume_seq:
                await self._hand_on(job)
            else:
                with contextlib.suppress(Exception):
                    await job.msg.nak()  # another replica takes it
            await job.stack.aclose()
        self.jobs.clear()


def _chains(evicted: list[tuple[bytes, bytes, object]]) -> list[list[tuple[bytes, bytes, object]]]:
    """Evicted ``(hash, parent, row)`` blocks as hash chains, each from its first block: the cache
    evicts a sequence's blocks tail first, so a chain arrives reversed and interleaved with others.
    A block whose parent has two evicted children starts a chain of its own for the second."""
    by_parent = {item[1]: item for item in evicted}
    hashes = {h for h, _, _ in evicted}
    starts = [item for item in evicted if item[1] not in hashes]
    chains, seen = [], set()
    for item in starts + evicted:
        if item[0] in seen:
            continue
        chain = [item]
        seen.add(item[0])
        while chain[-1][0] in by_parent and by_parent[chain[-1][0]][0] not in seen:
            chain.append(by_parent[chain[-1][0]])
            seen.add(chain[-1][0])
        chains.append(chain)
    return chains

"""The router service: pulls GenerateRequests, routes them (policy.py), forwards to prefill lanes.

The registry is read before the first pull; the requests of one pull are routed side by side.
For each request on ``LLMBUS_REQUESTS`` (consumer ``router``):
- malformed payload -> a final error TokenEvent when the request id can be read, then ``term``;
- unknown model / empty prompt / passed deadline -> a final error TokenEvent, then ``ack``;
- otherwise publish it, with ``lane`` set, to ``llmbus.prefill.<lane>.<model>`` (Nats-Msg-Id =
  request_id) and ``ack`` only after the prefill stream has acknowledged it; on failure ``nak``
  (1 s), and on the last delivery fail the request instead.

Routing by cached prefix (``RoutingPolicy.kv_routing``, when a model has two or more prefill
workers with a prefix cache): the router hashes the prompt's blocks as those workers do (their
registry entries say how), asks kvpool's index which worker's cache holds how much of it
(``lookup``), and sends the request to ``llmbus.prefill.<lane>.<model>.at.<instance_id>`` when ``place``
finds that worker worth its load; else to the lane. kvpool not answering only costs the choice.
A worker that leaves the registry (two reads running) has what waits on its direct subject moved
back to the lanes, and its consumer deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from llmbus import tracing
from llmbus.bus import subjects
from llmbus.bus.kvclient import KVPoolClient
from llmbus.bus.service import ServiceContext
from llmbus.bus.streams import ensure_direct_consumer, read_registry
from llmbus.bus.tokens import TokenPublisher
from llmbus.bus.worker import PullWorker, RecentIds, malformed_failure, read_job
from llmbus.kv.hashing import chain_hashes, root_hash
from llmbus.metrics import Metric
from llmbus.protocol.messages import INVALID_REQUEST, MetricFamily
from llmbus.protocol import (LANES, GenerateRequest, InstanceInfo, ProtocolError, TokenEvent, WorkerLoad,
                             decode, encode)
from services.router.policy import (Backlog, Load, Placement, Route, RouteError, RoutingPolicy, live_models,
                                   place, whole)

log = logging.getLogger("llmbus.router")

SETTLED_IDS = 65536  # ids remembered as routed or failed: far more than come back within ack_wait
LOOKUP_TIMEOUT_S = 0.25  # kvpool's answer on where a prompt is cached; later, the lane takes it
LOOKUP_BACKOFF_S = 5.0  # after a failed lookup, requests skip it (and take their lanes) this long
# a WorkerLoad is sent as the worker's jobs change: requests sent to it shortly before one came may
# not have been pulled yet, so they still count
LOAD_SLACK_S = 0.05


class Router:
    def __init__(self, ctx: ServiceContext, policy: RoutingPolicy, *, fetch_batch: int = 64) -> None:
        self.ctx = ctx
        self.policy = policy
        self.fetch_batch = fetch_batch
        self.instances: list[InstanceInfo] = []
        self.requests = Metric("llmbus_router_requests_total",
                               "Requests the router settled, by the model and lane it chose and outcome: routed "
                               "(forwarded to prefill) or failed (the client was told why). A failed one's lane is "
                               "none, and its model 'unknown' unless it names a served one.", "counter", ("model", "lane", "outcome"))
        self.directed = Metric("llmbus_router_directed_total",
                               "Requests sent to one prefill worker for the prefix its cache holds, by model.",
                               "counter", ("model",))  # fmt: skip
        self.directed_blocks = Metric("llmbus_router_directed_cached_blocks_total",
                                      "KV blocks of their prompts the directed requests were expected to reuse.",
                                      "counter", ("model",))  # fmt: skip
        self.wholes = Metric("llmbus_router_whole_total",
                             "Short prompts sent to the decode pool whole (conditional disaggregation), by model.",
                             "counter", ("model",))  # fmt: skip
        self.rescued = Metric("llmbus_router_rescued_total",
                              "Directed requests moved back to their lane because their worker went away.", "counter")
        self.lookup_failures = Metric("llmbus_router_lookup_failures_total",
                                      "kvpool lookups that failed or timed out (the request took its lane).", "counter")
        ctx.add_metrics(lambda: [m.family() for m in (self.requests, self.directed, self.directed_blocks, self.wholes,
                                                      self.rescued, self.lookup_failures)] + [self._candidates()])  # fmt: skip
        self.kv = KVPoolClient(ctx.nc, transport="bus", timeout=LOOKUP_TIMEOUT_S, owner=ctx.instance_id)
        self.backlog = Backlog()
        self._lookups_off_until = 0.0
        self.loads: dict[str, tuple[WorkerLoad, float]] = {}  # worker -> its last report, and when it came
        self._gone: set[tuple[str, str]] = set()  # (lane, direct-subject owner) missing from the last registry read
        self.tokens = TokenPublisher(ctx.nc)
        # request ids whose fate was sent (forwarded or failed): a message that comes back because
        # its ack failed is acked quietly, not routed (or failed) a second time
        self._settled = RecentIds(SETTLED_IDS)

    @property
    def routed(self) -> int:
        return self._settled_as("routed")

    @property
    def failed(self) -> int:
        return self._settled_as("failed")

    def _settled_as(self, outcome: str) -> int:
        return int(sum(v for (_, _, o), v in self.requests.values.items() if o == outcome))

    async def run(self) -> None:
        limits = self.ctx.options.limits
        worker = await PullWorker.bind(self.ctx.js, subjects.REQUESTS_STREAM, subjects.ROUTER_CONSUMER,
                                       max_deliver=limits.max_deliver)  # fmt: skip
        self.ctx.stack.push_async_callback(worker.close)
        self.ctx.stack.push_async_callback(self.tokens.drain)
        if self.policy.kv_routing:
            sub = await self.ctx.nc.subscribe(subjects.LOADS_WILDCARD, cb=self._on_load)
            self.ctx.stack.push_async_callback(sub.unsubscribe)
        # NOTE: the registry is read before the first fetch: a router (re)started while requests
        # wait must not fail them as unknown models, nor route them knowing no worker
        live = await self._read_registry()
        while live is None and not self.ctx.stop.is_set():  # (NATS settling: a failed read knows nothing)
            await asyncio.sleep(0.5)
            live = await self._read_registry()
        watcher = asyncio.create_task(self._watch_registry(live))
        await self.ctx.ready()
        try:
            while not self.ctx.stop.is_set():
                # NOTE: a batch's requests are routed side by side: one waiting on kvpool's lookup
                # or on its stream's ack holds up none of the others (one at a time, a burst's last
                # request waited for every lookup before it)
                msgs = await worker.fetch(self.fetch_batch, timeout=0.5)
                await asyncio.gather(*(self._handle_guarded(worker, msg) for msg in msgs))
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _handle_guarded(self, worker: PullWorker, msg) -> None:
        try:
            await self._handle(worker, msg)
        except Exception:  # one message's bad luck must not stop the routing of the rest
            log.exception("could not route a request; dropping it")
            with contextlib.suppress(Exception):
                await self._fail_unreadable(msg.data, "the router could not route this request")
            with contextlib.suppress(Exception):
                await msg.term()

    async def _handle(self, worker: PullWorker, msg) -> None:
        try:
            req = decode(GenerateRequest, msg.data)
        except ProtocolError as exc:
            log.warning("dropping malformed request: %s", exc)
            await self._fail_unreadable(msg.data, f"malformed request: {exc}", INVALID_REQUEST)
            await _settle(msg.term())
            return
        if req.request_id in self._settled:
            await _settle(msg.ack())
            return
        span = tracing.start("llmbus.route", req.traceparent, attributes={
            "llmbus.request_id": req.request_id, "gen_ai.request.model": req.model,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids), "llmbus.instance": self.ctx.instance_id})
        try:
            await self._route(worker, msg, req, span)
        finally:
            span.end()

    async def _route(self, worker: PullWorker, msg, req: GenerateRequest, span) -> None:
        try:
            if req.deadline is not None and req.deadline < time.time():
                raise TimeoutError("the request's deadline passed before it was routed")
            route = self.policy.route(req.model, len(req.prompt_token_ids), live_models(self.instances))
        except (RouteError, TimeoutError) as exc:  # a RouteError is the request's own fault (no such model...)
            tracing.fail(span, str(exc))
            await self._fail(req, str(exc), INVALID_REQUEST if isinstance(exc, RouteError) else "")
            await _settle(msg.ack())
            return
        to_decode = whole(self.policy, route.model, len(req.prompt_token_ids), self.instances)
        placement = Placement() if to_decode else await self._place(req, route)
        span.set_attributes({"llmbus.lane": route.lane, "llmbus.model": route.model,
                             "llmbus.target": "whole" if to_decode else placement.instance or "lane",
                             "llmbus.expected_cached_blocks": placement.cached_blocks})  # fmt: skip
        forwarded = dataclasses.replace(req, lane=route.lane)
        # NOTE: all three in the lane's stream, where the request id dedups a second forward of a
        # request that came back (its ack lost) to whichever target the router picks then
        if to_decode:
            subject = subjects.whole_lane_subject(route.lane, route.model, req.priority)
        elif placement.instance:
            subject = subjects.direct_subject(route.lane, route.model, placement.instance)
        else:
            subject = subjects.lane_subject(route.lane, route.model, req.priority)
        try:
            await self.ctx.js.publish(subject, encode(forwarded), headers={subjects.MSG_ID_HEADER: req.request_id})
        except Exception as exc:  # no stream, timeout, disconnected: transient unless out of retries
            tracing.fail(span, f"could not forward the request to prefill: {exc}")
            if worker.is_last_delivery(msg):
                await self._fail(req, f"could not forward the request to prefill: {exc}")
                await _settle(msg.term())
            else:
                await _settle(msg.nak(delay=1.0))
            return
        self.requests.add(1, route.model, route.lane, "routed")
        if placement.instance:
            self.directed.add(1, route.model)
            self.directed_blocks.add(placement.cached_blocks, route.model)
        if to_decode:
            self.wholes.add(1, route.model)
        self._settled.add(req.request_id)
        await _settle(msg.ack())

    def _kv_workers(self, model: str) -> list[InstanceInfo]:
        """The live prefill workers of ``model`` with a prefix cache, as of the last registry read."""
        return [i for i in self.instances if i.role == "prefill" and model in i.models and i.block_size > 0]

    def _candidates(self) -> MetricFamily:
        # NOTE: worker_role, not role: the gateway labels every sample with the answering service's role
        gauge = Metric("llmbus_router_workers", "Live workers the router sees (its last registry read), by model and "
                       "worker role: it routes by cached prefix between two or more prefill workers, and sends "
                       "short prompts whole to a decode pool.", "gauge", ("model", "worker_role"))  # fmt: skip
        for model in self.policy.served(live_models(self.instances)):
            for role in ("prefill", "decode"):
                gauge.add(sum(i.role == role and model in i.models for i in self.instances), model, role)
        return gauge.family()

    async def _place(self, req: GenerateRequest, route: Route) -> Placement:
        """The prefill worker whose cache makes ``req`` cheapest, or the lane (Placement())."""
        if not self.policy.kv_routing or req.sampling.prompt_logprobs is not None:  # scoring reuses nothing
            return Placement()
        if time.monotonic() < self._lookups_off_until:  # kvpool failed a moment ago: no wait on it
            return Placement()
        # replicas of one model hash alike; during a change (block size, KV format) the larger group counts
        groups: dict[tuple, list[InstanceInfo]] = {}
        for w in self._kv_workers(route.model):
            groups.setdefault((w.prefix_model, w.kv_format, w.block_size), []).append(w)
        workers = max(groups.values(), key=len, default=[])
        if len(workers) < 2:
            return Placement()
        ref = workers[0]
        # NOTE: the last prompt token is always computed (its logits give the first token)
        hashes = chain_hashes(root_hash(ref.prefix_model, ref.kv_format, req.cache_salt),
                              req.prompt_token_ids[:-1], ref.block_size)  # fmt: skip
        if not hashes:
            return Placement()
        try:
            reply = await self.kv.lookup(hashes)
        except Exception as exc:  # KVPoolError (no answer in time), a reply that does not decode
            self.lookup_failures.add(1)
            self._lookups_off_until = time.monotonic() + LOOKUP_BACKOFF_S
            log.warning("kvpool lookup failed (%s): requests take their lanes for %.0f s", exc, LOOKUP_BACKOFF_S)
            return Placement()
        hits = {h.worker: h.num_blocks for h in reply.hits if h.tier == "t0"}
        if not hits:
            return Placement()
        placement = place(self._loads(workers), hits, reply.pool_blocks, self.policy.max_imbalance)
        if placement.instance:
            self.backlog.add(placement.instance, req.request_id, time.time())
        return placement

    def _loads(self, workers: list[InstanceInfo]) -> dict[str, Load]:
        """Each worker's last WorkerLoad (else its heartbeat's queue depth, room unknown), with the
        requests this router sent it since and no report has listed as taken counted as held and
        as room taken."""
        now = time.time()
        out: dict[str, Load] = {}
        for w in workers:
            report = self.loads.get(w.instance_id)
            if report is not None:
                load, since = Load(report[0].requests, report[0].room), report[1] - LOAD_SLACK_S
            else:  # a worker that does not report: its registry entry
                load, since = Load(w.queue_depth), w.updated_at
            sent = self.backlog.since(w.instance_id, since, now)
            out[w.instance_id] = Load(load.requests + sent, None if load.room is None else load.room - sent)
        return out

    async def _on_load(self, msg) -> None:
        try:
            load = decode(WorkerLoad, msg.data)
        except ProtocolError as exc:
            log.debug("dropping a malformed load report: %s", exc)
            return
        self.loads[load.instance_id] = (load, time.time())
        self.backlog.taken(load.instance_id, load.taken)

    async def _fail(self, req: GenerateRequest, message: str, code: str = "") -> None:
        """``code``: the event's ``error_code`` (``INVALID_REQUEST`` when the request is at fault)."""
        # NOTE: a label only for a model served: a client's made-up names must not mint series
        served = req.model in self.policy.served(live_models(self.instances))
        self.requests.add(1, req.model if served else "unknown", "none", "failed")
        self._settled.add(req.request_id)
        event = TokenEvent.failure(req.request_id, message, worker=self.ctx.instance_id,
                                   prompt_tokens=len(req.prompt_token_ids), code=code)  # fmt: skip
        await self.tokens.publish(req.token_subject or subjects.tokens(req.request_id), event)

    async def _fail_unreadable(self, data: bytes, message: str, code: str = "") -> None:
        """Best effort: tell the client when the payload at least names its request."""
        if (told := malformed_failure(data, message, self.ctx.instance_id, code)) is None:
            return
        self.requests.add(1, "unknown", "none", "failed")  # (a name nothing checked: not a label)
        await self.tokens.publish(*told)

    async def _watch_registry(self, live: set[str] | None) -> None:
        """Refresh the live-instance snapshot once per heartbeat period (``live``: the first read's)."""
        while True:
            if live is not None:
                try:
                    await self._rescue_orphans(live)
                except Exception as exc:  # NATS reconnecting: the next read tries again
                    log.warning("could not look after direct subjects: %s", exc)
            self.ctx.report(queue_depth=0)
            await asyncio.sleep(self.ctx.options.heartbeat_s)
            live = await self._read_registry()

    async def _read_registry(self) -> set[str] | None:
        """Read the live instances; the live prefill workers' ids, or None (the last snapshot stays)."""
        try:
            self.instances = await read_registry(self.ctx.registry)
        except Exception as exc:  # a timeout while NATS reconnects: keep the last snapshot
            log.warning("could not read the registry: %s", exc)
            return None
        live = {i.instance_id for i in self.instances if i.role == "prefill"}
        for gone in [w for w in self.loads if w not in live]:
            del self.loads[gone]
        self.backlog.forget(live)
        return live

    async def _rescue_orphans(self, live: set[str]) -> None:
        """Move work waiting on the direct subjects of a prefill worker missing from two registry
        reads running and nobody pulls from (it crashed or stopped; a worker that stops gives back
        what it held, and that lands there too) back to its lane, then delete the worker's
        consumer (a worker that comes back makes it again: ``PrefillWorker._keep_direct``)."""
        js = self.ctx.js
        cprefix = subjects.direct_consumer("x")[:-1]
        gone: set[tuple[str, str]] = set()
        for lane in LANES:
            stream = subjects.PREFILL_STREAMS[lane]
            info = await js.stream_info(stream, subjects_filter=subjects.direct_subjects(lane))
            owners = {s.rsplit(".", 1)[1] for s in (info.state.subjects or {})}
            consumers = {c.name[len(cprefix):]: c for c in await js.consumers_info(stream)
                         if c.name.startswith(cprefix)}  # fmt: skip
            # NOTE: a consumer someone is pulling from has a live owner, registered or not (its
            # heartbeats may fail for a while): its queue is left alone
            pulled = {owner for owner, c in consumers.items() if c.num_waiting}
            gone |= {(lane, owner) for owner in (owners | set(consumers)) - live - pulled}
        for lane, instance in sorted(gone & self._gone):
            await self._move_back(lane, instance)
        self._gone = gone

    async def _move_back(self, lane: str, instance: str) -> None:
        js, limits = self.ctx.js, self.ctx.options.limits
        stream = subjects.PREFILL_STREAMS[lane]
        name = await ensure_direct_consumer(js, lane, instance, limits)
        worker = await PullWorker.bind(js, stream, name, max_deliver=limits.max_deliver)
        moved = 0
        try:
            while msgs := await worker.fetch(64, timeout=0.2):
                for msg in msgs:
                    if (req := await read_job(GenerateRequest, msg, "request")) is None:
                        continue
                    # NOTE: its own id (the request id is in this stream's dedup window: it came in
                    # under it); a second router moving the same message dedups
                    await js.publish(subjects.lane_subject(lane, req.model, req.priority), msg.data,
                                     headers={subjects.MSG_ID_HEADER: f"{req.request_id}.moved"})  # fmt: skip
                    await msg.ack()
                    moved += 1
        finally:
            await worker.close()
        self.rescued.add(moved)
        state = await js.consumer_info(stream, name)
        if not state.num_pending and not state.num_ack_pending:
            await js.delete_consumer(stream, name)
        log.info("prefill worker %s went away: %d of its %s-lane requests moved back to the lane", instance, moved, lane)


async def _settle(ack) -> None:
    """An ack, nak or term after the request's fate is sent. Failing (NATS reconnecting), it must
    not reach the loop's guard, which would fail a request already forwarded or failed: the message
    comes back instead, and a second forward is a duplicate the prefill stream drops."""
    try:
        await ack
    except Exception as exc:
        log.debug("could not settle a request message: %s", exc)

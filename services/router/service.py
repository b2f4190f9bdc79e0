"""The router service: pulls GenerateRequests, routes them (policy.py), forwards to prefill lanes.

For each request on ``LLMBUS_REQUESTS`` (consumer ``router``):
- malformed payload -> a final error TokenEvent when the request id can be read, then ``term``;
- unknown model / empty prompt / passed deadline -> a final error TokenEvent, then ``ack``;
- otherwise publish it, with ``lane`` set, to ``llmbus.prefill.<lane>.<model>`` (Nats-Msg-Id =
  request_id) and ``ack`` only after the prefill stream has acknowledged it; on failure ``nak``
  (1 s), and on the last delivery fail the request instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import msgpack

from llmbus import tracing
from llmbus.bus import subjects
from llmbus.bus.service import ServiceContext
from llmbus.bus.streams import read_registry
from llmbus.bus.tokens import TokenPublisher
from llmbus.bus.worker import PullWorker, RecentIds
from llmbus.metrics import Metric
from llmbus.protocol import (GenerateRequest, InstanceInfo, ProtocolError, TokenEvent, check_token_subject,
                             decode, encode)
from services.router.policy import RouteError, RoutingPolicy, live_models

log = logging.getLogger("llmbus.router")

SETTLED_IDS = 65536  # ids remembered as routed or failed: far more than come back within ack_wait


class Router:
    def __init__(self, ctx: ServiceContext, policy: RoutingPolicy, *, fetch_batch: int = 64) -> None:
        self.ctx = ctx
        self.policy = policy
        self.fetch_batch = fetch_batch
        self.instances: list[InstanceInfo] = []
        self.requests = Metric("llmbus_router_requests_total",
                               "Requests the router settled, by the model and lane it chose and outcome: routed "
                               "(forwarded to prefill) or failed (the client was told why). A failed one's lane is "
                               "none, and its model the one asked for.", "counter", ("model", "lane", "outcome"))
        ctx.add_metrics(lambda: [self.requests.family()])
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
        watcher = asyncio.create_task(self._watch_registry())
        await self.ctx.ready()
        try:
            while not self.ctx.stop.is_set():
                for msg in await worker.fetch(self.fetch_batch, timeout=0.5):
                    try:
                        await self._handle(worker, msg)
                    except Exception:  # one message's bad luck must not stop the routing of the rest
                        log.exception("could not route a request; dropping it")
                        with contextlib.suppress(Exception):
                            await self._fail_unreadable(msg.data, "the router could not route this request")
                        with contextlib.suppress(Exception):
                            await msg.term()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _handle(self, worker: PullWorker, msg) -> None:
        try:
            req = decode(GenerateRequest, msg.data)
        except ProtocolError as exc:
            log.warning("dropping malformed request: %s", exc)
            await self._fail_unreadable(msg.data, f"malformed request: {exc}")
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
                raise RouteError("the request's deadline passed before it was routed")
            route = self.policy.route(req.model, len(req.prompt_token_ids), live_models(self.instances))
        except RouteError as exc:
            tracing.fail(span, str(exc))
            await self._fail(req, str(exc))
            await _settle(msg.ack())
            return
        span.set_attributes({"llmbus.lane": route.lane, "llmbus.model": route.model})
        forwarded = dataclasses.replace(req, lane=route.lane)
        try:
            await self.ctx.js.publish(subjects.prefill_subject(route.lane, route.model), encode(forwarded),
                                      headers={subjects.MSG_ID_HEADER: req.request_id})  # fmt: skip
        except Exception as exc:  # no stream, timeout, disconnected: transient unless out of retries
            tracing.fail(span, f"could not forward the request to prefill: {exc}")
            if worker.is_last_delivery(msg):
                await self._fail(req, f"could not forward the request to prefill: {exc}")
                await _settle(msg.term())
            else:
                await _settle(msg.nak(delay=1.0))
            return
        self.requests.add(1, route.model, route.lane, "routed")
        self._settled.add(req.request_id)
        await _settle(msg.ack())

    async def _fail(self, req: GenerateRequest, message: str) -> None:
        self.requests.add(1, req.model, "none", "failed")
        self._settled.add(req.request_id)
        event = TokenEvent.failure(req.request_id, message, worker=self.ctx.instance_id,
                                   prompt_tokens=len(req.prompt_token_ids))  # fmt: skip
        await self.tokens.publish(req.token_subject or subjects.tokens(req.request_id), event)

    async def _fail_unreadable(self, data: bytes, message: str) -> None:
        """Best effort: tell the client when the payload at least names its request."""
        try:
            raw = msgpack.unpackb(data, raw=False)
            rid = raw["request_id"]
            subject = subjects.tokens(rid)
            with contextlib.suppress(ValueError):  # a subject it cannot have asked for: its own
                subject = check_token_subject(raw.get("token_subject") or subject, rid)
            event = TokenEvent.failure(rid, message, worker=self.ctx.instance_id)
        except Exception:
            return
        self.requests.add(1, "unknown", "none", "failed")  # (a name nothing checked: not a label)
        await self.tokens.publish(subject, event)

    async def _watch_registry(self) -> None:
        """Refresh the live-instance snapshot once per heartbeat period."""
        while True:
            try:
                self.instances = await read_registry(self.ctx.registry)
            except Exception as exc:  # a timeout while NATS reconnects: keep the last snapshot
                log.warning("could not read the registry: %s", exc)
            self.ctx.report(queue_depth=0)
            await asyncio.sleep(self.ctx.options.heartbeat_s)


async def _settle(ack) -> None:
    """An ack, nak or term after the request's fate is sent. Failing (NATS reconnecting), it must
    not reach the loop's guard, which would fail a request already forwarded or failed: the message
    comes back instead, and a second forward is a duplicate the prefill stream drops."""
    try:
        await ack
    except Exception as exc:
        log.debug("could not settle a request message: %s", exc)

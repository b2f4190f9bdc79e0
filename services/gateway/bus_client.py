"""The gateway's side of the bus, the only gateway module that touches NATS.

The gateway listens on one subject, ``llmbus.toks.<its instance id>``, from the start, and names it
as every request's ``token_subject``: workers send each engine step's events for all of this
gateway's requests as one ``TokenEvents`` message (``llmbus.bus.tokens``), which this module hands
out to the requests' TokenStreams by request id. Submitting a request registers its stream FIRST,
then publishes the GenerateRequest to JetStream with ``Nats-Msg-Id = request_id`` (dedup on
retries), so no event can arrive before its stream is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import nats
from nats.js.errors import NoStreamResponseError

from llmbus.bus import subjects
from llmbus.bus.streams import read_registry
from llmbus.bus.tokens import read_batch
from llmbus.bus.metrics import scrape
from llmbus.protocol import Abort, GenerateRequest, InstanceInfo, MetricFamily, encode
from services.gateway.errors import server_error
from services.gateway.token_stream import TokenStream


log = logging.getLogger("llmbus.gateway")

REGISTRY_READ_S = 1.0  # how old a registry read may be when silent streams ask whether workers are busy


class Listening:
    """A submitted request's place in the routing table; ``close`` stops its events (idempotent)."""

    def __init__(self, streams: dict[str, TokenStream], request_id: str) -> None:
        self._streams = streams
        self.request_id = request_id

    def close(self) -> None:
        self._streams.pop(self.request_id, None)


class GatewayBus:
    def __init__(self, nc: nats.NATS, instance_id: str, publish_timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=publish_timeout_s)
        self.token_subject = subjects.token_batches(instance_id)
        self._streams: dict[str, TokenStream] = {}
        self._instances: list[InstanceInfo] = []
        self._read_at = -REGISTRY_READ_S
        self._reading = asyncio.Lock()

    async def workers_busy(self, model: str, last_worker: str = "") -> bool:
        """Whether a live prefill or decode worker of ``model`` holds requests (its registry entry,
        read at most once a second): a request silent for a while is then queued behind theirs,
        not lost. False when the registry cannot be read, or when ``last_worker``, the sender of
        the request's last event, is gone from it (it died holding the request)."""
        instances = await self.instances()
        if last_worker and all(i.instance_id != last_worker for i in instances):
            return False
        return any(i.role in ("prefill", "decode") and model in i.models and i.queue_depth > 0 for i in instances)

    async def instances(self) -> list[InstanceInfo]:
        """The registry's live instances, as read at most ``REGISTRY_READ_S`` ago (empty when it
        cannot be read)."""
        async with self._reading:
            if time.monotonic() - self._read_at >= REGISTRY_READ_S:
                try:
                    self._instances = await read_registry(await self.js.key_value(subjects.REGISTRY_BUCKET))
                except Exception as exc:
                    log.debug("could not read the registry: %r", exc)
                    self._instances = []
                self._read_at = time.monotonic()
        return self._instances

    async def scrape(self, instances: list[InstanceInfo]) -> list[MetricFamily]:
        """Every other service's metrics (``llmbus.bus.metrics.scrape``)."""
        return await scrape(self.nc, instances)

    async def start(self):
        """Subscribe to this gateway's token batches; returns the subscription (drained with the
        connection)."""
        return await self.nc.subscribe(self.token_subject, cb=self._on_batch)

    async def _on_batch(self, msg) -> None:
        for rid, item in read_batch(msg.data):
            stream = self._streams.get(rid) if rid is not None else None
            if stream is not None:
                stream.push(item)
            elif rid is None:  # its requests find out through their silence timeout
                log.warning("dropping unreadable token events: %s", item)

    async def submit(self, request: GenerateRequest, stream: TokenStream) -> Listening:
        """Route the request's events to ``stream``, then enqueue the request. Returns its
        ``Listening`` (the caller closes it). Raises APIError 503 when the bus refuses."""
        request = dataclasses.replace(request, token_subject=self.token_subject)
        self._streams[request.request_id] = stream
        sub = Listening(self._streams, request.request_id)
        try:
            await self.js.publish(subjects.request_subject(request.model), encode(request),
                                  headers={subjects.MSG_ID_HEADER: request.request_id})
        except NoStreamResponseError:
            sub.close()
            raise server_error("the request queue does not exist (is the router's stream set up?)", 503,
                               code="service_unavailable") from None
        except Exception as exc:  # timeouts, disconnects: the client sees 503, not a traceback
            sub.close()
            # NOTE: a publish that timed out may still have been stored: the workers are told to drop
            # it, or it would be generated for nobody, up to its max_tokens
            with contextlib.suppress(Exception):
                await self.abort(request.request_id, "submit_failed")
            raise server_error(f"could not enqueue the request: {type(exc).__name__}: {exc}", 503,
                               code="service_unavailable") from None
        except BaseException:  # cancelled (the client left): the caller aborts it
            sub.close()
            raise
        return sub

    async def abort(self, request_id: str, reason: str) -> None:
        """Tell every worker to stop ``request_id`` and free its blocks (core NATS, at most once)."""
        await self.nc.publish(subjects.abort(request_id), encode(Abort(request_id, reason)))

"""Asking services for their metrics over the bus (``llmbus.metrics.<instance_id>``): what the
gateway's ``/metrics`` and ``llmbus top`` read."""

from __future__ import annotations

import asyncio
import logging

from llmbus.bus import subjects
from llmbus.metrics import Metric, labelled
from llmbus.protocol import InstanceInfo, MetricFamily, MetricsReply, MetricsRequest, decode, encode

log = logging.getLogger("llmbus.metrics")

SCRAPE_TIMEOUT_S = 1.0  # how long to wait for each service's answer


async def ask_all(nc, instances: list[InstanceInfo], timeout: float = SCRAPE_TIMEOUT_S) -> list[MetricsReply | None]:
    """Each instance's MetricsReply (all asked at once), None for one that did not answer in
    ``timeout`` or answered something unreadable."""

    async def ask(info: InstanceInfo) -> MetricsReply | None:
        try:
            msg = await nc.request(subjects.metrics(info.instance_id), encode(MetricsRequest()), timeout=timeout)
            return decode(MetricsReply, msg.data)
        except Exception as exc:  # no answer in time, or not one we read
            log.debug("no metrics from %s: %r", info.instance_id, exc)
            return None

    return list(await asyncio.gather(*(ask(i) for i in instances)))


async def scrape(nc, instances: list[InstanceInfo], timeout: float = SCRAPE_TIMEOUT_S) -> list[MetricFamily]:
    """Every non-gateway instance's families, each labelled with the answering ``instance`` and
    ``role``; and ``llmbus_up``: 1 for each instance that answered in ``timeout``, 0 for one that
    did not."""
    others = [i for i in instances if i.role != "gateway"]
    replies = await ask_all(nc, others, timeout)
    up = Metric("llmbus_up", "1 when a live instance (its registry entry) answered this scrape's metrics request, "
                "else 0.", "gauge", ("instance", "role"))  # fmt: skip
    families = []
    for info, reply in zip(others, replies):
        up.set(0 if reply is None else 1, info.instance_id, info.role)
        if reply is not None:
            families += [labelled(f, instance=info.instance_id, role=info.role) for f in reply.families]
    return [up.family(), *families]

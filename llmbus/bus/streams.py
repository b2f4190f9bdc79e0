"""Creating llmbus's JetStream streams, durable pull consumers and the registry bucket, idempotently.

Every stream is a work queue (a message is deleted once acked or termed), file-backed, with a
per-message size cap and a duplicate window so ``Nats-Msg-Id = request_id`` dedups re-publishes.
Consumers are durable pull consumers with explicit ack; ``max_ack_pending`` bounds how many
messages the whole pool of replicas may hold unacked (the backpressure knob).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from nats.js import JetStreamContext, api
from nats.js.errors import InvalidKeyError, KeyValueError, NotFoundError
from nats.js.kv import KeyValue

from llmbus.bus import subjects
from llmbus.protocol import InstanceInfo, ProtocolError, decode
from llmbus.protocol.messages import LANES


@dataclass(frozen=True)
class StreamLimits:
    max_msg_size: int = 1024 * 1024  # bytes; a 128k-token prompt is ~640 KB of msgpack
    duplicate_window_s: float = 120.0
    max_age_s: float = 3600.0  # work older than this is dropped unread
    ack_wait_s: float = 30.0  # redelivery after this without ack / in_progress
    max_deliver: int = 5  # then the message stays unacked; workers fail it on the last delivery
    router_max_ack_pending: int = 1024
    prefill_max_ack_pending: int = 256
    decode_max_ack_pending: int = 1024
    registry_ttl_s: float = 10.0  # a registry entry vanishes this long after its last heartbeat

    def __post_init__(self) -> None:
        for name in ("max_msg_size", "max_deliver", "router_max_ack_pending",
                     "prefill_max_ack_pending", "decode_max_ack_pending"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"StreamLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("duplicate_window_s", "max_age_s", "ack_wait_s", "registry_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StreamLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.duplicate_window_s > self.max_age_s:
            raise ValueError("StreamLimits.duplicate_window_s must not exceed max_age_s")


def stream_configs(limits: StreamLimits) -> list[api.StreamConfig]:
    def work_queue(name: str, subject: str) -> api.StreamConfig:
        return api.StreamConfig(
            name=name,
            subjects=[subject],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            max_msg_size=limits.max_msg_size,
            duplicate_window=limits.duplicate_window_s,
            max_age=limits.max_age_s,
        )

    out = [work_queue(subjects.REQUESTS_STREAM, subjects.REQUESTS_SUBJECTS)]
    out += [work_queue(subjects.PREFILL_STREAMS[lane], subjects.prefill_subjects(lane)) for lane in LANES]
    out.append(work_queue(subjects.DECODE_STREAM, subjects.DECODE_SUBJECTS))
    return out


async def ensure_streams(js: JetStreamContext, limits: StreamLimits | None = None, models: tuple[str, ...] = ()) -> None:
    """Create or update every llmbus stream, the router consumer and, for each of ``models``,
    its prefill (both lanes) and decode consumers. Safe to call from every service at start-up."""
    limits = limits or StreamLimits()
    for config in stream_configs(limits):
        try:
            await js.stream_info(config.name)
        except NotFoundError:
            await js.add_stream(config)
        else:
            await js.update_stream(config)
    await _ensure_consumer(js, subjects.REQUESTS_STREAM, subjects.ROUTER_CONSUMER, subjects.REQUESTS_SUBJECTS,
                           limits, limits.router_max_ack_pending)  # fmt: skip
    for model in models:
        for lane in LANES:
            await ensure_prefill_consumer(js, lane, model, limits)
            await ensure_urgent_consumer(js, lane, model, limits)
        await ensure_decode_consumer(js, model, limits)
        await ensure_urgent_handoff_consumer(js, model, limits)


async def ensure_prefill_consumer(js: JetStreamContext, lane: str, model: str, limits: StreamLimits | None = None) -> str:
    """The durable consumer prefill replicas of ``model`` share on ``lane``; returns its name."""
    limits = limits or StreamLimits()
    return await _ensure_consumer(js, subjects.PREFILL_STREAMS[lane], subjects.prefill_consumer(lane, model),
                                  subjects.prefill_subject(lane, model), limits, limits.prefill_max_ack_pending)  # fmt: skip


async def ensure_urgent_consumer(js: JetStreamContext, lane: str, model: str, limits: StreamLimits | None = None) -> str:
    """The durable consumer prefill replicas of ``model`` share for urgent work on ``lane``."""
    limits = limits or StreamLimits()
    return await _ensure_consumer(js, subjects.PREFILL_STREAMS[lane], subjects.urgent_consumer(model),
                                  subjects.urgent_subject(lane, model), limits, limits.prefill_max_ack_pending)  # fmt: skip


async def ensure_urgent_handoff_consumer(js: JetStreamContext, model: str, limits: StreamLimits | None = None) -> str:
    """The durable consumer decode replicas of ``model`` share for urgent handoffs."""
    limits = limits or StreamLimits()
    return await _ensure_consumer(js, subjects.DECODE_STREAM, subjects.urgent_consumer(model),
                                  subjects.urgent_decode_subject(model), limits, limits.decode_max_ack_pending)  # fmt: skip


async def ensure_direct_consumer(js: JetStreamContext, lane: str, instance_id: str,
                                 limits: StreamLimits | None = None) -> str:  # fmt: skip
    """The durable consumer of prefill worker ``instance_id``'s direct subjects in ``lane``'s
    stream; returns its name."""
    limits = limits or StreamLimits()
    return await _ensure_consumer(js, subjects.PREFILL_STREAMS[lane], subjects.direct_consumer(instance_id),
                                  subjects.direct_subjects(lane, instance_id), limits, limits.prefill_max_ack_pending)  # fmt: skip


async def ensure_decode_consumer(js: JetStreamContext, model: str, limits: StreamLimits | None = None) -> str:
    """The durable consumer decode replicas of ``model`` share; returns its name."""
    limits = limits or StreamLimits()
    return await _ensure_consumer(js, subjects.DECODE_STREAM, subjects.decode_consumer(model),
                                  subjects.decode_subject(model), limits, limits.decode_max_ack_pending)  # fmt: skip


async def ensure_whole_consumer(js: JetStreamContext, lane: str, model: str, limits: StreamLimits | None = None) -> str:
    """The durable consumer decode replicas of ``model`` share for whole requests in ``lane``'s
    stream; returns its name."""
    limits = limits or StreamLimits()
    return await _ensure_consumer(js, subjects.PREFILL_STREAMS[lane], subjects.whole_consumer(model),
                                  subjects.whole_subject(lane, model), limits, limits.decode_max_ack_pending)  # fmt: skip


async def ensure_urgent_whole_consumer(js: JetStreamContext, lane: str, model: str,
                                       limits: StreamLimits | None = None) -> str:  # fmt: skip
    """The durable consumer decode replicas of ``model`` share for urgent whole requests in
    ``lane``'s stream; returns its name."""
    limits = limits or StreamLimits()
    return await _ensure_consumer(js, subjects.PREFILL_STREAMS[lane], subjects.urgent_whole_consumer(model),
                                  subjects.urgent_whole_subject(lane, model), limits, limits.decode_max_ack_pending)  # fmt: skip


async def _ensure_consumer(js, stream: str, name: str, filter_subject: str, limits: StreamLimits,
                           max_ack_pending: int) -> str:
    # NOTE: CONSUMER.CREATE without an action is create-or-update, so this is idempotent. A work-queue
    # stream refuses a second consumer whose filter overlaps (10100): one durable per subject, shared.
    config = api.ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=filter_subject,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=limits.ack_wait_s,
        max_deliver=limits.max_deliver,
        max_ack_pending=max_ack_pending,
    )
    await js.add_consumer(stream, config)
    return name


async def ensure_registry(js: JetStreamContext, limits: StreamLimits | None = None) -> KeyValue:
    """The instance-registry KV bucket (bucket-wide TTL = ``registry_ttl_s``)."""
    return await _ensure_bucket(js, subjects.REGISTRY_BUCKET, (limits or StreamLimits()).registry_ttl_s)


async def ensure_limits_bucket(js: JetStreamContext) -> KeyValue:
    """The bucket where gateways save their tenants' rate-limit buckets (a day without a save
    refills any of them, so entries expire after two)."""
    return await _ensure_bucket(js, subjects.LIMITS_BUCKET, 2 * 86400.0)


async def ensure_responses_bucket(js: JetStreamContext, ttl_s: float, max_bytes: int) -> KeyValue:
    """The bucket where gateways keep Responses API answers for ``previous_response_id`` and
    ``GET /v1/responses/{id}``: each for ``ttl_s``, ``max_bytes`` in all (a gateway that finds it
    full stores nothing more until entries expire). Settings are the first creator's."""
    return await _ensure_bucket(js, subjects.RESPONSES_BUCKET, ttl_s, max_bytes)


async def _ensure_bucket(js: JetStreamContext, name: str, ttl_s: float, max_bytes: int | None = None) -> KeyValue:
    try:
        return await js.key_value(name)
    except Exception:  # BucketNotFoundError; create it (idempotent if a peer won the race)
        return await js.create_key_value(bucket=name, ttl=ttl_s, history=1, max_bytes=max_bytes)


async def read_registry(kv: KeyValue, timeout_s: float = 5.0) -> list[InstanceInfo]:
    """Every live instance in the registry bucket (``read_bucket``)."""
    return await read_bucket(kv, subjects.REGISTRY_BUCKET, InstanceInfo, timeout_s)


async def read_bucket(kv: KeyValue, bucket: str, record: type, timeout_s: float = 5.0) -> list:
    """Every ``record`` in KV bucket ``bucket``. A key that expires or is deleted between listing
    and reading, that nats-py refuses to read (a name some other client put there), or that holds a
    record this version cannot decode, is skipped. TimeoutError after ``timeout_s``.

    NOTE: keys are listed from the bucket's stream info, one request, not with ``kv.keys()``: that
    opens a watcher (a subscription and a server consumer) which it stops only when it completes,
    so a read that times out would leak one on every registry refresh."""
    async with asyncio.timeout(timeout_s):  # NOTE: not wait_for, which on 3.11 can swallow a cancel
        return await _read_bucket(kv, bucket, record)


async def _read_bucket(kv: KeyValue, bucket: str, record: type) -> list:
    prefix = f"$KV.{bucket}."
    # NOTE: one page of at most 100,000 subjects (nats-py asks for no more): far past any registry
    info = await kv._js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")  # noqa: SLF001
    out = []
    for subject in sorted(info.state.subjects or {}):
        try:
            out.append(decode(record, (await kv.get(subject[len(prefix):])).value))
        except (KeyValueError, InvalidKeyError, ProtocolError):
            continue
    return out

"""Every NATS subject, stream, consumer and bucket name llmbus uses, in one place.

| what | kind | name |
|---|---|---|
| requests (gateway -> router) | JetStream work queue `LLMBUS_REQUESTS` | `llmbus.req.<model>` |
| prefill work, per lane | JetStream work queues `LLMBUS_PREFILL_SHORT` / `_LONG` | `llmbus.prefill.<lane>.<model>` |
| urgent prefill work (priority below 0), per lane | the lane's work queue | `llmbus.prefill.<lane>.<model>.urgent` |
| urgent whole requests for the decode pool, per lane | the lane's work queue | `llmbus.prefill.<lane>.<model>.whole.urgent` |
| prefill work for one worker (its cached prefix), per lane | the lane's work queue | `llmbus.prefill.<lane>.<model>.at.<instance_id>` |
| whole requests for the decode pool (short prompts), per lane | the lane's work queue | `llmbus.prefill.<lane>.<model>.whole` |
| handoffs (prefill -> decode) | JetStream work queue `LLMBUS_DECODE` | `llmbus.decode.<model>` |
| urgent handoffs (priority below 0) | JetStream work queue `LLMBUS_DECODE` | `llmbus.decode.<model>.urgent` |
| tokens (worker -> gateway) | core NATS | `llmbus.tok.<request_id>` |
| token batches (worker -> one gateway) | core NATS | `llmbus.toks.<instance_id>` |
| aborts (anyone -> workers) | core NATS | `llmbus.abort.<request_id>` |
| kvpool ops | core request/reply, queue group `kvpool` | `llmbus.kvpool.<op>` |
| KV events (workers -> kvpool's index) | core NATS | `llmbus.kvevents` |
| a prefill worker's load (-> routers) | core NATS | `llmbus.load.<instance_id>` |
| tenants' use of their limits (gateway -> gateways) | core NATS | `llmbus.limits` |
| instance registry | KV bucket `llmbus_registry` | key `<role>.<instance_id>` |
| tenants' rate-limit buckets | KV bucket `llmbus_limits` | key `t<tenant name in hex>.<bucket>` |
| a service's metrics | core request/reply | `llmbus.metrics.<instance_id>` |

Model names become one subject token through :func:`model_token` (``.``, ``*``, ``>``, ``/``, ``\\``
and whitespace map to ``_``); the real name always travels in the message body.
"""

from __future__ import annotations

import re

from llmbus.protocol.messages import LANES, check_id, urgent

PREFIX = "llmbus"

REQUESTS_STREAM = "LLMBUS_REQUESTS"
REQUESTS_SUBJECTS = f"{PREFIX}.req.>"
ROUTER_CONSUMER = "router"

PREFILL_STREAMS = {"short": "LLMBUS_PREFILL_SHORT", "long": "LLMBUS_PREFILL_LONG"}
DECODE_STREAM = "LLMBUS_DECODE"
DECODE_SUBJECTS = f"{PREFIX}.decode.>"

TOKENS_WILDCARD = f"{PREFIX}.tok.*"
TOKEN_BATCHES_WILDCARD = f"{PREFIX}.toks.*"
ABORTS_WILDCARD = f"{PREFIX}.abort.*"

KVPOOL_OPS = ("allocate", "renew", "release", "write", "read", "stats", "lookup", "fetch", "store")
KVPOOL_QUEUE = "kvpool"
KVPOOL_WILDCARD = f"{PREFIX}.kvpool.*"
KVPOOL_EVENTS = f"{PREFIX}.kvevents"  # workers' KVEvents (core publish, no reply; every kvpool listens)

LOADS_WILDCARD = f"{PREFIX}.load.*"
LIMITS = f"{PREFIX}.limits"  # gateways' LimitUsage (core publish; every gateway listens)

REGISTRY_BUCKET = "llmbus_registry"
LIMITS_BUCKET = "llmbus_limits"
RESPONSES_BUCKET = "llmbus_responses"  # stored Responses API answers, key = the response id

ERROR_HEADER = "Llmbus-Error"  # set on a request/reply answer whose body is an ErrorReply
MSG_ID_HEADER = "Nats-Msg-Id"

_UNSAFE = re.compile(r"[\s.*>/\\]")


def model_token(model: str) -> str:
    """A model name as one subject token / consumer-name part."""
    if not model:
        raise ValueError("model name must not be empty")
    return _UNSAFE.sub("_", model)


def check_model_names(names) -> None:
    """Served names: each non-empty without whitespace, and no two alike as subject tokens ("a.b"
    and "a_b" would share one work queue, so either model's workers could take the other's
    requests)."""
    seen: dict[str, str] = {}
    for name in names:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"model name must be a non-empty string without spaces, got {name!r}")
        token = model_token(name)
        if token in seen:
            other = seen[token]
            raise ValueError(f"model names must be unique, got {name!r} twice" if other == name else
                             f"model names {other!r} and {name!r} share the subject token {token!r}: rename one")
        seen[token] = name


def _lane(lane: str) -> str:
    if lane not in LANES:
        raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
    return lane


def request_subject(model: str) -> str:
    """Where the gateway publishes a GenerateRequest (JetStream, Nats-Msg-Id = request_id)."""
    return f"{PREFIX}.req.{model_token(model)}"


def prefill_subjects(lane: str) -> str:
    return f"{PREFIX}.prefill.{_lane(lane)}.>"


def prefill_subject(lane: str, model: str) -> str:
    """Where the router forwards a request for the prefill pool of ``model`` in ``lane``."""
    return f"{PREFIX}.prefill.{_lane(lane)}.{model_token(model)}"


def prefill_consumer(lane: str, model: str) -> str:
    """Durable pull consumer shared by every prefill replica of ``model`` on ``lane``."""
    return f"prefill_{_lane(lane)}_{model_token(model)}"


def urgent_subject(lane: str, model: str) -> str:
    """Where the router forwards an urgent request (``GenerateRequest.priority`` below 0) for the
    prefill pool of ``model`` in ``lane``: its own queue, which workers empty before the lane's."""
    return f"{prefill_subject(lane, model)}.urgent"


def urgent_consumer(model: str) -> str:
    """Durable pull consumer shared by every prefill replica of ``model`` for urgent work, one in
    each lane's stream; also the decode replicas' for urgent handoffs, in the decode stream."""
    return f"urgent_{model_token(model)}"


def lane_subject(lane: str, model: str, priority: int = 0) -> str:
    """A request's queue in ``lane``: the urgent one or the shared one, by its priority."""
    return urgent_subject(lane, model) if urgent(priority) else prefill_subject(lane, model)


def direct_subject(lane: str, model: str, instance_id: str) -> str:
    """Where the router sends a request to one prefill worker, the one whose cache holds most of
    its prompt (JetStream, Nats-Msg-Id = request_id). In the lane's stream, as whole requests are:
    whichever a request was sent to, its id dedups a second forward of it to any other."""
    return f"{prefill_subject(lane, model)}.at.{check_id('instance_id', instance_id)}"


def direct_subjects(lane: str, instance_id: str = "*") -> str:
    """Every direct subject of a lane (of one worker, any model): a direct consumer's filter."""
    return f"{PREFIX}.prefill.{_lane(lane)}.*.at.{instance_id if instance_id == '*' else check_id('instance_id', instance_id)}"


def direct_consumer(instance_id: str) -> str:
    """Durable pull consumer of one prefill worker's direct subjects in a lane's stream (the worker
    makes it; the router moves what is left in it back to the lane when the worker goes away, then
    deletes it)."""
    return f"direct_{check_id('instance_id', instance_id)}"


def whole_subject(lane: str, model: str) -> str:
    """Where the router sends a short prompt for the decode pool of ``model`` to prefill and decode
    itself, skipping the handoff (JetStream, Nats-Msg-Id = request_id; the lane's stream)."""
    return f"{prefill_subject(lane, model)}.whole"


def urgent_whole_subject(lane: str, model: str) -> str:
    """Where the router sends an urgent short prompt for the decode pool of ``model`` to run whole."""
    return f"{whole_subject(lane, model)}.urgent"


def urgent_whole_consumer(model: str) -> str:
    """Durable pull consumer shared by every decode replica of ``model`` for urgent whole
    requests, one in each lane's stream. NOTE: no other consumer's name begins as this one does
    (a model named ``whole_x`` must not share ``urgent_x``'s)."""
    return f"urgentwhole_{model_token(model)}"


def whole_lane_subject(lane: str, model: str, priority: int = 0) -> str:
    """A whole request's queue in ``lane``: the urgent one or the shared one, by its priority."""
    return urgent_whole_subject(lane, model) if urgent(priority) else whole_subject(lane, model)


def whole_consumer(model: str) -> str:
    """Durable pull consumer shared by every decode replica of ``model`` for whole requests, one
    in each lane's stream."""
    return f"whole_{model_token(model)}"


def decode_subject(model: str) -> str:
    """Where prefill publishes a Handoff (JetStream, Nats-Msg-Id = request_id)."""
    return f"{PREFIX}.decode.{model_token(model)}"


def urgent_decode_subject(model: str) -> str:
    """Where prefill publishes the Handoff of an urgent request (the decode pool's urgent queue)."""
    return f"{decode_subject(model)}.urgent"


def handoff_subject(model: str, priority: int = 0) -> str:
    return urgent_decode_subject(model) if urgent(priority) else decode_subject(model)


def decode_consumer(model: str) -> str:
    """Durable pull consumer shared by every decode replica of ``model``."""
    return f"decode_{model_token(model)}"


def tokens(request_id: str) -> str:
    """Core subject carrying a request's TokenEvents."""
    return f"{PREFIX}.tok.{check_id('request_id', request_id)}"


def metrics(instance_id: str) -> str:
    """Core request/reply subject where an instance answers a MetricsRequest with its MetricsReply."""
    return f"{PREFIX}.metrics.{check_id('instance_id', instance_id)}"


def load(instance_id: str) -> str:
    """Core subject of one prefill worker's WorkerLoad reports."""
    return f"{PREFIX}.load.{check_id('instance_id', instance_id)}"


def token_batches(instance_id: str) -> str:
    """Core subject of one gateway instance's TokenEvents, batched: a request whose
    ``token_subject`` is this gets its events inside ``TokenEvents`` messages, one message per
    publisher per engine step for all of that gateway's requests."""
    return f"{PREFIX}.toks.{check_id('instance_id', instance_id)}"


def is_token_batches(subject: str) -> bool:
    return subject.startswith(f"{PREFIX}.toks.")


def abort(request_id: str) -> str:
    """Core subject carrying a request's Abort."""
    return f"{PREFIX}.abort.{check_id('request_id', request_id)}"


def kvpool(op: str) -> str:
    """Request/reply subject of a kvpool operation."""
    if op not in KVPOOL_OPS:
        raise ValueError(f"kvpool op must be one of {KVPOOL_OPS}, got {op!r}")
    return f"{PREFIX}.kvpool.{op}"


def registry_key(role: str, instance_id: str) -> str:
    return f"{role}.{check_id('instance_id', instance_id)}"


def limits_key(tenant: str, bucket: str) -> str:
    """The key of one of a tenant's rate-limit buckets in ``llmbus_limits`` (the tenant's name in
    hex: KV keys allow few characters)."""
    return f"t{tenant.encode().hex()}.{bucket}"

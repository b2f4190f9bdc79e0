"""Every record that crosses the bus, defined once. Encode/decode them with ``llmbus.protocol.codec``.

Rules (see docs/architecture.md for who sends what on which subject):
- Token ids are lists of ints; tensors never travel in these records (KV bytes go through kvpool).
- Fields are documented where they are declared. New fields are APPENDED, always with a default.
- Records are frozen; ``__post_init__`` checks invariants with clear ``ValueError``s.
- This module imports neither torch nor nats, so the gateway and router stay light.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
FINISH_REASONS = (None, "stop", "length", "abort", "error")
LANES = ("short", "long")
ROLES = ("gateway", "router", "prefill", "decode", "kvpool")


def check_id(kind: str, value: str) -> str:
    """Ids become NATS subject tokens: 1-128 of ``[A-Za-z0-9_-]`` (no dots, wildcards or spaces)."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(f"{kind} must be 1-128 characters of [A-Za-z0-9_-], got {value!r}")
    return value


_WHITESPACE_RE = re.compile(r"\s")


def check_subject(kind: str, value: str) -> str:
    """A subject to publish to: 1-256 characters without whitespace, of dot-separated tokens none of
    which is empty or a wildcard (``*``, ``>``)."""
    if (not isinstance(value, str) or not 0 < len(value) <= 256 or _WHITESPACE_RE.search(value)
            or any(token in ("", "*", ">") for token in value.split("."))):
        raise ValueError(f"{kind} must be a NATS subject without wildcards, got {value!r}")
    return value


def check_token_subject(subject: str, request_id: str) -> str:
    """Workers publish a request's events where it asks: not on a system subject (``$JS.API...``,
    ``$JS.ACK...``) nor on llmbus's own other than its own ``llmbus.tok.<request_id>`` or a
    gateway's ``llmbus.toks.<id>`` (not an abort or kvpool subject, nor another request's), so a
    request cannot make a service speak where it must not."""
    check_subject("token_subject", subject)
    kind, _, rest = subject.partition(".")[2].partition(".")
    ours = (kind == "tok" and rest == request_id) or (kind == "toks" and rest and "." not in rest)
    if subject.startswith("$") or (subject.startswith("llmbus.") and not ours):
        raise ValueError(f"token_subject must be llmbus.tok.{request_id}, llmbus.toks.<id> or outside llmbus.* "
                         f"and $*, got {subject!r}")
    return subject


MAX_ERROR_CHARS = 1000  # error texts past this are cut: they may quote a hostile message's fields


def brief(text: str) -> str:
    """``text`` cut to MAX_ERROR_CHARS, saying how much was left off: an error that quotes its input
    can then never outgrow the payload limit (which would close the publisher's connection) or
    flood a log."""
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return f"{text[:MAX_ERROR_CHARS]}... ({len(text) - MAX_ERROR_CHARS} more characters)"


def _brief(record, field_name: str) -> None:
    text = getattr(record, field_name)
    if isinstance(text, str):
        object.__setattr__(record, field_name, brief(text))


MAX_TOKEN_ID = 2**31 - 1  # far past any vocabulary; token ids are hashed as 32-bit words


def _check_tokens(kind: str, ids: list[int]) -> None:
    for t in ids:
        if not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"{kind} must be token ids in [0, 2**31), got {t}")


# ---------------------------------------------------------------- requests and tokens


@dataclass(frozen=True)
class SamplingSpec:
    """The wire form of ``llmbus.engine.sampling_params.SamplingParams``: same names, same defaults."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the sampled token's logprob plus top-n
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias), ids unique
    prompt_logprobs: int | None = None  # None: none; n >= 0: each prompt token's logprob plus top-n
    guide: str = ""  # "": free text; else a guide spec (llmbus.guide.grammar.guide_spec): JSON output

    def to_params(self):
        """Build (and so validate) the engine's SamplingParams. Workers call this; it raises ValueError."""
        from llmbus.engine.sampling_params import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos, logprobs=self.logprobs, logit_bias=tuple(self.logit_bias),
            prompt_logprobs=self.prompt_logprobs, guide=self.guide,
        )  # fmt: skip


PRIORITY_LIMIT = 1_000_000  # |GenerateRequest.priority| at most
URGENT_BELOW = 0  # a priority below it is urgent: its own queues on the bus (llmbus.bus.subjects)


def urgent(priority: int) -> bool:
    return priority < URGENT_BELOW


def check_priority(where: str, value) -> None:
    """ValueError unless ``value`` is an integer priority within ``PRIORITY_LIMIT``."""
    if type(value) is not int or abs(value) > PRIORITY_LIMIT:
        raise ValueError(f"{where} must be an integer in [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got {value!r}")


@dataclass(frozen=True)
class GenerateRequest:
    """Gateway -> router (stream LLMBUS_REQUESTS) and router -> prefill (lane streams)."""

    request_id: str  # unique; also the JetStream Nats-Msg-Id and the token/abort subject suffix
    model: str  # model name as served (GET /v1/models)
    prompt_token_ids: list[int]  # the rendered, tokenized prompt
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    tenant: str = ""  # tenant name; "" = anonymous (a gateway without --api-keys-file sends "")
    # prefix-hash salt: requests with different salts never share a cached block. Set by whatever
    # authenticates tenants, never taken from a client's request (the gateway: the key's tenant)
    cache_salt: str = ""
    # smaller runs first (vLLM's sense): below URGENT_BELOW it takes its lane's urgent queue, and in a
    # worker it goes ahead of every request of a larger one (admitted first, preempted last)
    priority: int = 0
    deadline: float | None = None  # unix seconds; the router fails a request that reaches it later
    created: float = 0.0  # unix seconds when the gateway accepted it
    token_subject: str = ""  # where its events go: "" = subjects.tokens(request_id); a gateway's subjects.token_batches(...)
    kv_format: str = "model"  # carried, not read: each worker runs its own --kv-format
    lane: str = ""  # set by the router: "short" | "long"; "" before routing
    # W3C trace context of the gateway's span for the request (llmbus.tracing); "" when not traced
    traceparent: str = ""
    # a request taken over from a worker that stopped before its end: the output tokens its client
    # already has (the next worker computes them again as context and samples on from them), and
    # the seq of the next TokenEvent
    resume_token_ids: list[int] = field(default_factory=list)
    resume_seq: int = 0

    def __post_init__(self) -> None:
        check_id("request_id", self.request_id)
        if self.traceparent and not TRACEPARENT.fullmatch(self.traceparent):
            raise ValueError(f"traceparent must be a W3C trace context (00-<32 hex>-<16 hex>-<2 hex>), "
                             f"got {self.traceparent[:80]!r}")
        if not self.model:
            raise ValueError("model must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        _check_tokens("prompt_token_ids", self.prompt_token_ids)
        if self.lane not in ("",) + LANES:
            raise ValueError(f"lane must be one of {LANES} or empty, got {self.lane!r}")
        check_priority("priority", self.priority)
        if self.token_subject:
            check_token_subject(self.token_subject, self.request_id)
        _check_tokens("resume_token_ids", self.resume_token_ids)
        if not 0 <= self.resume_seq <= MAX_TOKEN_ID:
            raise ValueError(f"resume_seq must be in [0, 2**31), got {self.resume_seq}")
        if self.resume_token_ids and not self.resume_seq:
            raise ValueError("resume_token_ids were sent in events: resume_seq, the next event's seq, must be >= 1")
        if self.resume_token_ids and len(self.resume_token_ids) >= self.sampling.max_tokens:
            raise ValueError(f"resume_token_ids holds {len(self.resume_token_ids)} tokens: the request's max_tokens "
                             f"({self.sampling.max_tokens}) left none to generate")  # fmt: skip


@dataclass(frozen=True)
class LogprobEntry:
    """Logprob of one sampled token and the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # [(token id, logprob)], most likely first


INVALID_REQUEST = "invalid_request"  # TokenEvent.error_code: the request's own fault


@dataclass(frozen=True)
class TokenEvent:
    """Worker -> gateway, one per engine step per request: alone on ``llmbus.tok.<request_id>``, or
    inside a ``TokenEvents`` batch on ``llmbus.toks.<gateway>`` (whichever ``token_subject`` named).

    ``seq`` counts 0, 1, 2, ... per request across prefill and decode so the gateway can spot gaps.
    The last event of a request has a non-null ``finish_reason``; usage counts are exact and cumulative.
    """

    request_id: str
    seq: int
    token_ids: list[int] = field(default_factory=list)  # new tokens in this event (may be empty at the end)
    logprobs: list[LogprobEntry] | None = None  # one entry per token in token_ids, when requested
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error" or "abort" (<= MAX_ERROR_CHARS)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0  # output tokens so far, including these
    worker: str = ""  # instance id of the sender
    # with finish_reason "error": "invalid_request" when the request itself is at fault (a prompt
    # too long for the worker's context or cache, bad sampling values): the gateway answers 400;
    # "" for anything else (a server error). Readers treat codes they do not know as "".
    error_code: str = ""
    # sampling.prompt_logprobs: on the event with the first token, an entry per prompt token after
    # the first (entry i scores prompt token i + 1)
    prompt_logprobs: list[LogprobEntry] | None = None

    def __post_init__(self) -> None:
        check_id("request_id", self.request_id)
        if len(self.error_code) > 64:
            raise ValueError(f"error_code is {len(self.error_code)} characters, at most 64")
        if self.seq < 0:
            raise ValueError(f"seq must be >= 0, got {self.seq}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {len(self.token_ids)} tokens")
        _brief(self, "error")

    @classmethod
    def failure(cls, request_id: str, message: str, *, seq: int = 0, worker: str = "", prompt_tokens: int = 0,
                code: str = ""):
        """The final event of a request that failed before (or while) producing tokens; ``code``:
        its ``error_code``."""
        return cls(request_id, seq, finish_reason="error", error=message, worker=worker, prompt_tokens=prompt_tokens,
                   error_code=code)


@dataclass(frozen=True)
class TokenEvents:
    """Worker (or router) -> one gateway on core subject ``llmbus.toks.<gateway instance>``: the
    TokenEvents of that gateway's requests that one publisher had ready at once (normally one engine
    step's), in publish order. Each event keeps its own ``seq``; a request's events all travel on
    the one subject its GenerateRequest named."""

    events: list[TokenEvent] = field(default_factory=list)


@dataclass(frozen=True)
class Abort:
    """Anyone -> workers on core subject ``llmbus.abort.<request_id>``: stop and free the request."""

    request_id: str
    reason: str = ""  # "client_disconnected" | "stop_string" | "token_stream_failed" | "gateway_error" |
    # "submit_failed" | free text

    def __post_init__(self) -> None:
        check_id("request_id", self.request_id)


# ---------------------------------------------------------------- kvpool (request/reply)


@dataclass(frozen=True)
class Lease:
    """kvpool's grant of ``blocks`` (CPU-tier block handles) until ``expires_at``.

    Block handle ``b`` lives at bytes ``[b * block_bytes, (b + 1) * block_bytes)`` of the POSIX
    shared-memory segment ``shm_name`` (same-host workers map it directly). Renew before expiry:
    after ``expires_at`` kvpool may reclaim the blocks and hand them to someone else.
    """

    lease_id: str
    blocks: list[int]
    block_bytes: int
    shm_name: str
    ttl_s: float
    expires_at: float  # unix seconds
    pool_id: str = ""  # kvpool instance that granted it

    @property
    def num_bytes(self) -> int:
        return len(self.blocks) * self.block_bytes


@dataclass(frozen=True)
class AllocateRequest:
    """-> ``llmbus.kvpool.allocate``; reply: Lease (or ErrorReply)."""

    num_blocks: int
    ttl_s: float = 60.0
    owner: str = ""  # instance id of the requester (for stats and debugging)
    request_id: str = ""  # the generation request the blocks are for, if any

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")


@dataclass(frozen=True)
class RenewRequest:
    """-> ``llmbus.kvpool.renew``; reply: the Lease with a new expiry (or ErrorReply)."""

    lease_id: str
    ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")


@dataclass(frozen=True)
class ReleaseRequest:
    """-> ``llmbus.kvpool.release``; reply: ReleaseReply. Idempotent."""

    lease_id: str


@dataclass(frozen=True)
class ReleaseReply:
    lease_id: str
    released: bool  # False: unknown, already released or already reclaimed (not an error)


@dataclass(frozen=True)
class WriteRequest:
    """-> ``llmbus.kvpool.write``: bytes at ``offset`` of the lease's blocks, concatenated in lease
    order. One chunk must fit the server's max_payload; clients split. Reply: WriteReply."""

    lease_id: str
    offset: int
    data: bytes

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")


@dataclass(frozen=True)
class WriteReply:
    lease_id: str
    written: int


@dataclass(frozen=True)
class ReadRequest:
    """-> ``llmbus.kvpool.read``: ``length`` bytes at ``offset`` of the lease's blocks. Reply: ReadReply."""

    lease_id: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"offset and length must be >= 0, got {self.offset}, {self.length}")


@dataclass(frozen=True)
class ReadReply:
    lease_id: str
    offset: int
    data: bytes


@dataclass(frozen=True)
class StatsRequest:
    """-> ``llmbus.kvpool.stats``; reply: PoolStats."""


@dataclass(frozen=True)
class PoolStats:
    pool_id: str
    capacity_blocks: int
    free_blocks: int
    leased_blocks: int  # blocks held by live leases; 0 when nothing leaked
    active_leases: int
    block_bytes: int
    shm_name: str
    reclaimed_leases: int = 0  # leases reclaimed on expiry since start
    tiers: list[TierStats] = field(default_factory=list)  # the prefix cache's tiers (cpu, ssd); [] when off
    prefix_blocks: int = 0  # blocks the prefix index knows of (any location)
    max_ttl_s: float = 0.0  # the longest lease TTL it grants (--max-ttl); 0 from a kvpool that does not say


@dataclass(frozen=True)
class ErrorReply:
    """Any kvpool op's reply on failure (flagged by the ``Llmbus-Error`` header)."""

    error: str  # at most MAX_ERROR_CHARS, cut with a note of how much was left off
    code: str = "bad_request"  # "bad_request" | "exhausted" | "unknown_lease" | "internal"

    def __post_init__(self) -> None:
        _brief(self, "error")


# ---------------------------------------------------------------- handoff and registry


@dataclass(frozen=True)
class Handoff:
    """Prefill -> decode (stream LLMBUS_DECODE, ``llmbus.decode.<model>``), Nats-Msg-Id = request_id.

    The sequence's KV sits in kvpool under ``lease``: lease block i holds the sequence's block i,
    the engine's ``read_blocks`` row i (``[num_layers, layer_block_bytes]`` uint8, every layer's
    bytes in the cache's own ``kv_format``), padded with zeros to ``lease.block_bytes``. With
    ``state["tail_tokens"]`` (int4, int4r: a filling block), the rows past the sequence's blocks
    hold that block's exact keys and values (``llmbus.engine.engine.pack_tail``, in
    ``state["tail_dtype"]``). ``kv_shape`` is ``[n_rows, num_layers, layer_block_bytes]``, every
    row counted. The decode worker releases the lease once the rows are in its own cache.
    """

    request: GenerateRequest
    output_token_ids: list[int]  # sampled so far (the first token); already published by prefill
    num_computed_tokens: int  # tokens with KV in the handed-off blocks
    lease: Lease
    state: dict[str, Any]  # Engine.export_sequence() state, msgpack-able
    kv_shape: list[int]  # [n_rows, num_layers, layer_block_bytes]: the blocks, then any exact tail rows
    kv_format: str  # "model" | "int8" | "int4" | "int4r": the bytes' format (must match the decode engine's)
    prefill_worker: str = ""
    next_seq: int = 1  # seq of the next TokenEvent; prefill published 0 .. next_seq-1
    num_cached_tokens: int = 0  # prompt tokens prefill served from its prefix cache

    def __post_init__(self) -> None:
        if len(self.kv_shape) != 3:
            raise ValueError(f"kv_shape must be [n_blocks, num_layers, layer_block_bytes], got {self.kv_shape}")
        if self.kv_shape[0] != len(self.lease.blocks):
            raise ValueError(f"kv_shape has {self.kv_shape[0]} blocks but the lease has {len(self.lease.blocks)}")
        if self.kv_shape[1] * self.kv_shape[2] > self.lease.block_bytes:
            raise ValueError(f"a block of {self.kv_shape[1] * self.kv_shape[2]} bytes does not fit the lease's "
                             f"{self.lease.block_bytes}-byte blocks")
        if not 1 <= self.next_seq <= MAX_TOKEN_ID:
            raise ValueError(f"next_seq must be in [1, 2**31) (prefill published seq 0), got {self.next_seq}")
        if self.state.get("request_id") != self.request.request_id:
            raise ValueError(f"state is of request {self.state.get('request_id')!r}, not {self.request.request_id!r}")
        if (self.state.get("prompt_token_ids") != self.request.prompt_token_ids
                or self.state.get("output_token_ids") != self.output_token_ids):
            raise ValueError("state's prompt and output tokens are not the request's and the handoff's")


@dataclass(frozen=True)
class InstanceInfo:
    """A service's heartbeat in the KV bucket ``llmbus_registry`` under key ``<role>.<instance_id>``."""

    instance_id: str
    role: str  # one of ROLES
    models: list[str] = field(default_factory=list)
    free_blocks: int = 0  # free KV blocks (workers, kvpool)
    queue_depth: int = 0  # requests waiting + running
    host: str = ""
    updated_at: float = 0.0  # unix seconds
    pid: int = 0
    total_blocks: int = 0  # size of the worker's KV pool; free_blocks == total_blocks when nothing is held
    # a prefill worker's prefix-cache identity, for routing by cached prefix: its block hashes are
    # ``chain_hashes(root_hash(prefix_model, kv_format, salt), tokens, block_size)``; 0: no prefix cache.
    # prefix_model is the checkpoint's identity (``LoadedModel.model_id``), not the served name
    block_size: int = 0
    kv_format: str = ""
    prefix_model: str = ""

    def __post_init__(self) -> None:
        check_id("instance_id", self.instance_id)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


# ---------------------------------------------------------------- kvpool prefix cache (issue 5)


@dataclass(frozen=True)
class TierStats:
    """One kvpool tier of the prefix cache, in PoolStats.tiers. Counters are blocks since start."""

    tier: str  # "cpu" | "ssd"
    kv_format: str  # the tier's storage format
    bytes_used: int
    bytes_capacity: int
    blocks: int
    lookups: int = 0  # blocks asked of this tier by fetches
    hits: int = 0  # blocks served from this tier (hit rate = hits / lookups)
    evictions: int = 0
    demotions: int = 0  # blocks moved down to the next tier
    promotions: int = 0  # blocks moved up into this tier


@dataclass(frozen=True)
class BlockStoredEvent:
    """Worker -> ``llmbus.kvevents`` (core, no reply): blocks now in ``worker``'s tier 0.
    The shape vLLM and SGLang use: hashes chain on from ``parent_hash``."""

    block_hashes: list[bytes]
    parent_hash: bytes | None = None
    token_count: int = 0  # tokens per block
    tier: str = "t0"
    worker: str = ""


@dataclass(frozen=True)
class BlockRemovedEvent:
    block_hashes: list[bytes]
    tier: str = "t0"
    worker: str = ""


@dataclass(frozen=True)
class WorkerLoad:
    """Prefill worker -> ``llmbus.load.<instance_id>`` (core, no reply), as soon as it changes: the
    requests it holds, fresher than its registry heartbeat, for the routers' instance choice."""

    instance_id: str
    requests: int = 0  # jobs held: waiting, prefilling or (colocated) decoding
    room: int = 0  # jobs it would pull now (batch slots, blocks and prompt-token budget allowing)
    # ids of requests sent to it by name (its direct subject) it took since its last report: a
    # router stops counting them as on their way (they are in ``requests`` now)
    taken: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_id("instance_id", self.instance_id)


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's part of a LimitUsage."""

    tenant: str
    requests: int = 0  # requests admitted since the gateway's last report
    tokens: int = 0  # tokens charged since then: reservations at admission, less what settling gave back
    in_flight: int = 0  # its requests in flight at that gateway now


@dataclass(frozen=True)
class LimitUsage:
    """Gateway -> ``llmbus.limits`` (core, no reply), every 0.1 s while its tenants' use changes
    and every second while they have requests in flight: what they spent there, which every other
    gateway charges to its own buckets, so a tenant's limits hold across the fleet."""

    gateway: str
    tenants: list[TenantUsage] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_id("gateway", self.gateway)


@dataclass(frozen=True)
class TenantBuckets:
    """A tenant's rate-limit bucket as a gateway saved it, in KV bucket ``llmbus_limits`` (key
    ``t<the tenant's name in hex>.<bucket>``), so a gateway that starts takes up where the fleet was."""

    tenant: str
    levels: dict[str, float] = field(default_factory=dict)  # bucket ("requests", "tokens-day", ...) -> units left
    saved_at: float = 0.0  # unix seconds


@dataclass(frozen=True)
class KVEvents:
    """A batch of a worker's KV events, in order."""

    worker: str
    stored: list[BlockStoredEvent] = field(default_factory=list)
    removed: list[BlockRemovedEvent] = field(default_factory=list)


@dataclass(frozen=True)
class LookupRequest:
    """-> ``llmbus.kvpool.lookup``: the longest cached prefix of a hash chain per location.
    ``pin_ttl_s`` > 0 pins the kvpool-tier prefix found (release it with ReleaseRequest(pin_id))."""

    block_hashes: list[bytes]
    pin_ttl_s: float = 0.0


@dataclass(frozen=True)
class PrefixHit:
    tier: str  # "t0" | "cpu" | "ssd"
    worker: str  # tier 0's worker; "" for kvpool's tiers
    num_blocks: int  # blocks from the start of the chain held there


@dataclass(frozen=True)
class LookupReply:
    hits: list[PrefixHit] = field(default_factory=list)
    pool_blocks: int = 0  # blocks from the start servable by kvpool's tiers together (cpu and ssd mixed)
    pin_id: str = ""


@dataclass(frozen=True)
class FetchRequest:
    """-> ``llmbus.kvpool.fetch``: copy the longest run of ``block_hashes[start:]`` held by kvpool's
    tiers into a fresh lease, in the tier-0 format ``kv_format``. Reply: FetchReply."""

    block_hashes: list[bytes]
    start: int = 0  # blocks the worker already has (its own tier 0)
    kv_format: str = "model"
    ttl_s: float = 60.0
    owner: str = ""
    request_id: str = ""
    block_bytes: int = 0  # the worker's tier-0 block size in bytes (0: unchecked); must match kvpool's

    def __post_init__(self) -> None:
        if not 0 <= self.start <= len(self.block_hashes):
            raise ValueError(f"start must be in [0, {len(self.block_hashes)}], got {self.start}")


@dataclass(frozen=True)
class FetchReply:
    num_blocks: int  # blocks in the lease: hashes[start : start + num_blocks]
    lease: Lease | None = None  # None when nothing was found
    from_cpu: int = 0
    from_ssd: int = 0


@dataclass(frozen=True)
class StoreRequest:
    """-> ``llmbus.kvpool.store``: cache the blocks ``lease_index, lease_index + 1, ...`` of a live
    lease (tier-0 bytes) under ``block_hashes``, a chain continuing ``parent_hash``. Reply: StoreReply."""

    lease_id: str
    block_hashes: list[bytes]
    parent_hash: bytes | None = None
    lease_index: int = 0
    kv_format: str = "model"
    worker: str = ""
    block_bytes: int = 0  # the worker's tier-0 block size in bytes (0: unchecked); must match kvpool's


@dataclass(frozen=True)
class StoreReply:
    stored: int  # blocks newly cached
    present: int  # blocks kvpool already held


# ---------------------------------------------------------------- metrics


METRIC_KINDS = ("counter", "gauge", "histogram")


@dataclass(frozen=True)
class MetricSample:
    """One series of a MetricFamily: its label values (in the family's label order) and figures."""

    labels: list[str]
    value: float = 0.0  # counter, gauge
    counts: list[int] = field(default_factory=list)  # histogram: observations <= each bound, cumulative
    sum: float = 0.0  # histogram: of all observations
    count: int = 0  # histogram: observations in all


@dataclass(frozen=True)
class MetricFamily:
    """A named metric with Prometheus' meaning (``# HELP``, ``# TYPE``): ``kind`` counter, gauge
    or histogram; ``bounds`` a histogram's bucket upper bounds, ascending (+Inf implied)."""

    name: str
    help: str
    kind: str
    labels: list[str] = field(default_factory=list)
    bounds: list[float] = field(default_factory=list)
    samples: list[MetricSample] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in METRIC_KINDS:
            raise ValueError(f"kind must be one of {METRIC_KINDS}, got {self.kind!r}")
        if not _METRIC_NAME.fullmatch(self.name) or not all(_METRIC_NAME.fullmatch(n) for n in self.labels):
            raise ValueError(f"metric {self.name!r}: names must match {_METRIC_NAME.pattern}")
        for s in self.samples:
            if len(s.labels) != len(self.labels):
                raise ValueError(f"metric {self.name!r}: a sample has {len(s.labels)} label values for "
                                 f"{len(self.labels)} labels")  # fmt: skip
            if self.kind == "histogram" and len(s.counts) != len(self.bounds):
                raise ValueError(f"metric {self.name!r}: a sample has {len(s.counts)} bucket counts for "
                                 f"{len(self.bounds)} bounds")  # fmt: skip


_METRIC_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


@dataclass(frozen=True)
class MetricsRequest:
    """-> ``llmbus.metrics.<instance_id>`` (core request/reply, every service); reply: MetricsReply."""


@dataclass(frozen=True)
class MetricsReply:
    """A service's own metrics as of the request: counters since it started, gauges now."""

    instance_id: str
    role: str
    families: list[MetricFamily] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_id("instance_id", self.instance_id)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

"""Wire messages (typed records) and the one MessagePack codec every service uses."""

from llmbus.protocol.codec import ProtocolError, decode, encode
from llmbus.protocol.messages import (
    FINISH_REASONS,
    LANES,
    ROLES,
    Abort,
    AllocateRequest,
    ErrorReply,
    GenerateRequest,
    Handoff,
    InstanceInfo,
    Lease,
    LogprobEntry,
    PoolStats,
    ReadReply,
    ReadRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewRequest,
    SamplingSpec,
    StatsRequest,
    TokenEvent,
    TokenEvents,
    WriteReply,
    WriteRequest,
    check_id,
    check_subject,
    check_token_subject,
)
from llmbus.protocol.messages import (  # noqa: E402 - the prefix-cache records (issue 5)
    BlockRemovedEvent,
    BlockStoredEvent,
    FetchReply,
    FetchRequest,
    KVEvents,
    LookupReply,
    LookupRequest,
    PrefixHit,
    StoreReply,
    StoreRequest,
    TierStats,
)
from llmbus.protocol.messages import MetricFamily, MetricSample, MetricsReply, MetricsRequest  # noqa: E402
from llmbus.protocol.messages import LimitUsage, TenantBuckets, TenantUsage, WorkerLoad  # noqa: E402

__all__ = [
    "FINISH_REASONS", "LANES", "ROLES", "Abort", "AllocateRequest", "ErrorReply", "GenerateRequest",
    "Handoff", "InstanceInfo", "Lease", "LogprobEntry", "PoolStats", "ProtocolError", "ReadReply",
    "ReadRequest", "ReleaseReply", "ReleaseRequest", "RenewRequest", "SamplingSpec", "StatsRequest",
    "TokenEvent", "TokenEvents", "WriteReply", "WriteRequest", "check_id", "check_subject", "check_token_subject",
    "decode", "encode",
    "BlockRemovedEvent", "BlockStoredEvent", "FetchReply", "FetchRequest", "KVEvents", "LookupReply",
    "LookupRequest", "PrefixHit", "StoreReply", "StoreRequest", "TierStats",
    "MetricFamily", "MetricSample", "MetricsReply", "MetricsRequest", "WorkerLoad",
    "LimitUsage", "TenantBuckets", "TenantUsage",
]  # fmt: skip

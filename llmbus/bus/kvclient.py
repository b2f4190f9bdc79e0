"""The worker-side kvpool client: leases, and block bytes via shared memory or over the bus.

``transport``: "auto" attaches the lease's shared-memory segment when it exists on this host and
falls back to chunked ``read``/``write`` requests over NATS otherwise; "shm" and "bus" force one.
Bytes are addressed by lease block index: lease block ``i`` is bytes ``[i*block_bytes,
(i+1)*block_bytes)`` of the lease. NOTE: direct shm access is only safe while the lease is live;
the client refuses it once ``expires_at`` has passed (kvpool may have handed the blocks on).
"""

from __future__ import annotations

import contextlib
import time

from nats.aio.client import Client

from llmbus.bus import shm, subjects
from llmbus.protocol import (
    AllocateRequest,
    ErrorReply,
    Lease,
    PoolStats,
    ReadReply,
    ReadRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewRequest,
    StatsRequest,
    WriteReply,
    WriteRequest,
    decode,
    encode,
)
from llmbus.protocol.messages import (
    FetchReply,
    FetchRequest,
    LookupReply,
    LookupRequest,
    StoreReply,
    StoreRequest,
)

TRANSPORTS = ("auto", "shm", "bus")


class KVPoolError(RuntimeError):
    """kvpool refused an operation. ``code``: "bad_request" | "exhausted" | "unknown_lease" | "internal",
    or "unavailable" when no kvpool answered at all (none running, or too slow)."""

    def __init__(self, message: str, code: str = "internal") -> None:
        super().__init__(message)
        self.code = code


class KVPoolClient:
    def __init__(self, nc: Client, *, transport: str = "auto", timeout: float = 5.0, owner: str = "",
                 chunk_bytes: int | None = None) -> None:  # fmt: skip
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.nc = nc
        self.transport = transport
        self.timeout = timeout
        self.owner = owner
        limit = max(1024, nc.max_payload - 1024)  # room for the record around the bytes
        self.chunk_bytes = min(chunk_bytes or limit, limit)
        self._segments: dict = {}

    async def _call(self, op: str, request, reply_cls):
        try:
            msg = await self.nc.request(subjects.kvpool(op), encode(request), timeout=self.timeout)
        except Exception as exc:  # NoRespondersError, TimeoutError
            raise KVPoolError(f"kvpool {op} got no answer: {type(exc).__name__} {exc}".strip(), "unavailable") from None
        if msg.headers and subjects.ERROR_HEADER in msg.headers:
            err = decode(ErrorReply, msg.data)
            raise KVPoolError(f"kvpool {op}: {err.error}", err.code)
        return decode(reply_cls, msg.data)

    async def allocate(self, num_blocks: int, *, ttl_s: float = 60.0, request_id: str = "") -> Lease:
        return await self._call("allocate", AllocateRequest(num_blocks, ttl_s, self.owner, request_id), Lease)

    async def renew(self, lease_id: str, ttl_s: float = 60.0) -> Lease:
        return await self._call("renew", RenewRequest(lease_id, ttl_s), Lease)

    async def release(self, lease_id: str) -> bool:
        """Idempotent: False when the lease was already released or reclaimed."""
        return (await self._call("release", ReleaseRequest(lease_id), ReleaseReply)).released

    async def stats(self) -> PoolStats:
        return await self._call("stats", StatsRequest(), PoolStats)

    # --- prefix cache -------------------------------------------------------------------------

    async def lookup(self, block_hashes: list[bytes], *, pin_ttl_s: float = 0.0) -> LookupReply:
        """Longest cached prefix of a hash chain per location (a worker's tier 0, cpu, ssd)."""
        return await self._call("lookup", LookupRequest(list(block_hashes), pin_ttl_s), LookupReply)

    async def fetch(self, block_hashes: list[bytes], *, start: int = 0, kv_format: str = "model",
                    ttl_s: float = 60.0, request_id: str = "", block_bytes: int = 0) -> FetchReply:  # fmt: skip
        """A lease holding ``hashes[start : start + reply.num_blocks]`` in the tier-0 format (read it,
        then release it); ``reply.lease`` is None when kvpool has nothing past ``start``."""
        req = FetchRequest(list(block_hashes), start, kv_format, ttl_s, self.owner, request_id, block_bytes)
        return await self._call("fetch", req, FetchReply)

    async def store(self, lease: Lease, block_hashes: list[bytes], *, parent_hash: bytes | None = None,
                    lease_index: int = 0, kv_format: str = "model", block_bytes: int = 0) -> StoreReply:  # fmt: skip
        """Cache lease blocks ``lease_index ...`` (tier-0 bytes already written) under ``block_hashes``."""
        req = StoreRequest(lease.lease_id, list(block_hashes), parent_hash, lease_index, kv_format, self.owner,
                           block_bytes)  # fmt: skip
        return await self._call("store", req, StoreReply)

    async def write_blocks(self, lease: Lease, index: int, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` (a whole number of blocks) into the lease starting at lease block ``index``."""
        view = memoryview(data).cast("B")
        if len(view) % lease.block_bytes:
            raise ValueError(f"data is {len(view)} bytes, not a multiple of the block size {lease.block_bytes}")
        offset = self._offset(lease, index, len(view) // lease.block_bytes)
        segment = self._segment(lease)
        if segment is not None:
            pos = 0
            for start, n in shm.lease_spans(lease.blocks, lease.block_bytes, offset, len(view)):
                segment.buf[start : start + n] = view[pos : pos + n]
                pos += n
            return
        for pos in range(0, len(view), self.chunk_bytes):
            chunk = bytes(view[pos : pos + self.chunk_bytes])
            await self._call("write", WriteRequest(lease.lease_id, offset + pos, chunk), WriteReply)

    async def read_blocks(self, lease: Lease, index: int = 0, count: int | None = None) -> bytes | bytearray:
        """``count`` blocks (default: the rest of the lease) from lease block ``index``; from shared
        memory a bytearray, written once (a long prompt's handoff is megabytes, copied while the
        engine thread waits for the GIL: bytes per span, then their join, then the caller's
        writable copy were three)."""
        count = len(lease.blocks) - index if count is None else count
        offset = self._offset(lease, index, count)
        length = count * lease.block_bytes
        segment = self._segment(lease)
        if segment is not None:
            out = bytearray(length)
            view, pos = memoryview(out), 0
            for s, n in shm.lease_spans(lease.blocks, lease.block_bytes, offset, length):
                view[pos : pos + n] = segment.buf[s : s + n]
                pos += n
            return out
        parts = []
        for pos in range(0, length, self.chunk_bytes):
            n = min(self.chunk_bytes, length - pos)
            parts.append((await self._call("read", ReadRequest(lease.lease_id, offset + pos, n), ReadReply)).data)
        return b"".join(parts)

    @staticmethod
    def _offset(lease: Lease, index: int, count: int) -> int:
        if index < 0 or count < 0 or index + count > len(lease.blocks):
            raise ValueError(f"blocks [{index}, {index + count}) are outside the lease's {len(lease.blocks)} blocks")
        return index * lease.block_bytes

    def _segment(self, lease: Lease):
        if self.transport == "bus":
            return None
        seg = self._segments.get(lease.shm_name)
        if seg is None:
            try:
                seg = shm.attach(lease.shm_name)
            except ValueError as exc:
                raise KVPoolError(str(exc), "bad_request") from None
            except FileNotFoundError:
                if self.transport == "shm":
                    raise KVPoolError(f"shared memory {lease.shm_name!r} is not on this host", "bad_request") from None
                self._segments[lease.shm_name] = False  # remember: another host, use the bus
                return None
            # NOTE: a segment not mapped yet means kvpool restarted (one kvpool per NATS, one lease
            # segment each): the old one, unlinked by now, is unmapped, or its memory would stay
            # taken for as long as this worker runs, once per restart. Every copy in or out of a
            # segment is synchronous: none is under way here.
            self.close()
            self._segments[lease.shm_name] = seg
        if seg and lease.expires_at <= time.time():
            raise KVPoolError(f"lease {lease.lease_id} has expired; renew it before touching its blocks", "unknown_lease")
        return seg or None

    def close(self) -> None:
        """Detach every shared-memory segment this client mapped (never unlinks: kvpool owns them);
        one still exported (a view held elsewhere) is left to the garbage collector."""
        for seg in self._segments.values():
            if seg:
                with contextlib.suppress(BufferError):
                    seg.close()
        self._segments.clear()

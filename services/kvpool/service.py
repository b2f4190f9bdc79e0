"""The kvpool service: leases over the CPU tier, answered on ``llmbus.kvpool.<op>`` (request/reply).

Each op's request and reply record is in llmbus/protocol/messages.py. A failed op answers an
``ErrorReply`` with the ``Llmbus-Error`` header set. Expired leases are swept every
``reclaim_interval_s`` and on every op. NOTE: leases are local to one kvpool instance; run one
kvpool per NATS deployment until pool-addressed subjects exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from llmbus.bus import subjects
from llmbus.bus.service import ServiceContext
from llmbus.protocol import (
    AllocateRequest,
    ErrorReply,
    Lease,
    PoolStats,
    ProtocolError,
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
from services.kvpool.allocator import BlockAllocator, LeaseRecord, PoolExhausted, UnknownLease
from services.kvpool.config import KVPoolConfig
from services.kvpool.tier import CpuTier

log = logging.getLogger("llmbus.kvpool")


class KVPool:
    def __init__(self, ctx: ServiceContext, config: KVPoolConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.allocator = BlockAllocator(config.capacity_blocks, max_ttl_s=config.max_ttl_s)
        self.tier: CpuTier | None = None
        self._ops = {
            "allocate": (AllocateRequest, self._allocate),
            "renew": (RenewRequest, self._renew),
            "release": (ReleaseRequest, self._release),
            "write": (WriteRequest, self._write),
            "read": (ReadRequest, self._read),
            "stats": (StatsRequest, self._stats),
        }

    async def run(self) -> None:
        self.tier = CpuTier(self.config.block_bytes, self.config.capacity_blocks)
        self.ctx.stack.callback(self.tier.close)
        for op in subjects.KVPOOL_OPS:
            await self.ctx.nc.subscribe(subjects.kvpool(op), queue=subjects.KVPOOL_QUEUE, cb=self._callback(op))
        self._report()
        await self.ctx.ready()
        log.info("kvpool %s: %d blocks of %d bytes in shm %s", self.ctx.instance_id,
                 self.config.capacity_blocks, self.config.block_bytes, self.tier.name)  # fmt: skip
        while not self.ctx.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), self.config.reclaim_interval_s)
            for lease_id in self.allocator.reclaim_expired():
                log.warning("reclaimed expired lease %s", lease_id)
            self._report()

    def _report(self) -> None:
        self.ctx.report(free_blocks=self.allocator.free_blocks, queue_depth=self.allocator.active_leases)

    def _callback(self, op: str):
        cls, handler = self._ops[op]

        async def on_msg(msg) -> None:
            if not msg.reply:
                return
            try:
                reply = handler(decode(cls, msg.data))
            except PoolExhausted as exc:
                reply = ErrorReply(str(exc), "exhausted")
            except (ProtocolError, ValueError) as exc:
                reply = ErrorReply(str(exc), "bad_request")
            except UnknownLease as exc:
                reply = ErrorReply(str(exc), "unknown_lease")
            except Exception as exc:  # a bug: answer rather than leave the caller waiting
                log.exception("kvpool %s failed", op)
                reply = ErrorReply(f"kvpool internal error: {exc}", "internal")
            failed = isinstance(reply, ErrorReply)
            await self.ctx.nc.publish(msg.reply, encode(reply), headers={subjects.ERROR_HEADER: reply.code} if failed else None)
            self._report()

        return on_msg

    def _lease(self, rec: LeaseRecord) -> Lease:
        return Lease(rec.lease_id, list(rec.blocks), self.config.block_bytes, self.tier.name, rec.ttl_s,
                     rec.expires_at, self.ctx.instance_id)  # fmt: skip

    def _allocate(self, req: AllocateRequest) -> Lease:
        return self._lease(self.allocator.allocate(req.num_blocks, req.ttl_s, owner=req.owner, request_id=req.request_id))

    def _renew(self, req: RenewRequest) -> Lease:
        return self._lease(self.allocator.renew(req.lease_id, req.ttl_s))

    def _release(self, req: ReleaseRequest) -> ReleaseReply:
        return ReleaseReply(req.lease_id, self.allocator.release(req.lease_id))

    def _write(self, req: WriteRequest) -> WriteReply:
        rec = self.allocator.get(req.lease_id)
        return WriteReply(req.lease_id, self.tier.write(rec.blocks, req.offset, req.data))

    def _read(self, req: ReadRequest) -> ReadReply:
        limit = self.ctx.nc.max_payload - 1024
        if req.length > limit:
            raise ValueError(f"read length {req.length} exceeds the {limit}-byte chunk limit; read in chunks")
        rec = self.allocator.get(req.lease_id)
        return ReadReply(req.lease_id, req.offset, self.tier.read(rec.blocks, req.offset, req.length))

    def _stats(self, req: StatsRequest) -> PoolStats:
        self.allocator.reclaim_expired()
        a = self.allocator
        return PoolStats(self.ctx.instance_id, a.capacity, a.free_blocks, a.leased_blocks, a.active_leases,
                         self.config.block_bytes, self.tier.name, a.reclaimed_total)  # fmt: skip

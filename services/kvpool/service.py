"""The kvpool service: leases over the CPU tier, answered on ``llmbus.kvpool.<op>`` (request/reply),
and the prefix cache (index, CPU and SSD tiers: ops lookup, fetch, store; workers' KV events).

Each op's request and reply record is in llmbus/protocol/messages.py. A failed op answers an
``ErrorReply`` with the ``Llmbus-Error`` header set. Expired leases are swept every
``reclaim_interval_s`` and on every op. NOTE: leases are local to one kvpool instance; run one
kvpool per NATS deployment until pool-addressed subjects exist. NOTE: tier conversions run on the
event loop (ops are answered one at a time, so the prefix cache needs no locking).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from llmbus.bus import shm, subjects
from llmbus.bus.service import ServiceContext
from llmbus.bus.streams import read_registry
from llmbus.metrics import Metric, scalar
from llmbus.protocol import (
    AllocateRequest,
    ErrorReply,
    Lease,
    MetricFamily,
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
from llmbus.protocol.messages import (
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
        self.prefix = None  # services.kvpool.prefix.PrefixCache when configured
        self._ops = {
            "allocate": (AllocateRequest, self._allocate),
            "renew": (RenewRequest, self._renew),
            "release": (ReleaseRequest, self._release),
            "write": (WriteRequest, self._write),
            "read": (ReadRequest, self._read),
            "stats": (StatsRequest, self._stats),
            "lookup": (LookupRequest, self._lookup),
            "fetch": (FetchRequest, self._fetch),
            "store": (StoreRequest, self._store),
        }
        self._absent: set[str] = set()  # tier-0 workers the last registry sweep did not find
        self._next_sweep = 0.0
        ctx.add_metrics(self.metric_families)

    async def run(self) -> None:
        if orphans := shm.sweep_orphans():  # (what killed kvpools on this host left)
            log.warning("removed %d shared-memory segments left by kvpools that were killed (%.0f MiB): %s",
                        len(orphans), sum(n for _, n in orphans) / 2**20, ", ".join(name for name, _ in orphans))
        self.tier = CpuTier(self.config.block_bytes, self.config.capacity_blocks)
        self.ctx.stack.callback(self.tier.close)
        if self.config.prefix is not None:
            import torch

            # NOTE: kvpool copies and converts blocks on its event loop; torch's intra-op threads
            # would spin on the cores the engines compute on (measured on 2 cores, small demo model,
            # c32: kvpool CPU 1.00 -> 0.23 s for 68 stored prompts, output tok/s +14%)
            torch.set_num_threads(1)
            from services.kvpool.prefix import PrefixCache

            self.prefix = PrefixCache(self.config.prefix)
            self.ctx.stack.callback(self.prefix.close)
            restored = self.prefix.restore()
            log.info("prefix cache: %d blocks re-indexed from the SSD tier", restored)
        for op in subjects.KVPOOL_OPS:
            await self.ctx.nc.subscribe(subjects.kvpool(op), queue=subjects.KVPOOL_QUEUE, cb=self._callback(op))
        await self.ctx.nc.subscribe(subjects.KVPOOL_EVENTS, cb=self._on_events)
        self._report()
        await self.ctx.ready()
        log.info("kvpool %s: %d blocks of %d bytes in shm %s", self.ctx.instance_id,
                 self.config.capacity_blocks, self.config.block_bytes, self.tier.name)  # fmt: skip
        while not self.ctx.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), self.config.reclaim_interval_s)
            for lease_id in self.allocator.reclaim_expired():
                log.warning("reclaimed expired lease %s", lease_id)
            if self.prefix is not None and time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + self.ctx.options.limits.registry_ttl_s
                await self._forget_gone_workers()
            self._report()

    async def _forget_gone_workers(self) -> None:
        """Drop the tier-0 blocks of workers missing from the registry in two sweeps running (one
        registry TTL apart, so a worker that has just started is not taken for gone): a worker that
        crashed sent no BlockRemoved, and an id no worker has (any client may publish KV events)
        must not keep index entries for ever. A live worker keeps at most the blocks its cache
        holds (its registered total_blocks), the ones it announced last."""
        try:
            live = {info.instance_id: info.total_blocks for info in await read_registry(self.ctx.registry)
                    if info.role in ("prefill", "decode")}  # only workers have a tier 0
        except Exception as exc:  # NATS reconnecting: next sweep
            log.debug("no registry read for the prefix index: %s", exc)
            return
        index = self.prefix.index
        held = index.t0_workers()
        absent = set(held) - set(live)
        for worker in absent & self._absent:
            log.info("forgot %d tier-0 blocks of worker %s, gone from the registry", index.drop_worker(worker), worker)
        self._absent = absent - self._absent
        for worker, total in live.items():  # workers announce what they cache, never what they evict
            if total:
                index.limit_t0(worker, total)

    def _report(self) -> None:
        self.ctx.report(free_blocks=self.allocator.free_blocks, total_blocks=self.allocator.capacity,
                        queue_depth=self.allocator.active_leases)

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
        if self.prefix is not None and req.lease_id.startswith("pin-"):
            return ReleaseReply(req.lease_id, self.prefix.index.unpin(req.lease_id))
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
        tiers, known = [], 0
        if self.prefix is not None:
            for t, c in self.prefix.counters.items():
                used, cap, blocks = self.prefix.tier_usage(t)
                tiers.append(TierStats(t, self.prefix.fmt[t].name, used, cap, blocks, c.lookups, c.hits,
                                       c.evictions, c.demotions, c.promotions))  # fmt: skip
            known = len(self.prefix.index)
        return PoolStats(self.ctx.instance_id, a.capacity, a.free_blocks, a.leased_blocks, a.active_leases,
                         self.config.block_bytes, self.tier.name, a.reclaimed_total, tiers, known,
                         self.config.max_ttl_s)  # fmt: skip

    def metric_families(self) -> list[MetricFamily]:
        """``_stats`` as metrics: the lease pool, and each prefix tier's use and traffic."""
        if self.tier is None:  # not serving yet
            return []
        st = self._stats(StatsRequest())
        families = [
            scalar("llmbus_kvpool_blocks", "Blocks in kvpool's shared-memory pool (leases draw on it).",
                   st.capacity_blocks),
            scalar("llmbus_kvpool_free_blocks", "Blocks of the pool no lease holds.", st.free_blocks),
            scalar("llmbus_kvpool_active_leases", "Leases alive.", st.active_leases),
            scalar("llmbus_kvpool_reclaimed_leases_total", "Leases reclaimed when their TTL ran out.",
                   st.reclaimed_leases, "counter"),
            scalar("llmbus_kvpool_prefix_blocks", "Blocks the prefix index knows of, in any location.",
                   st.prefix_blocks),
        ]
        per_tier = [
            ("bytes", "gauge", "Bytes a prefix tier holds.", lambda t: t.bytes_used),
            ("capacity_bytes", "gauge", "Bytes a prefix tier may hold.", lambda t: t.bytes_capacity),
            ("cached_blocks", "gauge", "Blocks a prefix tier holds.", lambda t: t.blocks),
            ("lookups_total", "counter", "Blocks fetches asked of a prefix tier.", lambda t: t.lookups),
            ("hits_total", "counter", "Blocks a prefix tier served (hit rate: hits / lookups).", lambda t: t.hits),
            ("evictions_total", "counter", "Blocks dropped from a prefix tier.", lambda t: t.evictions),
            ("demotions_total", "counter", "Blocks moved from a prefix tier down to the next.", lambda t: t.demotions),
            ("promotions_total", "counter", "Blocks moved up into a prefix tier.", lambda t: t.promotions),
        ]
        for suffix, kind, help_, read in per_tier:
            m = Metric(f"llmbus_kvpool_tier_{suffix}", help_, kind, ("tier", "kv_format"))
            for t in st.tiers:
                m.set(read(t), t.tier, t.kv_format)
            families.append(m.family())
        return families

    # --- prefix cache -------------------------------------------------------------------------

    def _need_prefix(self, kv_format: str, block_bytes: int):
        if self.prefix is None:
            raise ValueError("this kvpool runs without a prefix cache (start it with --kv-layout)")
        if kv_format != self.prefix.config.kv_format:
            raise ValueError(f"kvpool caches {self.prefix.config.kv_format!r} blocks, got {kv_format!r}")
        if block_bytes and block_bytes != self.prefix.block_bytes:
            raise ValueError(f"kvpool caches {self.prefix.block_bytes}-byte blocks (--kv-layout "
                             f"{self.prefix.config.layout}); this worker's are {block_bytes} bytes")
        return self.prefix

    def _lookup(self, req: LookupRequest) -> LookupReply:
        if self.prefix is None:
            return LookupReply()
        index = self.prefix.index
        if req.pin_ttl_s > self.allocator.max_ttl_s:  # as for a lease: a pin outliving it would hold blocks for good
            raise ValueError(f"pin_ttl_s must be at most {self.allocator.max_ttl_s}, got {req.pin_ttl_s}")
        hits = [PrefixHit(t, w, n) for (t, w), n in sorted(index.lookup(req.block_hashes).items())]
        pool = index.pool_prefix(req.block_hashes)
        pin = index.pin(req.block_hashes[:pool], req.pin_ttl_s) if req.pin_ttl_s > 0 and pool else ""
        return LookupReply(hits, pool, pin)

    def _fetch(self, req: FetchRequest) -> FetchReply:
        prefix = self._need_prefix(req.kv_format, req.block_bytes)
        if prefix.index.pool_prefix(req.block_hashes, req.start) == 0:
            return FetchReply(0)
        limit = min(self.allocator.free_blocks, len(req.block_hashes) - req.start)
        rows, served = prefix.fetch(req.block_hashes, req.start, limit)
        n = rows.shape[0]
        if n == 0:
            return FetchReply(0)
        rec = self.allocator.allocate(n, req.ttl_s, owner=req.owner, request_id=req.request_id)
        try:
            bb = self.config.block_bytes
            for i in range(n):  # NOTE: rows are tier-0 blocks; lease blocks may be larger (zero padded)
                self.tier.write(rec.blocks, i * bb, rows[i].numpy().data)
        except BaseException:
            self.allocator.release(rec.lease_id)
            raise
        return FetchReply(n, self._lease(rec), served["cpu"], served["ssd"])

    def _store(self, req: StoreRequest) -> StoreReply:
        prefix = self._need_prefix(req.kv_format, req.block_bytes)
        rec = self.allocator.get(req.lease_id)
        n = len(req.block_hashes)
        if req.lease_index < 0 or req.lease_index + n > len(rec.blocks):
            raise ValueError(f"blocks [{req.lease_index}, {req.lease_index + n}) are outside the lease's {len(rec.blocks)}")
        bb = self.config.block_bytes
        if prefix.block_bytes > bb:
            raise ValueError(f"a {prefix.block_bytes}-byte block does not fit kvpool's {bb}-byte lease blocks")
        # NOTE: one copy out of the lease (not read()'s bytes, then a bytearray): multi-MB per prompt
        rows = self.tier.gather(rec.blocks[req.lease_index : req.lease_index + n])[:, : prefix.block_bytes]
        stored, present = prefix.store(req.block_hashes, rows, parent=req.parent_hash)
        return StoreReply(stored, present)

    async def _on_events(self, msg) -> None:
        if self.prefix is None:
            return
        try:
            batch = decode(KVEvents, msg.data)
        except ProtocolError as exc:
            log.warning("dropping malformed KV events: %s", exc)
            return
        from llmbus.kv.index import BlockRemoved, BlockStored

        try:
            for ev in batch.stored:
                if ev.tier == "t0":
                    self.prefix.index.apply(BlockStored(ev.block_hashes, ev.parent_hash, ev.token_count, "t0", ev.worker))
            for ev in batch.removed:
                if ev.tier == "t0":
                    self.prefix.index.apply(BlockRemoved(ev.block_hashes, "t0", ev.worker))
        except ValueError as exc:
            log.warning("bad KV event from %s: %s", batch.worker, exc)

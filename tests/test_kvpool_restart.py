"""kvpool as a process: its SSD tier across a crash (fill it, kill -9 kvpool, restart, the same
prefixes hit again; a block file with flipped bytes is dropped, never served), and no compute threads
of its own beside the engines'."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmbus.bus.connection import connect
from llmbus.bus.kvclient import KVPoolClient, KVPoolError
from llmbus.bus.service import READY_PREFIX
from llmbus.kv.hashing import chain_hashes, root_hash
from llmbus.kv.layout import KVLayout
from llmbus.kv.tier_ssd import HEADER_BYTES
from services.kvpool.config import format_layout

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
BLOCK = LAYOUT.bytes_per_block  # 1024


def start(nats_url: str, data_dir: Path, layout: KVLayout = LAYOUT, cpu_blocks: int = 2,
          ssd_blocks: int = 6) -> subprocess.Popen:  # fmt: skip
    block = layout.bytes_per_block
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.kvpool", "--nats-url", nats_url, "--block-bytes", str(block),
         "--capacity-blocks", "16", "--kv-layout", format_layout(layout), "--cpu-bytes", str(cpu_blocks * block),
         "--ssd-bytes", str(ssd_blocks * (block + HEADER_BYTES)), "--data-dir", str(data_dir), "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    assert line.startswith(f"{READY_PREFIX} kvpool "), f"kvpool did not start: {line!r}, rc={proc.poll()}"
    return proc


def chain(tag: int) -> list[bytes]:
    return chain_hashes(root_hash("m", "model", "tenant"), [tag * 100 + i for i in range(8)], 4)  # 2 blocks


def data(tag: int) -> bytes:
    return bytes((i * 13 + tag) % 251 for i in range(2 * BLOCK))


async def store(client: KVPoolClient, tag: int) -> tuple[int, int]:
    lease = await client.allocate(2, ttl_s=30)
    await client.write_blocks(lease, 0, data(tag))
    reply = await client.store(lease, chain(tag), block_bytes=BLOCK)
    await client.release(lease.lease_id)
    return reply.stored, reply.present


async def fetched(client: KVPoolClient, tag: int) -> tuple[int, bytes]:
    reply = await client.fetch(chain(tag), block_bytes=BLOCK)
    if reply.lease is None:
        return 0, b""
    raw = await client.read_blocks(reply.lease)
    await client.release(reply.lease.lease_id)
    return reply.num_blocks, raw


def test_ssd_tier_survives_kill_9_and_drops_a_corrupt_block(nats_server, tmp_path):
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    data_dir = tmp_path / "data"

    async def fill():
        nc = await connect(nats_server)
        client = KVPoolClient(nc, transport="bus")
        assert [await store(client, t) for t in (1, 2, 3)] == [(2, 0)] * 3
        assert await store(client, 1) == (0, 2)  # idempotent: already cached (on SSD by now)
        stats = await client.stats()
        cpu, ssd = stats.tiers
        assert (cpu.tier, cpu.blocks, cpu.demotions, ssd.tier, ssd.blocks) == ("cpu", 2, 4, "ssd", 4)
        await nc.close()

    async def after_restart():
        nc = await connect(nats_server)
        client = KVPoolClient(nc, transport="bus")
        hits = await client.lookup(chain(1))
        assert [(h.tier, h.num_blocks) for h in hits.hits] == [("ssd", 2)] and hits.pool_blocks == 2
        assert await fetched(client, 1) == (2, data(1))  # byte for byte, from files written before the crash
        assert (await client.lookup(chain(3))).hits == []  # was in the CPU tier: gone with the process
        n, raw = await fetched(client, 2)  # block 1 of chain 2 was corrupted: only block 0 is served
        assert (n, raw) == (1, data(2)[:BLOCK])
        stats = await client.stats()
        # 3 SSD hits promoted to the 2-block CPU tier, which demoted chain 1's tail back; 1 block dropped
        cpu, ssd = stats.tiers
        assert (cpu.blocks, cpu.promotions, cpu.demotions, ssd.blocks, ssd.hits) == (2, 3, 1, 1, 3)
        with pytest.raises(KVPoolError, match="kvpool caches 1024-byte blocks"):
            await client.fetch(chain(1), block_bytes=512)
        # a pin lasts no longer than a lease may (--max-ttl, 3600 s by default): one for ever is refused
        for ttl in (float("inf"), 3601.0):
            with pytest.raises(KVPoolError, match="pin_ttl_s must be at most 3600"):
                await client.lookup(chain(1), pin_ttl_s=ttl)
        pinned = await client.lookup(chain(1), pin_ttl_s=3600.0)
        assert pinned.pin_id and pinned.pool_blocks == 2
        assert await client.release(pinned.pin_id)
        await nc.close()

    proc = start(nats_server, data_dir)
    try:
        asyncio.run(asyncio.wait_for(fill(), 60))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=20)
        proc.stdout.close()
    files = sorted((data_dir / "kvpool-ssd").glob("*/*.kvb"))
    assert len(files) == 4
    victim = next(f for f in files if f.stem == chain(2)[1].hex())
    raw = bytearray(victim.read_bytes())
    raw[HEADER_BYTES + 100] ^= 0x5A
    victim.write_bytes(bytes(raw))
    proc = start(nats_server, data_dir)
    try:
        asyncio.run(asyncio.wait_for(after_restart(), 60))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()
        # NOTE: kill -9 left the first process's shared-memory segments behind; only ours are new
        for name in set(os.listdir("/dev/shm")) - shm_before if shm_before else ():
            if name.startswith(("llmbus_kv", "llmbus_kvcpu")):
                Path("/dev/shm", name).unlink(missing_ok=True)
    assert not victim.exists()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2, reason="needs /proc and 2+ cores")
def test_storing_blocks_starts_no_compute_threads(nats_server, tmp_path):
    """kvpool shares the cores with the engines: converting and copying blocks (here 4 x 256 KiB, far
    above torch's parallel grain) must not start intra-op threads that spin beside the engines'."""
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=64, dtype="float32")
    block = layout.bytes_per_block

    async def store_four(pid: int) -> tuple[int, int]:
        nc = await connect(nats_server)
        client = KVPoolClient(nc, transport="bus")
        await client.stats()
        before = len(os.listdir(f"/proc/{pid}/task"))
        hashes = chain_hashes(root_hash("m", "model", ""), list(range(4 * layout.block_size)), layout.block_size)
        lease = await client.allocate(4, ttl_s=30)
        await client.write_blocks(lease, 0, bytes(range(256)) * (4 * block // 256))
        reply = await client.store(lease, hashes, block_bytes=block)
        await client.release(lease.lease_id)
        await nc.close()
        return reply.stored, len(os.listdir(f"/proc/{pid}/task")) - before

    proc = start(nats_server, tmp_path / "data", layout, cpu_blocks=8, ssd_blocks=0)
    try:
        assert asyncio.run(asyncio.wait_for(store_four(proc.pid), 60)) == (4, 0)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()

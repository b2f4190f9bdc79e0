"""kvpool as a real process against a real nats-server: shm and bus byte paths, leases, stats."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.kvclient import KVPoolClient, KVPoolError
from llmbus.bus.service import READY_PREFIX
from llmbus.bus.streams import ensure_registry, read_registry
from llmbus.kv.layout import KVLayout
from llmbus.protocol import ErrorReply, decode
from llmbus.worker.base import EngineWorker

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
BLOCK = LAYOUT.bytes_per_block  # 512 bytes


@pytest.fixture(scope="module")
def kvpool(nats_server):
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.kvpool", "--nats-url", nats_server, "--block-bytes", str(BLOCK),
         "--capacity-blocks", "8", "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()  # blocks until the ready line (or EOF if it died)
    assert line.startswith(f"{READY_PREFIX} kvpool "), f"kvpool did not start: {line!r}, rc={proc.poll()}"
    yield proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0  # clean shutdown
    proc.stdout.close()


def pattern(n_blocks: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n_blocks * BLOCK))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_shm_write_is_read_back_over_the_bus_from_the_kvpool_process(nats_server, kvpool):
    async def body():
        nc = await connect(nats_server)
        local = KVPoolClient(nc, transport="shm")
        remote = KVPoolClient(nc, transport="bus", chunk_bytes=700)  # odd chunk: crosses block edges
        lease = await local.allocate(3, ttl_s=30)
        assert lease.block_bytes == BLOCK and len(lease.blocks) == 3 and lease.shm_name
        data = pattern(3, 1)
        await local.write_blocks(lease, 0, data)  # direct into kvpool's segment
        assert await remote.read_blocks(lease) == data  # kvpool reads its own mapping: same bytes
        new_mid = pattern(1, 99)
        await remote.write_blocks(lease, 1, new_mid)  # chunked over the bus
        assert await local.read_blocks(lease, 1, 1) == new_mid
        assert await local.read_blocks(lease) == data[:BLOCK] + new_mid + data[2 * BLOCK :]
        # from shared memory: one writable copy, which the workers' lease_rows use in place
        got = await local.read_blocks(lease, 1, 2)
        assert isinstance(got, bytearray) and got == new_mid + data[2 * BLOCK :]
        rows = EngineWorker.lease_rows(got, 2, BLOCK, 2, BLOCK // 2 - 8)  # 8 bytes of padding per layer
        assert rows.shape == (2, 2, BLOCK // 2 - 8) and bytes(rows[1, 0]) == data[2 * BLOCK : 2 * BLOCK + BLOCK // 2 - 8]
        got[BLOCK] ^= 0xFF
        assert rows[1, 0, 0].item() == got[BLOCK]  # the same memory, not a copy
        copied = EngineWorker.lease_rows(bytes(got), 2, BLOCK, 2, BLOCK // 2 - 8)
        got[BLOCK] ^= 0xFF
        assert copied[1, 0, 0].item() != got[BLOCK]  # bytes are copied (torch needs a writable buffer)
        with pytest.raises(ValueError, match="not a multiple of the block size"):
            await local.write_blocks(lease, 0, b"x" * (BLOCK + 1))
        with pytest.raises(ValueError, match="outside the lease's 3 blocks"):
            await remote.read_blocks(lease, 2, 2)
        assert await local.release(lease.lease_id) is True
        assert await local.release(lease.lease_id) is False  # idempotent
        with pytest.raises(KVPoolError, match="unknown or expired lease") as err:
            await remote.read_blocks(lease)
        assert err.value.code == "unknown_lease"
        stats = await local.stats()
        assert (stats.leased_blocks, stats.active_leases, stats.free_blocks) == (0, 0, 8)
        local.close()
        await nc.close()

    run(body())


def test_kvpool_reports_its_pool_in_the_registry(nats_server, kvpool):
    """Its registry entry counts the pool as a worker's does: free == total (its capacity) when idle."""

    async def body():
        nc = await connect(nats_server)
        kv = await ensure_registry(nc.jetstream())
        for _ in range(100):  # NOTE: an entry is re-put every 2 s: one from an earlier test may hold a lease
            mine = [(i.free_blocks, i.total_blocks, i.queue_depth) for i in await read_registry(kv)
                    if i.role == "kvpool" and i.pid == kvpool.pid]
            if mine == [(8, 8, 0)]:
                break
            await asyncio.sleep(0.1)
        await nc.close()
        return mine

    assert run(body()) == [(8, 8, 0)]


def test_segment_survives_a_second_process_attaching_and_exiting(nats_server, kvpool):
    async def body():
        nc = await connect(nats_server)
        client = KVPoolClient(nc)
        lease = await client.allocate(2, ttl_s=30)
        code = (
            "import sys; from llmbus.bus import shm\n"
            "seg = shm.attach(sys.argv[1]); b, n = int(sys.argv[2]), int(sys.argv[3])\n"
            "seg.buf[b * n : (b + 1) * n] = bytes([42]) * n; seg.close()\n"
        )
        subprocess.run([sys.executable, "-c", code, lease.shm_name, str(lease.blocks[1]), str(BLOCK)],
                       cwd=ROOT, check=True, timeout=60)  # fmt: skip
        assert await KVPoolClient(nc, transport="bus").read_blocks(lease, 1, 1) == bytes([42]) * BLOCK
        assert Path("/dev/shm", lease.shm_name).exists() or not os.path.isdir("/dev/shm")
        assert await client.release(lease.lease_id)
        client.close()
        await nc.close()

    run(body())


def test_expired_lease_is_reclaimed_and_errors_are_clear(nats_server, kvpool):
    async def body():
        nc = await connect(nats_server)
        client = KVPoolClient(nc, transport="bus")
        lease = await client.allocate(5, ttl_s=0.3)
        with pytest.raises(KVPoolError, match="3 free blocks of 8; 4 requested") as err:
            await client.allocate(4)
        assert err.value.code == "exhausted"
        before = (await client.stats()).reclaimed_leases
        await asyncio.sleep(0.5)
        stats = await client.stats()
        assert stats.leased_blocks == 0 and stats.reclaimed_leases == before + 1
        assert await client.release(lease.lease_id) is False
        with pytest.raises(KVPoolError, match="unknown or expired"):
            await client.renew(lease.lease_id)
        bad = await nc.request(subjects.kvpool("allocate"), msgpack.packb({"num_blocks": 0}), timeout=5)
        assert bad.headers[subjects.ERROR_HEADER] == "bad_request"
        assert "num_blocks must be >= 1" in decode(ErrorReply, bad.data).error
        shm_client = KVPoolClient(nc, transport="shm")
        with pytest.raises(KVPoolError, match="has expired"):
            await shm_client.read_blocks(lease)
        shm_client.close()
        await nc.close()

    run(body())


def test_no_kvpool_means_a_clear_error(tmp_path):
    from llmbus.bus.server import EmbeddedNats

    async def body(url):
        nc = await connect(url)
        with pytest.raises(KVPoolError, match="kvpool stats got no answer") as exc:
            await KVPoolClient(nc, timeout=0.5).stats()
        assert exc.value.code == "unavailable"
        await nc.close()

    with EmbeddedNats(tmp_path) as server:
        run(body(server.url))


def test_a_new_segment_is_reserved_up_front_and_a_full_dev_shm_is_a_clear_error(monkeypatch):
    import errno
    import os

    import pytest

    from llmbus.bus import shm

    size = 3 * shm.PAGE + 100
    seg = shm.create(shm.new_segment_name("llmbus_test"), size)
    try:
        assert os.fstat(seg._fd).st_blocks * 512 >= size  # allocated now, not at the first write
        assert bytes(seg.buf[:size]) == bytes(size)
    finally:
        shm.destroy(seg)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = shm.new_segment_name("llmbus_kvtest")
    with pytest.raises(OSError, match="shm_size"):
        shm.create(name, size)
    with pytest.raises(FileNotFoundError):  # nothing left behind
        shm.attach(name)


def test_segments_left_by_a_killed_kvpool_are_swept_and_live_ones_kept():
    """A SIGKILLed creator cannot unlink its segment; the next kvpool on the host removes it (no
    process maps it), but never one a live process maps, nor one written just now."""
    from llmbus.bus import shm

    code = ("import sys, time; from llmbus.bus import shm; seg = shm.create(shm.new_segment_name('llmbus_kvtest'), 8192); "
            "print(seg.name, flush=True); time.sleep(120)")  # fmt: skip
    # NOTE: each in a process group of its own, killed whole: Python's resource tracker (a child of
    # each) unlinks what a process alone killed leaves; killed with it, as by `up` or a container's
    # end, nothing does
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              process_group=0) for _ in range(3)]  # fmt: skip
    names = [p.stdout.readline().strip() for p in procs]
    live, killed, recent = names
    try:
        for p in procs[1:]:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for name in (live, killed):  # last written long ago
            os.utime(shm.SHM_DIR / name, (1e9, 1e9))
        removed = dict(shm.sweep_orphans(min_age_s=30))
        assert killed in removed and removed[killed] == 8192
        assert live not in removed and recent not in removed
        assert (shm.SHM_DIR / live).exists() and (shm.SHM_DIR / recent).exists() and not (shm.SHM_DIR / killed).exists()
    finally:
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        for name in names:
            (shm.SHM_DIR / name).unlink(missing_ok=True)


def test_a_lease_naming_shared_memory_kvpool_did_not_make_is_refused(nats_server):
    """A Lease's shm_name comes off the bus: a forged one must not map another program's segment."""
    from llmbus.bus import shm
    from llmbus.protocol import Lease

    other = shm.create("not_llmbus_" + os.urandom(4).hex(), 4096)  # some other program's segment
    try:
        for name in (other.name, "llmbus_kv_../../x", "llmbus_kv_" + "0" * 11):
            with pytest.raises(ValueError, match="not the name of a kvpool shared-memory segment"):
                shm.attach(name)

        async def body():
            nc = await connect(nats_server)
            client = KVPoolClient(nc, transport="shm")
            lease = Lease("p-1-00", [0], 4096, other.name, 60.0, 2e9, "p")
            with pytest.raises(KVPoolError, match="not the name of a kvpool shared-memory segment"):
                await client.read_blocks(lease)
            await nc.close()

        run(body())
    finally:
        shm.destroy(other)


@pytest.mark.parametrize("extra,message", [
    (["--block-bytes", "100", "--kv-layout", "2,2,8,4,float16"], "less than one model block of the KV layout (512 bytes)"),
    (["--block-bytes", "512", "--ssd-bytes", "4096"], "--ssd-bytes needs --kv-layout"),
    (["--block-bytes", "512", "--kv-layout", "2,2,8,4,float16", "--ssd-bytes", "4096", "--data-dir", "{file}"],
     "cannot hold the SSD tier"),
])
def test_kvpool_bad_options_fail_before_connecting(tmp_path, extra, message):
    """Options that cannot work are a one-line error and exit 2 at start (no NATS is needed to
    find out), not a ready kvpool whose first handoff or store fails."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    extra = [e.replace("{file}", str(a_file)) for e in extra]
    proc = subprocess.run([sys.executable, "-m", "services.kvpool", "--nats-url", "nats://127.0.0.1:1",
                           "--capacity-blocks", "4", *extra], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_kvpool_forgets_the_tier0_blocks_of_workers_gone_from_the_registry(tmp_path):
    """A worker that crashed sends no BlockRemoved, and any client may publish KV events under an id
    no worker has: kvpool drops the tier-0 blocks of a worker missing from the registry in two sweeps
    running, and keeps those of a worker that is there, as many as its cache holds (workers
    announce what they cache, not what they evict): the ones announced last."""
    from llmbus.bus.server import EmbeddedNats
    from llmbus.bus.service import ServiceOptions, run_service
    from llmbus.bus.streams import StreamLimits
    from llmbus.protocol import BlockStoredEvent, InstanceInfo, KVEvents, PrefixHit, encode
    from services.kvpool.config import KVPoolConfig, PrefixConfig
    from services.kvpool.service import KVPool

    layout = KVLayout(2, 2, 16, 16, dtype="float32")
    config = KVPoolConfig(layout.bytes_per_block, 4, reclaim_interval_s=0.05,
                          prefix=PrefixConfig(layout, cpu_bytes=4 * layout.bytes_per_block))
    chain = [bytes([i]) * 16 for i in range(3)]

    async def body(nats_url):  # a server of its own: no other kvpool answers its lookups
        # sweeps 0.4 s apart; the registry bucket, made first, keeps the default 10 s TTL
        options = ServiceOptions("kvpool", nats_url, heartbeat_s=0.1, limits=StreamLimits(registry_ttl_s=0.4))
        nc = await connect(nats_url)
        registry = await ensure_registry(nc.jetstream())
        live = InstanceInfo("w-live", "decode", total_blocks=3)
        await registry.put(subjects.registry_key("decode", "w-live"), encode(live))
        holder: dict = {}

        async def service(ctx):
            holder["pool"] = KVPool(ctx, config)
            await holder["pool"].run()

        task = asyncio.create_task(run_service(options, service))
        while "pool" not in holder or not holder["pool"].ctx.is_ready:
            assert not task.done(), task.result()
            await asyncio.sleep(0.02)
        # an id that is in the registry, but of no worker: nothing there holds a tier 0
        await registry.put(subjects.registry_key("router", "ghost"), encode(InstanceInfo("ghost", "router")))
        for worker in ("w-live", "ghost"):
            events = KVEvents(worker, stored=[BlockStoredEvent(chain, None, 16, "t0", worker)])
            await nc.publish(subjects.KVPOOL_EVENTS, encode(events))
        await nc.flush()
        client = KVPoolClient(nc, transport="bus")

        async def t0_hits():
            return sorted((h.worker, h.num_blocks) for h in (await client.lookup(chain)).hits if h.tier == "t0")

        assert await t0_hits() == [("ghost", 3), ("w-live", 3)]
        for _ in range(200):
            if await t0_hits() == [("w-live", 3)]:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # more sweeps: the registered worker stays
        assert await t0_hits() == [("w-live", 3)]
        later = [bytes([9, i]) * 8 for i in range(2)]  # its cache holds 3 blocks: 2 of the first chain go
        events = KVEvents("w-live", stored=[BlockStoredEvent(later, None, 16, "t0", "w-live")])
        await nc.publish(subjects.KVPOOL_EVENTS, encode(events))
        for _ in range(200):
            if await t0_hits() == []:
                break
            await asyncio.sleep(0.05)
        assert await t0_hits() == [] and (await client.lookup(later)).hits == [PrefixHit("t0", "w-live", 2)]
        await registry.delete(subjects.registry_key("decode", "w-live"))
        holder["pool"].ctx.stop.set()
        assert await asyncio.wait_for(task, 20) == 0
        await nc.close()

    with EmbeddedNats(tmp_path) as server:
        run(body(server.url))


def test_a_restarted_kvpool_s_old_segment_is_unmapped(nats_server):
    """Each kvpool start makes a new segment: a worker that mapped the old one unmaps it when a lease
    names the new one, or the old pool's memory would stay taken as long as the worker runs."""
    from llmbus.bus import shm
    from llmbus.protocol import Lease

    old, new = (shm.create(shm.new_segment_name(), 4096) for _ in range(2))
    try:
        old.buf[:4] = b"old!"
        new.buf[:4] = b"new!"

        async def body():
            nc = await connect(nats_server)
            client = KVPoolClient(nc, transport="shm")
            read = [await client.read_blocks(Lease(f"p-{i}-00", [0], 4096, seg.name, 60.0, 2e9, "p"))
                    for i, seg in enumerate((old, new))]
            mapped = dict(client._segments)  # noqa: SLF001
            client.close()
            await nc.close()
            return read, mapped

        read, mapped = run(body())
        assert [bytes(r[:4]) for r in read] == [b"old!", b"new!"]
        assert list(mapped) == [new.name]  # the old pool's mapping is gone
    finally:
        for seg in (old, new):
            shm.destroy(seg)

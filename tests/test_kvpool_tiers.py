"""kvpool's CPU and SSD tiers: LRU demotion chain, promotion on hit, pins, formats, checksums."""

import torch

from llmbus.kernels import quant_reference as qr
from llmbus.kv.hashing import chain_hashes, root_hash
from llmbus.kv.layout import KVLayout
from llmbus.kv.tier_format import dequantize
from llmbus.kv.tier_ssd import HEADER_BYTES
from services.kvpool.config import PrefixConfig
from services.kvpool.prefix import PrefixCache

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
BLOCK = LAYOUT.bytes_per_block  # 1024 bytes in fp32


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1  # every look at the clock is a later instant: LRU order is exact
        return self.now


def kv(n: int, seed: int) -> torch.Tensor:
    """n blocks of random KV: fp32 [n, layers, 2, bs, H, D]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 2, 4, 2, 8, generator=g)


def rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def chain(tag: int, n: int, salt: str = "") -> list[bytes]:
    return chain_hashes(root_hash("m", "model", salt), [tag * 1000 + i for i in range(4 * n)], 4)


def cache(tmp_path, cpu_blocks: int, ssd_blocks: int, cpu="same", ssd="same") -> PrefixCache:
    probe = PrefixCache(PrefixConfig(LAYOUT, cpu_format=cpu, ssd_format=ssd, cpu_bytes=0))
    cpu_slot, ssd_block = probe.cpu.slot_bytes, probe.codec.block_bytes(probe.fmt["ssd"]) + HEADER_BYTES
    return PrefixCache(PrefixConfig(LAYOUT, cpu_format=cpu, ssd_format=ssd, cpu_bytes=cpu_blocks * cpu_slot,
                                    ssd_bytes=ssd_blocks * ssd_block, ssd_dir=tmp_path / "ssd"), clock=Clock())


def test_demotion_chain_eviction_order_and_promotion(tmp_path):
    pc = cache(tmp_path, cpu_blocks=2, ssd_blocks=2)
    a, b, c = chain(1, 2), chain(2, 2), chain(3, 2)
    xa, xb, xc = kv(2, 1), kv(2, 2), kv(2, 3)
    assert pc.store(a, rows(xa)) == (2, 0)
    assert pc.index.lru_order("cpu") == [a[1], a[0]]  # chain touched tail first: its head is evicted last
    assert pc.store(b, rows(xb)) == (2, 0)  # A demoted to SSD, tail first
    assert pc.index.lru_order("cpu") == [b[1], b[0]] and pc.index.lru_order("ssd") == [a[1], a[0]]
    assert pc.store(c, rows(xc)) == (2, 0)  # B demoted; A dropped from SSD (the last tier)
    assert pc.index.lru_order("cpu") == [c[1], c[0]] and pc.index.lru_order("ssd") == [b[1], b[0]]
    assert pc.index.lookup(a) == {} and pc.store(c, rows(xc)) == (0, 2)
    cpu, ssd = pc.counters["cpu"], pc.counters["ssd"]
    assert (cpu.evictions, cpu.demotions, ssd.evictions) == (4, 4, 2)
    out, served = pc.fetch(b)  # an SSD hit: served, and promoted to CPU (demoting C)
    assert torch.equal(out, rows(xb)) and served == {"cpu": 0, "ssd": 2}
    assert pc.index.lru_order("cpu") == [b[1], b[0]] and pc.index.lru_order("ssd") == [c[1], c[0]]
    assert (cpu.promotions, cpu.hits, ssd.hits) == (2, 0, 2)
    out, served = pc.fetch(c[:1] + [b"\x01" * 16])  # a chain stops at the first miss
    assert torch.equal(out, rows(xc[:1])) and served == {"cpu": 0, "ssd": 1}
    assert pc.tier_usage("cpu") == (2 * BLOCK, 2 * BLOCK, 2)
    pc.close()


def test_pinned_blocks_are_never_evicted(tmp_path):
    pc = cache(tmp_path, cpu_blocks=2, ssd_blocks=0)
    a, b = chain(1, 2), chain(2, 1)
    pc.store(a, rows(kv(2, 1)))
    pin = pc.index.pin(a, ttl_s=60)
    assert pc.store(b, rows(kv(1, 2))) == (0, 0) and pc.rejected == 1  # only pinned blocks to evict
    assert pc.index.lookup(a) == {("cpu", ""): 2}
    assert pc.index.unpin(pin) and not pc.index.unpin(pin)
    assert pc.store(b, rows(kv(1, 2))) == (1, 0)
    assert pc.index.lru_order("cpu") == [a[0], b[0]]  # a[1] (A's tail, least recent) was dropped: no SSD tier
    assert pc.counters["cpu"].evictions == 1 and pc.counters["cpu"].demotions == 0
    pc.close()


def test_formats_convert_on_demotion_and_promotion_hands_back_tier0(tmp_path):
    pc = cache(tmp_path, cpu_blocks=1, ssd_blocks=4, cpu="int8", ssd="int4")
    assert pc.cpu.slot_bytes < BLOCK // 3  # int8 + fp16 scales of an fp32 block
    a, b = chain(1, 1), chain(2, 1)
    xa, xb = kv(1, 1), kv(1, 2)
    pc.store(a, rows(xa))
    # in the CPU tier: exactly the reference INT8 of every (token, head) row
    q, s = qr.int8_quantize(xa)
    got8 = dequantize(torch.frombuffer(bytearray(pc.cpu.get(a[0])), dtype=torch.uint8)[None], LAYOUT, pc.fmt["cpu"])
    assert torch.equal(got8, qr.int8_dequantize(q, s))
    back, _ = pc.fetch(a)  # CPU hit, handed back in the tier-0 format (fp32)
    assert back.shape == (1, BLOCK) and torch.equal(back.view(torch.float32).reshape(xa.shape), qr.int8_dequantize(q, s))
    pc.store(b, rows(xb))  # demotes A: int8 -> int4 on its way to SSD
    assert pc.index.tier_of(a[0]) == "ssd"
    assert pc.ssd.path(a[0]).stat().st_size == pc.codec.block_bytes(pc.fmt["ssd"]) + HEADER_BYTES
    back, served = pc.fetch(a)
    err = (back.view(torch.float32).reshape(xa.shape) - xa).abs().max() / xa.abs().max()
    assert served["ssd"] == 1 and 0 < err < 0.15  # int4 is lossy, and bounded
    assert pc.index.tier_of(a[0]) == "cpu" and pc.index.tier_of(b[0]) == "ssd"  # promoted, B demoted
    pc.close()


def test_corrupt_ssd_block_is_dropped_not_served(tmp_path):
    pc = cache(tmp_path, cpu_blocks=0, ssd_blocks=3)
    a = chain(1, 3)
    x = kv(3, 1)
    assert pc.store(a, rows(x)) == (3, 0)  # no CPU tier: straight to SSD
    path = pc.ssd.path(a[1])
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    out, served = pc.fetch(a)
    assert torch.equal(out, rows(x[:1])) and served["ssd"] == 1  # stops before the bad block
    assert not path.exists() and pc.ssd.dropped_corrupt == 1 and pc.index.lookup(a) == {("ssd", ""): 1}
    pc.close()


def test_a_valid_ssd_file_under_another_block_s_name_is_not_served(tmp_path):
    """A file's checksum covers the hash it is named by: one block's file copied over another's
    (a restore or rsync gone wrong) is dropped, at read and at the next start's scan."""
    pc = cache(tmp_path, cpu_blocks=0, ssd_blocks=6)
    a, b = chain(1, 2), chain(2, 2)
    xa, xb = kv(2, 1), kv(2, 2)
    pc.store(a, rows(xa)), pc.store(b, rows(xb))
    pc.ssd.path(a[1]).write_bytes(pc.ssd.path(b[1]).read_bytes())
    out, served = pc.fetch(a)
    assert torch.equal(out, rows(xa[:1])) and served["ssd"] == 1  # b's bytes never come back as a's
    assert pc.ssd.dropped_corrupt == 1 and not pc.ssd.path(a[1]).exists()
    pc.ssd.path(a[0]).write_bytes(pc.ssd.path(b[0]).read_bytes())
    pc.close()
    again = cache(tmp_path, cpu_blocks=0, ssd_blocks=6)
    assert again.restore() == 2 and again.index.lookup(a) == {} and again.index.lookup(b) == {("ssd", ""): 2}
    again.close()


def test_ssd_blocks_of_another_layout_are_dropped_not_served(tmp_path):
    """A restart under another layout of the same format name (another dtype: bf16 then fp16, or
    fp32's twice the bytes) finds files of another size: dropped at restore, not fetched."""
    pc = cache(tmp_path, cpu_blocks=0, ssd_blocks=3)
    a = chain(1, 2)
    pc.store(a, rows(kv(2, 1)))
    pc.close()
    half = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
    other = PrefixCache(PrefixConfig(half, cpu_bytes=0, ssd_bytes=10**6, ssd_dir=tmp_path / "ssd"), clock=Clock())
    assert other.restore() == 0 and not any((tmp_path / "ssd").glob("*/*.kvb"))
    other.close()


def test_a_failing_ssd_write_drops_the_block_and_the_tier_goes_on(tmp_path, monkeypatch, caplog):
    """The SSD directory removed under a running kvpool is made again; a write that fails (a full
    disk) drops its block with a warning, and stores go on, without an exception to the caller."""
    import errno
    import shutil

    pc = cache(tmp_path, cpu_blocks=1, ssd_blocks=4)
    a, b, c = chain(1, 1), chain(2, 1), chain(3, 1)
    pc.store(a, rows(kv(1, 1)))
    shutil.rmtree(tmp_path / "ssd")
    assert pc.store(b, rows(kv(1, 2))) == (1, 0)  # a demoted into a directory made anew
    assert pc.index.lookup(a) == {("ssd", ""): 1} and pc.ssd.path(a[0]).exists()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(pc.ssd), "put", full)
    assert pc.store(c, rows(kv(1, 3))) == (1, 0)  # b's demotion failed: b is dropped, c stored
    assert pc.index.lookup(b) == {} and pc.index.lookup(c) == {("cpu", ""): 1} and pc.ssd_errors == 1
    assert "could not write a block" in caplog.text
    pc.close()


def test_imported_blocks_are_cache_hits_for_the_next_request_and_protect_the_chain():
    from llmbus.engine.block_manager import BlockManager
    from llmbus.engine.sampling_params import SamplingParams
    from llmbus.engine.sequence import Sequence

    bm = BlockManager(4, 4, model_id="m", kv_format="model")
    prompt = list(range(13))  # 3 full blocks + 1 token
    hashes = chain_hashes(root_hash("m", "model", "t"), prompt[:12], 4)
    assert bm.import_cached(hashes[:2]) == [0, 1] and bm.cached_prefix_blocks(hashes) == 2
    assert bm.import_cached(hashes[2:], protect=hashes[:2]) == [2]
    filler = Sequence("x", [999] * 4, SamplingParams())
    assert bm.allocate(filler, 4) and filler.block_table == [3]
    # no free block left: a further import may only evict blocks outside the protected chain
    assert bm.import_cached([b"\x02" * 16], protect=hashes) == []
    seq = Sequence("a", prompt, SamplingParams(), cache_salt="t")
    bm.free(filler)
    assert bm.allocate(seq, 1)
    assert (seq.block_table[:3], seq.num_computed_tokens, seq.num_cached_tokens) == ([0, 1, 2], 12, 12)
    other_tenant = Sequence("b", prompt, SamplingParams(), cache_salt="u")
    assert bm.cached_prefix_tokens(other_tenant) == 0

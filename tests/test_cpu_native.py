"""The fused CPU decode kernel (llmbus/kernels/cpu_decode.c via llmbus.kernels.cpu_native) against
``llmbus.kernels.reference.paged_decode_attention``: GQA 1/4/8, block sizes 16 and 32, head dims 64 and 128,
fp32 and bf16, odd, empty and single-token sequences, shuffled block tables; clear errors for bad
tables; the per-machine build cache and the torch fallback when the kernel is switched off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmbus.kernels import cpu_native, reference

ROOT = Path(__file__).resolve().parent.parent
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

needs_kernel = pytest.mark.skipif(not cpu_native.available(), reason="the fused CPU decode kernel did not build here")


def _case(lens: list[int], hq: int, hkv: int, d: int, bs: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    width = max(need + [1])
    n_blocks = sum(need) + 5
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n] + [0] * (width - n))
        at += n
    cache = torch.randn(2, n_blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The kernel gives a task all of a sequence's heads when batch >= 4 x threads, else one head:
    7 sequences take the first path on one thread, the second on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 32)])
def test_matches_the_reference(dtype, hq, hkv, d, bs, threads):
    lens = [0, 1, bs - 1, bs, bs + 1, 3 * bs + 5, 200]
    q, cache, tables, lens_t = _case(lens, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    got = cpu_native.paged_decode(q, cache, tables, lens_t, scale)
    want = reference.paged_decode_attention(q.float(), cache.float(), tables, lens_t, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.count_nonzero(got[0]) == 0  # no context: zeros, as the reference
    err = (got.float() - want).abs().max().item()
    assert err < TOL[dtype], f"max abs diff {err:.3g}"


@needs_kernel
def test_long_sequence_and_large_logits_stay_finite():
    """The running softmax rescales across 64 blocks; logits of +-60 must not overflow or lose mass."""
    q, cache, tables, lens = _case([1024 + 7, 3], 8, 2, 64, 16, torch.float32, seed=1)
    q = q * 8.0
    got = cpu_native.paged_decode(q, cache, tables, lens, 1.0)
    want = reference.paged_decode_attention(q, cache, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 1e-4


@needs_kernel
def test_bad_tables_and_shapes_raise_clear_errors():
    q, cache, tables, lens = _case([20, 5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_native.paged_decode(q, cache, torch.full_like(tables, cache.shape[1]), lens, 0.1)
    with pytest.raises(ValueError, match="sequence lengths must lie"):
        cpu_native.paged_decode(q, cache, tables, torch.tensor([33, 5], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="do not match"):
        cpu_native.paged_decode(q, cache, tables[:1], lens, 0.1)
    with pytest.raises(ValueError, match="unsupported decode"):
        cpu_native.paged_decode(q.half(), cache.half(), tables, lens, 0.1)
    assert not cpu_native.supports(torch.float32, 66, 2, 64, 16)  # 33 query heads per KV head
    assert not cpu_native.supports(torch.float32, 0, 2, 64, 16)
    with pytest.raises(ValueError, match="do not agree"):
        cpu_native.decode_into(torch.empty(2, 4, 32), q[:, :, :32].contiguous(), cache, tables, lens, 0.1)


def _python(code: str, data_dir: Path, **env) -> str:
    full = {**os.environ, "LLMBUS_DATA_DIR": str(data_dir), **env}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True,
                          check=True, timeout=300).stdout.strip()  # fmt: skip


@needs_kernel
def test_build_is_cached_per_machine_and_can_be_switched_off(tmp_path):
    probe = "from llmbus.kernels import cpu_native; print(cpu_native.available())"
    # what builds killed mid-compile left: one older than any build may take, one maybe still going
    (tmp_path / "native").mkdir()
    abandoned, recent = tmp_path / "native" / "tmpdead.so", tmp_path / "native" / "tmpbusy.so"
    abandoned.touch(), recent.touch()
    os.utime(abandoned, (1e9, 1e9))
    assert _python(probe, tmp_path) == "True"
    assert not abandoned.exists() and recent.exists()
    recent.unlink()
    built = sorted((tmp_path / "native").glob("cpu_decode-*.so"))
    assert len(built) == 1
    inode = built[0].stat().st_ino
    assert _python(probe, tmp_path) == "True"
    assert sorted((tmp_path / "native").glob("*")) == built and built[0].stat().st_ino == inode  # reused
    assert built[0].stat().st_mode & 0o044 == 0o044  # readable by other users of a shared data dir
    # switched off: the backend's default takes the gathered path; asking for the kernel is refused
    code = (
        "import torch\n"
        "from llmbus.kernels import cpu\n"
        "from llmbus.engine.attention import AttentionMetadata\n"
        "cache = torch.randn(2, 4, 16, 2, 64)\n"
        "q, k, v = torch.randn(1, 4, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64)\n"
        "meta = lambda: AttentionMetadata(torch.tensor([5]), torch.tensor([[1]], dtype=torch.int32),\n"
        "    torch.tensor([6], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1)\n"
        "m = meta(); cpu.CpuAttentionBackend().forward(q, k, v, cache, m, 0.1)\n"
        "print(m.backend_plans['cpu'].native is None)\n"
        "try:\n"
        "    cpu.CpuAttentionBackend(native=True).forward(q, k, v, cache, meta(), 0.1)\n"
        "except ValueError as exc:\n"
        "    print('refused' if 'did not build' in str(exc) else exc)\n"
    )
    assert _python(code, tmp_path / "off", LLMBUS_CPU_NATIVE="0").splitlines() == ["True", "refused"]
    assert not (tmp_path / "off" / "native").exists()


@needs_kernel
@pytest.mark.parametrize("d,bs,hkv,rows", [(256, 64, 1, 2), (96, 1, 3, 0), (16, 4, 2, 3)])
@pytest.mark.parametrize("size", ["step", "prefill"])  # prefill: calls large enough to split over the threads
def test_int4_write_matches_the_reference_on_random_calls(d, bs, hkv, rows, size):
    """Random calls, byte for byte: duplicate slots (the last write wins), tokens sealing blocks
    at random, tail slots of -1, no tail rows at all, head dims not a power of two."""
    from llmbus.kernels import kv_cache
    from llmbus.kv.formats import KVFormat
    from llmbus.kv.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype="bfloat16")
    blocks = 5 if size == "step" else 1200 // bs + 5
    caches = [kv_cache.allocate_cache(KVFormat("int4"), lay, blocks, "cpu", tail_rows=rows) for _ in range(2)]
    g = torch.Generator().manual_seed(d + bs + hkv)
    for _ in range(25 if size == "step" else 3):
        t = int(torch.randint(1, 2 * bs + 3, (1,), generator=g)) if size == "step" else 1200
        slots = torch.randint(0, blocks * bs, (t,), generator=g)
        slots[::3] = slots[0]  # duplicates
        k, v = (torch.randn(t, hkv, d, generator=g).bfloat16() * 3 for _ in range(2))
        tails = None
        if rows and size == "step":  # (random tail slots shared across a prefill's blocks: no call makes them)
            tails = torch.randint(0, rows, (t,), generator=g) * bs + slots % bs
            tails[torch.rand(t, generator=g) < 0.3] = -1
        assert cpu_native.write_int4(k, v, caches[0], slots, tails)
        reference.write_kv_cache(k, v, caches[1], slots, tails)
        for field in ("data", "k_meta", "v_meta", "k_tail", "v_tail"):
            assert (getattr(caches[0], field) is None and getattr(caches[1], field) is None) or torch.equal(
                getattr(caches[0], field), getattr(caches[1], field)), field


@needs_kernel
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_cache_matches_the_reference(dtype, scale_dtype, threads):
    """int8 entries times their per (token, head) scale, dequantized inside the kernel."""
    from llmbus.kernels import kv_cache
    from llmbus.kv.formats import KVFormat
    from llmbus.kv.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=str(dtype).removeprefix("torch."))
    lens = [0, 1, 15, 16, 17, 70, 129]
    _, _, tables, lens_t = _case(lens, 8, 2, 64, 16, dtype)
    n_blocks = int(tables.max()) + 1
    cache = kv_cache.allocate_cache(KVFormat("int8", scale_dtype), lay, n_blocks, "cpu")
    g = torch.Generator().manual_seed(4)
    slots = torch.tensor([lay.slot(tables[b].tolist(), t) for b, n in enumerate(lens) for t in range(n)])
    k, v = (torch.randn(len(slots), 2, 64, generator=g).to(dtype) for _ in range(2))
    reference.write_kv_cache(k, v, cache, slots)
    q = torch.randn(len(lens), 8, 64, generator=g).to(dtype)
    out = torch.empty_like(q)
    cpu_native.decode_int8_into(out, q, cache.data, cache.scale, tables, lens_t, 0.125)
    want = reference.paged_decode_attention_cache(q.float(), cache, tables, lens_t, 0.125)
    assert torch.count_nonzero(out[0]) == 0
    err = (out.float() - want.float()).abs().max().item()
    assert err < TOL[dtype], f"max abs diff {err:.3g}"
    with pytest.raises(ValueError, match="unsupported int8 decode"):
        cpu_native.decode_int8_into(out, q, cache.data.float(), cache.scale, tables, lens_t, 0.125)


@needs_kernel
@pytest.mark.parametrize("fmt,d,bs,hkv", [("int4", 64, 16, 4), ("int4", 128, 32, 2), ("int4", 16, 8, 1),
                                          ("int4", 96, 16, 2), ("int4", 256, 64, 1), ("int4r", 64, 16, 4),
                                          ("int4r", 128, 32, 2), ("int4r", 16, 8, 1)])
def test_int4_blocks_dequantize_as_the_reference(fmt, d, bs, hkv, threads, monkeypatch):
    """The C pass over INT4 blocks: full blocks per channel, partial ones per token, values per
    token, repeated and shuffled ids; equal to the reference up to fused multiply-adds. INT4R's
    blocks (every key per token, one pair a head) take the same pass, full or not."""
    from llmbus.kernels import kv_cache
    from llmbus.kv.formats import KVFormat
    from llmbus.kv.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype="bfloat16")
    cache = kv_cache.allocate_cache(KVFormat(fmt), lay, 12, "cpu")
    g = torch.Generator().manual_seed(d)
    n = 9 * bs + 3
    table = torch.randperm(12, generator=g)[:10]
    k = (torch.randn(n, hkv, d, generator=g) * torch.linspace(0.1, 6, d)).bfloat16()
    v = torch.randn(n, hkv, d, generator=g).bfloat16()
    reference.write_kv_cache(k, v, cache, torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(n)]))
    ids = torch.cat((table, table.flip(0)))
    full = torch.cat((torch.arange(10) < 9, torch.arange(10) > 0))
    want = reference.dequantize_blocks(cache, ids, full)

    def refuse(*args):
        raise AssertionError("the C pass fell back to the reference")

    with monkeypatch.context() as m:
        m.setattr(reference, "dequantize_blocks", refuse)
        got = cpu_native.dequantize_int4_blocks(cache, ids, full)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block ids must lie in"):
        cpu_native.dequantize_int4_blocks(cache, torch.tensor([12]), torch.tensor([True]))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,bs,hq,hkv", [(64, 16, 8, 2), (128, 32, 4, 4), (32, 8, 16, 2)])
@pytest.mark.parametrize("tails", [False, True], ids=["codes", "tail-rows"])
@pytest.mark.parametrize("fmt", ["int4", "int4r"])
def test_int4_cache_decodes_inside_the_kernel(fmt, dtype, d, bs, hq, hkv, tails, threads):
    """INT4 blocks widened inside the kernel: full blocks per channel, a partial last block per
    token or from its sequence's exact tail row; equal to the reference up to fused multiply-adds.
    INT4R: every block per token, the queries rounded to int8 as the reference rounds them."""
    from llmbus.kernels import kv_cache
    from llmbus.kv.formats import KVFormat
    from llmbus.kv.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=str(dtype).removeprefix("torch."))
    lens = [0, 1, bs - 1, bs, bs + 1, 3 * bs + 5, 130]
    _, _, tables, lens_t = _case(lens, hq, hkv, d, bs, dtype)
    cache = kv_cache.allocate_cache(KVFormat(fmt), lay, int(tables.max()) + 1, "cpu", tail_rows=8 if tails else 0)
    g = torch.Generator().manual_seed(d + bs)
    slots = torch.tensor([lay.slot(tables[b].tolist(), t) for b, n in enumerate(lens) for t in range(n)])
    k = (torch.randn(len(slots), hkv, d, generator=g) * torch.linspace(0.2, 4, d)).to(dtype)
    v = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
    reference.write_kv_cache(k, v, cache, slots)
    rows = None
    if tails:  # NOTE: rows unlike the codes, so reading the wrong one shows
        for tail in (cache.k_tail, cache.v_tail):
            tail.copy_(torch.randn(tail.shape, generator=g).to(dtype) * 2)
        rows = torch.tensor([-1, 3, 0, 5, -1, 7, 2], dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    got = cpu_native.paged_decode_int4(q, cache, tables, lens_t, d**-0.5, rows)
    want = reference.paged_decode_attention_cache(q, cache, tables, lens_t, d**-0.5, rows)
    assert got is not None and got.dtype == dtype and torch.count_nonzero(got[0]) == 0
    err = (got.float() - want.float()).abs().max().item()
    assert err < TOL[dtype], f"max abs diff {err:.3g}"
    if tails:
        plain = reference.paged_decode_attention_cache(q, cache, tables, lens_t, d**-0.5)
        assert ((want - plain).float().abs().amax(dim=(1, 2)) > 1e-2).tolist() == [
            False, True, True, False, False, True, True]
    assert cpu_native.paged_decode_int4(q.half(), cache, tables, lens_t, d**-0.5, rows) is None  # not its dtype


@needs_kernel
def test_int4_backend_decodes_in_the_kernel_and_bad_input_is_refused(monkeypatch):
    """The CPU backend's INT4 decode goes through the fused kernel (the dequantize-first pass is not
    called); ``LLMBUS_CPU_INT4_FUSED=0`` leaves it to that pass; tables, lengths and tail rows that
    do not fit raise clear errors, never a read past their ends."""
    from llmbus.kernels import kv_cache
    from llmbus.kernels.backends import CpuPagedAttentionBackend
    from llmbus.kv.formats import KVFormat
    from llmbus.kv.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    lens = [20, 33]
    _, _, tables, lens_t = _case(lens, 4, 2, 64, 16, torch.float32)
    cache = kv_cache.allocate_cache(KVFormat("int4"), lay, int(tables.max()) + 1, "cpu", tail_rows=2)
    g = torch.Generator().manual_seed(11)
    slots = torch.tensor([lay.slot(tables[b].tolist(), t) for b, n in enumerate(lens) for t in range(n)])
    reference.write_kv_cache(*(torch.randn(len(slots), 2, 64, generator=g) for _ in range(2)), cache, slots)
    q = torch.randn(2, 4, 64, generator=g)
    want = reference.paged_decode_attention_cache(q, cache, tables, lens_t, 0.125)

    def refuse(*args, **kwargs):
        raise AssertionError("the dequantize-first pass ran")

    monkeypatch.setattr(cpu_native, "dequantize_int4_blocks", refuse)
    got = CpuPagedAttentionBackend("int4")._decode(q, cache, tables, lens_t, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="do not match 2 queries"):
        cpu_native.paged_decode_int4(q, cache, tables[:1], lens_t[:1], 0.125)
    with pytest.raises(ValueError, match="tail_rows must be"):
        cpu_native.paged_decode_int4(q, cache, tables, lens_t, 0.125, torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_native.paged_decode_int4(q, cache, tables + cache.num_blocks, lens_t, 0.125)
    monkeypatch.setattr(cpu_native, "INT4_FUSED", False)
    assert cpu_native.paged_decode_int4(q, cache, tables, lens_t, 0.125) is None


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4", "int4r"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,bs,hkv", [(64, 16, 2), (128, 32, 1), (32, 8, 4)])
def test_int4_write_gives_the_references_bytes(fmt, dtype, d, bs, hkv):
    """The C INT4 write against reference.write_kv_cache, byte for byte: a prefill chunk that seals
    blocks and leaves one filling, then decode steps one token a sequence, sealing blocks from their
    tail rows (sequence 0), from their per-token codes (sequence 1, no row) and from a row some
    tokens of which this call overwrites (a chunk of 3 in sequence 2); values whose ranges vary a
    lot per channel and token, with ties and constant rows. INT4R: every key per token, nothing
    sealed, the same tail rows."""
    from llmbus.kernels import kv_cache
    from llmbus.kv.formats import KVFormat
    from llmbus.kv.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=str(dtype).removeprefix("torch."))
    caches = [kv_cache.allocate_cache(KVFormat(fmt), lay, 12, "cpu", tail_rows=3) for _ in range(2)]
    g = torch.Generator().manual_seed(d * bs)
    tables = [[3, 7, 1, 9], [0, 5, 11, 2], [4, 6, 8, 10]]
    lens = [bs + 3, 2 * bs - 2, 5]

    def rows(n, scale=1.0):
        x = torch.randn(n, hkv, d, generator=g) * torch.logspace(-2, 1, d) * scale
        x[:, :, 1] = 0.5  # a constant channel
        x[0, 0] = torch.round(x[0, 0] * 4) / 4  # exact ties
        return x.to(dtype)

    def step(seqs, counts, with_tails=(True, False, True)):
        slots, tails = [], []
        for s, n in zip(seqs, counts):
            for _ in range(n):
                slots.append(lay.slot(tables[s], lens[s]))
                tails.append(s * bs + lens[s] % bs if with_tails[s] else -1)
                lens[s] += 1
        k, v = rows(len(slots)), rows(len(slots), 3.0)
        slots, tails = torch.tensor(slots), torch.tensor(tails)
        assert cpu_native.write_int4(k, v, caches[0], slots, tails)
        reference.write_kv_cache(k, v, caches[1], slots, tails)
        for field in ("data", "k_meta", "v_meta", "k_tail", "v_tail"):
            assert torch.equal(getattr(caches[0], field), getattr(caches[1], field)), field

    prefill = list(lens)
    lens[:] = [0, 0, 0]
    step([0, 1, 2], prefill)
    for _ in range(bs + 2):
        step([0, 1], [1, 1])
    step([2], [3])
    for _ in range(bs):
        step([2], [1])
    with pytest.raises(ValueError, match="slots must lie in"):
        cpu_native.write_int4(*(rows(1) for _ in range(2)), caches[0], torch.tensor([12 * bs]))
    with pytest.raises(ValueError, match="tail slot"):
        cpu_native.write_int4(*(rows(1) for _ in range(2)), caches[0], torch.tensor([0]), torch.tensor([3 * bs]))


@needs_kernel
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [40, 600])  # 600: a prefill's write, split over the threads
def test_int8_write_gives_the_references_bytes(dtype, scale_dtype, tokens):
    """The C INT8 write against reference.write_kv_cache, byte for byte: rows of very different
    ranges, an all-zero row, exact ties, a scale that overflows fp16, a row holding a NaN."""
    from llmbus.kernels import kv_cache
    from llmbus.kv.formats import KVFormat
    from llmbus.kv.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=str(dtype).removeprefix("torch."))
    blocks = tokens // 16 + 6
    caches = [kv_cache.allocate_cache(KVFormat("int8", scale_dtype), lay, blocks, "cpu") for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    k = torch.randn(tokens, 2, 64, generator=g) * torch.logspace(-3, 2, tokens)[:, None, None]
    v = torch.randn(tokens, 2, 64, generator=g)
    k[3] = 0.0
    v[4] = torch.round(v[4] * 2) / 2
    k[5, 1, 7] = 1e7 if dtype == torch.float32 else 3e38
    v[6, 0, 9] = float("nan")
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(blocks * 16, generator=g)[:tokens]
    assert cpu_native.write_int8(k, v, caches[0], slots)
    reference.write_kv_cache(k, v, caches[1], slots)
    assert torch.equal(caches[0].data, caches[1].data)
    nan = caches[1].scale.isnan()
    assert nan.sum() == 1 and torch.equal(caches[0].scale.isnan(), nan)  # the NaN row's scale, as torch's amax
    assert torch.equal(caches[0].scale[~nan], caches[1].scale[~nan])
    with pytest.raises(ValueError, match="slots must lie in"):
        cpu_native.write_int8(k[:1], v[:1], caches[0], torch.tensor([blocks * 16]))


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4", "int4r"])
@pytest.mark.parametrize("tokens", [40, 600])  # 600: a prefill's write, split over the threads
def test_int4_write_of_non_finite_and_constant_rows_gives_the_references_bytes(fmt, tokens):
    """The vectorized INT4 write keeps the reference's edge cases, byte for byte: a NaN in a value
    group and in a sealed block's key channel (a NaN wins the range, so its codes are all 0), an
    infinity, constant and all-zero rows and blocks (scale 0), a key block whose channels span
    ranges from 1e-3 to 1e3, and tokens left in a filling block (keys per token)."""
    from llmbus.kernels import kv_cache
    from llmbus.kv.formats import KVFormat
    from llmbus.kv.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    blocks = tokens // 16 + 4
    caches = [kv_cache.allocate_cache(KVFormat(fmt), lay, blocks, "cpu", tail_rows=2) for _ in range(2)]
    g = torch.Generator().manual_seed(tokens)
    k = torch.randn(tokens, 2, 64, generator=g) * torch.logspace(-3, 3, 64)
    v = torch.randn(tokens, 2, 64, generator=g)
    k[16:32, 1] = 2.5  # a constant block of one head
    k[32:48] = 0.0  # an all-zero block
    k[3, 0, 5] = float("nan")  # in the first block: its head 0's ranges are NaN
    k[36, 1, 60] = float("inf")
    v[4, 0, 9] = float("nan")
    v[5, 1] = 0.0
    v[6, 0, 33] = float("-inf")
    slots = torch.arange(tokens)  # in order: full blocks sealed, the last one left filling
    assert cpu_native.write_int4(k, v, caches[0], slots)
    reference.write_kv_cache(k, v, caches[1], slots)
    assert torch.equal(caches[0].data, caches[1].data)
    assert torch.equal(caches[0].k_meta, caches[1].k_meta)
    assert torch.equal(caches[0].v_meta.view(torch.int16), caches[1].v_meta.view(torch.int16))  # NaN bits too


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [5, 3000])  # 3000: split over the threads
def test_round_query_gives_the_references_values(dtype, rows):
    """INT4R's query rounding in one C pass against quant_reference.round_query, bit for bit in
    fp32 and after the bf16 rounding the prefill kernel reads: rows of very different magnitudes,
    an all-zero row, exact ties (halves of a step), a row holding a NaN (all NaN out), one holding
    an infinity."""
    from llmbus.kernels import quant_reference as qr

    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, 4, 64, generator=g) * torch.logspace(-20, 20, rows)[:, None, None]
    q[1, 0] = 0.0
    q[1, 1] = torch.arange(64) - 31.5  # amax 31.5: codes at exact halves
    q[2, 2, 7] = float("nan")
    q[3, 3, 0] = float("inf")
    q = q.to(dtype)
    want = qr.round_query(q)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = cpu_native.round_query(q, out_dtype)
        assert got.dtype == out_dtype and got.shape == q.shape
        ref = want.to(out_dtype)
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got[~ref.isnan()], ref[~ref.isnan()])
    assert got[2, 2].isnan().all() and not got[2, 1].isnan().any()
    assert cpu_native.round_query(q.to(torch.float16), torch.float32) is None  # the reference's path serves


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotate_gives_the_references_bits(dtype):
    """INT4R's rotation in one C pass against quant_reference.rotate (the butterflies define it), bit
    for bit, at every power-of-two head dim up to 256 and in a prefill's many rows (split over the
    threads); a NaN spreads over its row only; other head dims are left to the reference."""
    from llmbus.kernels import quant_reference as qr

    g = torch.Generator().manual_seed(3)
    for d in (1, 2, 8, 64, 128, 256):
        for rows in (3, 4096):
            x = (torch.randn(rows, 2, d, generator=g) * torch.logspace(-3, 3, rows)[:, None, None]).to(dtype)
            if d == 64:
                x[1, 0, 5] = float("nan")
            got, want = cpu_native.rotate(x), qr.rotate(x)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])
            if d == 64:
                assert got[1, 0].isnan().all() and not got[1, 1].isnan().any() and not got[0].isnan().any()
    for bad in (torch.randn(3, 48), torch.randn(3, 512), torch.randn(3, 64).half()):
        assert cpu_native.rotate(bad) is None


# --- the element-wise fusions around the GEMMs (RMSNorm, SwiGLU) ------------------------------


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place (same-sign values)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_matches_torch_rounding_for_rounding(threads, rows):
    if not cpu_native.available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 3 * 768, generator=g) * 3).bfloat16()
    x = wide[:, 768 : 2 * 768]  # strided rows, as a slice of a wider activation
    w = (torch.rand(768, generator=g) + 0.5).bfloat16()
    got = cpu_native.rms_norm(x, w, 1e-6)
    want = _torch_rms_norm(x, w, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # NOTE: the sum of squares is added in another order than torch's; an intermediate that lands
    # on a rounding boundary may round the other way: one bf16 step, rarely two after the weight
    assert _ulps_apart(got, want) <= 2
    assert (got.float() - want.float()).abs().mean() < 1e-3


@pytest.mark.parametrize("rows", [1, 33])
def test_silu_mul_matches_torch(threads, rows):
    if not cpu_native.available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 2048, generator=g) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([0.0, -90.0, 90.0, float("inf")]).bfloat16()  # edges of the exp
    got = cpu_native.silu_mul(gate_up)
    gate, up = gate_up.clone().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate).mul_(up)
    assert got.shape == (rows, 2048)
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite())
    # one bf16 step (relative 2^-8) apart at most; values that underflow to ~0 differ only in
    # how tiny they are (the kernel's exp stops at e^-87)
    diff = (got[finite].float() - want[finite].float()).abs()
    assert bool((diff <= 2**-8 * want[finite].float().abs() + 1e-30).all()), diff.max()


def test_fusions_decline_what_they_do_not_cover():
    x = torch.randn(4, 64).half()
    assert cpu_native.rms_norm(x, torch.ones(64).half(), 1e-6) is None  # fp16: torch's ops
    assert cpu_native.rms_norm(x.float(), torch.ones(64).bfloat16(), 1e-6) is None  # weight of another dtype
    assert cpu_native.silu_mul(torch.randn(4, 64).bfloat16()[:, ::2]) is None  # not contiguous rows


def test_float32_fusions_match_the_torch_ops(threads):
    if not cpu_native.available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(33, 3 * 256, generator=g) * 3
    x = wide[:, 256:512]  # strided rows
    w = torch.rand(256, generator=g) + 0.5
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(cpu_native.rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(33, 2 * 512, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_native.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_bf16_model_with_fusions_matches_the_torch_ops(tmp_path):
    """The packed (CPU fast path) bf16 model with the fusions on, against the same model with them
    off: the same greedy tokens and logits within bf16 noise."""
    if not cpu_native.available():
        pytest.skip("no C compiler")
    from llmbus.engine.config import EngineConfig
    from llmbus.engine.engine import Engine
    from llmbus.engine.sampling_params import SamplingParams
    from llmbus.model.demo import make_demo_model

    model_dir = make_demo_model(tmp_path / "m", "small")
    engine = Engine.from_model_dir(str(model_dir), EngineConfig(dtype="bfloat16", device="cpu"))
    model = engine.model
    if not model.layers[0].mlp.packed:
        pytest.skip("oneDNN cannot pack bf16 on this CPU")
    norms = [model.norm] + [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    assert all(n.fused for n in norms)
    prompt = list(range(3, 40))

    def run(fused: bool):
        for n in norms:
            n.fused = fused
        engine.add_request(f"r{fused}", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        tokens = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
        return tokens, model.layers[0].mlp(x).float(), model.norm(x).float()

    with_tokens, with_mlp, with_norm = run(True)
    calls = []
    real = cpu_native.silu_mul
    try:  # the MLP's fusion off too: the torch ops decide it when the kernel declines
        cpu_native.silu_mul = lambda gu: calls.append(1)
        without_tokens, without_mlp, without_norm = run(False)
    finally:
        cpu_native.silu_mul = real
    assert calls, "the MLP should have asked for the fused SwiGLU"
    assert with_tokens == without_tokens
    assert (with_mlp - without_mlp).abs().max() <= 2 ** -6 * without_mlp.abs().max()
    assert (with_norm - without_norm).abs().max() <= 2 ** -6 * without_norm.abs().max()


def test_prefill_kernel_refuses_tables_outside_the_cache():
    if not cpu_native.prefill_supports(torch.bfloat16, 4, 2, 64, 16):
        pytest.skip("no C prefill kernel here (needs the bf16 dot instruction)")
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(20, 4, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_native.prefill_into(out, q, cache, i32([0, 4]), i32(0), i32(20), i32(20), 0.125)
    with pytest.raises(ValueError, match="lengths do not fit"):  # 40 tokens need 3 blocks, the table has 2
        cpu_native.prefill_into(out, q, cache, i32([0, 1]), i32(0), i32(20), i32(40), 0.125)
    with pytest.raises(ValueError, match="outside the step"):
        cpu_native.prefill_into(out, q, cache, i32([0, 1]), i32(5), i32(20), i32(20), 0.125)
    cpu_native.prefill_into(out, q, cache, i32([0, 1]), i32(0), i32(20), i32(20), 0.125)  # in range: runs
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("rows", [1, 300])
def test_rope_is_bit_identical_to_apply_rotary(threads, rows):
    if not cpu_native.available():
        pytest.skip("no C compiler")
    from llmbus.kernels.reference import rotary as apply_rotary
    from llmbus.model.rope import RotaryEmbedding
    from llmbus.model.rope_config import RopeConfig

    hq, hkv, d = 12, 4, 64
    g = torch.Generator().manual_seed(rows)
    qkv = (torch.randn(rows, (hq + 2 * hkv) * d, generator=g) * 3).bfloat16()
    x = qkv[:, : (hq + hkv) * d].view(rows, -1, d)  # strided rows: q and k of a fused projection
    cos, sin = RotaryEmbedding(RopeConfig(), d, 4096).cos_sin(torch.randint(0, 4000, (rows,), generator=g),
                                                              torch.bfloat16)  # fmt: skip
    got = cpu_native.rope(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, apply_rotary(x, cos, sin))
    # float32: the same rotation, up to a fused multiply-add's rounding
    x32, cos32, sin32 = x.float(), cos.float(), sin.float()
    torch.testing.assert_close(cpu_native.rope(x32, cos32, sin32), apply_rotary(x32, cos32, sin32), rtol=1e-6, atol=1e-6)
    assert cpu_native.rope(x.half(), cos.half(), sin.half()) is None  # fp16: torch's ops

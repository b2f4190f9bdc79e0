"""The fused CPU decode kernel (kernels/cpu_decode.c via kernels.cpu_native) against
``kernels.reference.paged_decode_attention``: GQA 1/4/8, block sizes 16 and 32, head dims 64 and 128,
fp32 and bf16, odd, empty and single-token sequences, shuffled block tables; clear errors for bad
tables; the per-machine build cache and the torch fallback when the kernel is switched off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_native, reference

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
    probe = "from kernels import cpu_native; print(cpu_native.available())"
    assert _python(probe, tmp_path) == "True"
    built = sorted((tmp_path / "native").glob("cpu_decode-*.so"))
    assert len(built) == 1
    inode = built[0].stat().st_ino
    assert _python(probe, tmp_path) == "True"
    assert sorted((tmp_path / "native").glob("*")) == built and built[0].stat().st_ino == inode  # reused
    assert built[0].stat().st_mode & 0o044 == 0o044  # readable by other users of a shared data dir
    # switched off: the backend's default takes the gathered path; asking for the kernel is refused
    code = (
        "import torch\n"
        "from kernels import cpu\n"
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
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_cache_matches_the_reference(dtype, scale_dtype, threads):
    """int8 entries times their per (token, head) scale, dequantized inside the kernel."""
    from kernels import kv_cache
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

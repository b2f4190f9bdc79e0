"""llmbus.kernels.cpu.CpuAttentionBackend against the pure-torch references in llmbus/kernels/reference.py, on
random paged caches: odd lengths, GQA 1/2/4, mixed decode+prefill batches, cached prefixes, and
single-token and empty sequences. Decodes run both ways: through the fused C kernel
(``llmbus.kernels.cpu_native``) and through the gathered torch path."""

from __future__ import annotations

import os

import pytest
import torch

from llmbus.kernels import cpu, cpu_native
from llmbus.engine.attention import AttentionMetadata, TorchAttentionBackend
from llmbus.kv.layout import KVLayout

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
# the fused kernel where it builds (a machine without a C compiler runs the torch path only)
DECODE_PATHS = [pytest.param(True, id="fused"), pytest.param(False, id="gathered")]


@pytest.fixture(params=DECODE_PATHS)
def native(request):
    if request.param and not cpu_native.available():
        pytest.skip("the fused CPU decode kernel did not build here")
    return request.param


def _step(lay: KVLayout, ctx: list[int], qlens: list[int], num_decodes: int, dtype, seed: int, hq: int):
    """A random cache already holding every sequence's prefix, this step's q/k/v and metadata.
    Blocks are handed out in a shuffled order so tables are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    need = [lay.num_blocks_for(c) for c in ctx]
    perm = (torch.randperm(sum(need) + 3, generator=g) + 1).tolist()  # block 0 stays as padding
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.randn(lay.cache_shape(len(perm) + 1), generator=g).to(dtype)
    # a decode with no context still has a row to write: it goes to the padding block 0
    slots = sum((lay.slot_mapping(t, c - q, c) if c else [0] * q for t, c, q in zip(tables, ctx, qlens)), [])
    width = max([len(t) for t in tables] + [1])
    t = sum(qlens)
    h, d = lay.num_kv_heads, lay.head_dim
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k, v = torch.randn(t, h, d, generator=g).to(dtype), torch.randn(t, h, d, generator=g).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([tb + [0] * (width - len(tb)) for tb in tables], dtype=torch.int32),
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32),
        num_decodes=num_decodes,
    )
    return cache, q, k, v, meta


def _check(lay, ctx, qlens, nd, dtype=torch.float32, hq=None, seed=0, backend=None):
    hq = hq or lay.num_kv_heads
    cache, q, k, v, meta = _step(lay, ctx, qlens, nd, dtype, seed, hq)
    ref_cache = cache.clone()
    scale = lay.head_dim**-0.5
    want = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale)
    got = (backend or cpu.CpuAttentionBackend()).forward(q, k, v, cache, meta, scale)
    assert torch.equal(cache, ref_cache), "the KV write differs from reference.write_kv"
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    assert err < TOL[dtype], f"max abs diff {err:.3g}"
    return got, meta


@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_batch_matches_reference(group, native):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16)
    ctx = [1, 15, 16, 17, 33, 100, 47]
    _, meta = _check(lay, ctx, [1] * len(ctx), len(ctx), hq=2 * group, backend=cpu.CpuAttentionBackend(native=native))
    plan = meta.backend_plans["cpu"]
    assert (plan.native is not None, bool(plan.decode_groups)) == (native, not native)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_chunks_with_and_without_prefix(group):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, block_size=8)
    # whole prompts (no prefix), chunks after a cached prefix, a single-token chunk
    _check(lay, [5, 40, 23, 9, 64], [5, 13, 23, 1, 30], 0, hq=2 * group, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_batch_decodes_then_prefills(dtype, native):
    lay = KVLayout(num_layers=1, num_kv_heads=4, head_dim=64, block_size=16, dtype=str(dtype).removeprefix("torch."))
    # fp16 has no fused kernel: asked for, it is refused; by default the gathered path serves
    backend = cpu.CpuAttentionBackend(native=None if native and dtype == torch.float16 else native)
    _check(lay, [7, 31, 64, 129, 50, 18], [1, 1, 1, 37, 50, 2], 3, dtype=dtype, hq=8, seed=2, backend=backend)
    if native and dtype == torch.float16:
        with pytest.raises(ValueError, match="fused CPU decode kernel"):
            _check(lay, [7, 31], [1, 1], 2, dtype=dtype, hq=8, backend=cpu.CpuAttentionBackend(native=True))


def test_many_decodes_split_into_groups():
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16)
    ctx = [300 + 7 * i for i in range(12)]
    # 1 KiB of K+V per token: a 1 MiB budget holds two or three ~380-token sequences per group
    backend = cpu.CpuAttentionBackend(decode_group_bytes=1 << 20, native=False)
    _, meta = _check(lay, ctx, [1] * len(ctx), len(ctx), hq=4, seed=3, backend=backend)
    groups = meta.backend_plans["cpu"].decode_groups
    assert len(groups) >= 4
    assert [(g.start, g.end) for g in groups] == list(zip([0] + [g.end for g in groups[:-1]], [g.end for g in groups]))
    assert groups[-1].end == len(ctx)
    with pytest.raises(ValueError, match="decode_group_bytes"):
        cpu.CpuAttentionBackend(decode_group_bytes=0)


def test_empty_sequences_give_zeros_and_no_rows(native):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, block_size=8)
    # a decode with no context yields zeros (as the reference); a prefill entry with no query rows
    got, _ = _check(lay, [0, 9, 12, 20], [1, 1, 0, 4], 2, hq=4, seed=4, backend=cpu.CpuAttentionBackend(native=native))
    assert torch.count_nonzero(got[0]) == 0


def test_plan_is_built_once_per_step_and_reused_across_layers(native):
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8)
    backend = cpu.CpuAttentionBackend(native=native)
    cache, q, k, v, meta = _step(lay, [9, 20], [1, 20], 1, torch.float32, 5, 4)
    caches = [cache.clone() for _ in range(lay.num_layers)]
    outs = []
    for c in caches:
        outs.append(backend.forward(q, k, v, c, meta, 0.25))
        assert len(meta.backend_plans) == 1
    plan = meta.backend_plans["cpu"]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    assert meta.backend_plans["cpu"] is plan


def test_blocks_round_trip_as_the_reference_backend_bytes():
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4)
    ours, ref = cpu.CpuAttentionBackend(), TorchAttentionBackend()
    cache = ours.allocate_cache(lay, 6, torch.device("cpu"))[0]
    cache.copy_(torch.randn(cache.shape))
    ids = torch.tensor([4, 1])
    data = ours.read_blocks(cache, ids)
    assert torch.equal(data, ref.read_blocks(cache, ids))
    other = ref.allocate_cache(lay, 6, torch.device("cpu"))[0]
    ours.write_blocks(other, torch.tensor([0, 2]), data)
    assert torch.equal(other[:, 0], cache[:, 4]) and torch.equal(other[:, 2], cache[:, 1])
    with pytest.raises(ValueError, match="block ids"):
        ours.read_blocks(cache, torch.tensor([6]))
    with pytest.raises(ValueError, match="expects uint8"):
        ours.write_blocks(other, torch.tensor([0]), data)


def test_bad_inputs_raise_clear_errors():
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, block_size=8)
    backend = cpu.CpuAttentionBackend()
    cache, q, k, v, meta = _step(lay, [9, 12], [1, 4], 1, torch.float32, 6, 4)
    with pytest.raises(ValueError, match="model dtype"):
        backend.forward(q.double(), k, v, cache, meta, 0.25)
    with pytest.raises(ValueError, match="multiple"):
        backend.forward(q[:, :3], k, v, cache, meta, 0.25)
    with pytest.raises(ValueError, match="raw"):
        backend.forward(q, k, v, [cache], meta, 0.25)
    bad = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, num_decodes=2)
    with pytest.raises(ValueError, match="exactly one query token"):
        backend.forward(q, k, v, cache, bad, 0.25)
    with pytest.raises(ValueError, match="num_blocks"):
        backend.allocate_cache(lay, 0, torch.device("cpu"))



@pytest.fixture(params=[pytest.param(True, id="tiles"), pytest.param(False, id="avx512")])
def tiles(request):
    """The C prefill kernel on AMX's tiles (where the CPU has them), then with them off."""
    if request.param and not cpu_native.has_amx_bf16():
        pytest.skip("no AMX-BF16 here (or not granted)")
    cpu_native.set_amx(request.param)
    yield request.param
    cpu_native.set_amx(os.environ.get("LLMBUS_CPU_AMX", "1") != "0")


@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (3, 64, 16), (4, 128, 32), (8, 64, 32),
                                                       (3, 96, 32), (5, 32, 16)])
def test_bf16_prefill_kernel_matches_reference(group, head_dim, block_size, tiles):
    """The C prefill kernel (bf16): whole prompts, chunks after a cached prefix, a single-token
    chunk, a long prompt over many blocks; against the reference computed in fp32. Slots no
    sequence's context covers hold NaN (a reused block's stale bytes may be anything)."""
    if not cpu_native.prefill_supports(torch.bfloat16, 2 * group, 2, head_dim, block_size):
        pytest.skip("no C prefill kernel here (needs the bf16 dot instruction)")
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype="bfloat16")
    ctx, qlens = [5, 40, 23, 1, 64, 1031, 2, 47], [5, 13, 23, 1, 30, 1031, 1, 47]
    cache, q, k, v, meta = _step(lay, ctx, qlens, 0, torch.bfloat16, group, 2 * group)
    scale = head_dim**-0.5
    want = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), cache.float(), meta, scale)
    stale = torch.ones(cache.shape[1] * block_size, dtype=torch.bool)  # slots past every context
    for table, n in zip(meta.block_tables.tolist(), ctx):
        for i in range(n):
            stale[table[i // block_size] * block_size + i % block_size] = False
    cache.view(2, -1, *cache.shape[3:])[:, stale] = float("nan")
    backend = cpu.CpuAttentionBackend(native=True)
    got = backend.forward(q, k, v, cache, meta, scale)
    assert not got.isnan().any()
    plan = meta.backend_plans["cpu"]
    assert plan.native_prefills is not None and not plan.prefills
    # bf16 output and weights rounded to bf16 for the second product: ~2^-8 of the values
    err = (got.float() - want).abs()
    assert err.max().item() <= 2**-6 * want.abs().max().item(), err.max().item()
    assert err.mean().item() <= 2**-9 * want.abs().mean().item() * 4


def test_prefill_kernel_is_not_used_when_the_fused_path_is_off():
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    _, meta = _check(lay, [40, 23], [13, 23], 0, dtype=torch.bfloat16, hq=4, backend=cpu.CpuAttentionBackend(native=False))
    plan = meta.backend_plans["cpu"]
    assert plan.native_prefills is None and len(plan.prefills) == 2

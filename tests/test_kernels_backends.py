"""Attention backends: Triton, the torch references and the CPU engine's quantized-cache backend agree
step by step through the AttentionBackend protocol."""

import pytest
import torch

from llmbus.kernels import cpu_native  # noqa: E402
from llmbus.kernels import reference  # noqa: E402
from llmbus.kernels.backends import (  # noqa: E402
    CpuPagedAttentionBackend, TorchPagedAttentionBackend, TritonAttentionBackend, make_attention_backend)
from llmbus.engine.attention import AttentionMetadata, build_attention_metadata  # noqa: E402
from llmbus.engine.runner import TailRows  # noqa: E402
from llmbus.kv.layout import KVLayout  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _meta(lay, tables, ctx, qlens, num_decodes, device=DEV):
    slots = sum((lay.slot_mapping(t, c - q, c) for t, c, q in zip(tables, ctx, qlens)), [])
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=device),
        num_decodes=num_decodes,
    )


def _agree_over_steps(first, second, dtype: str = "float32", atol: float = 2e-5, device: str = DEV,
                      tails: bool = False, head_dim: int = 32):
    """Both backends through the same three steps on their own caches; returns the caches.
    ``tails``: with tail rows, given out as the engine does."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype)
    n = 4 if tails else 0
    ca, cb = first.allocate_cache(lay, 8, device, n)[0], second.allocate_cache(lay, 8, device, n)[0]
    rows = TailRows(n) if tails else None
    tables = [[3, 5, 0], [6, 1]]
    g = torch.Generator().manual_seed(3)
    # step 1: two prefill chunks; step 2: seq 0 decodes while seq 1 prefills more; step 3: both decode
    plan = [([14, 20], [14, 20], 0), ([15, 31], [1, 11], 1), ([16, 32], [1, 1], 2)]
    for ctx, qlens, nd in plan:
        t = sum(qlens)
        q = torch.randn(t, 4, head_dim, generator=g).to(device, getattr(torch, dtype))
        k = torch.randn(t, 2, head_dim, generator=g).to(device, getattr(torch, dtype))
        v = torch.randn(t, 2, head_dim, generator=g).to(device, getattr(torch, dtype))
        meta = _meta(lay, tables, ctx, qlens, nd, device)
        if tails:
            pairs = [rows.rows_for(str(i), c - ql, ql, 16)[:2] for i, (c, ql) in enumerate(zip(ctx, qlens))]
            entries = [(t, c - ql, ql) for t, c, ql in zip(tables, ctx, qlens)]
            meta = build_attention_metadata(entries, 16, device, pairs)[0]
        a = first.forward(q, k, v, ca, meta, 0.2)
        b = second.forward(q, k, v, cb, meta, 0.2)
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=1e-3)
    return ca, cb


@pytest.mark.parametrize("fmt,head_dim,tails", [("model", 32, False), ("int8", 32, False), ("int4", 32, False),
                                                ("int8", 64, False), ("int4", 64, True), ("int4r", 64, True),
                                                ("int4r", 32, False)])
def test_triton_and_torch_backends_agree_over_steps(fmt, head_dim, tails):
    """From 64 channels the Triton decode and prefill run their words / lanes loops."""
    tri, tor = TritonAttentionBackend(fmt), TorchPagedAttentionBackend(fmt)
    ca, cb = _agree_over_steps(tri, tor, atol=1e-3 if fmt.startswith("int4") else 2e-5, tails=tails, head_dim=head_dim)
    # the handoff bytes move between backends
    blocks = tri.read_blocks(ca, [3, 5])
    tor.write_blocks(cb, [2, 4], blocks)
    assert torch.equal(tor.read_blocks(cb, [2, 4]), blocks)


@pytest.mark.parametrize("fmt,head_dim,tails", [("model", 32, False), ("int8", 64, False), ("int4", 64, True),
                                                ("int4r", 64, True)])
def test_triton_backend_over_head_major_caches_as_on_cuda(fmt, head_dim, tails, monkeypatch):
    """The engine's caches on CUDA are head-major (backends.head_major): the Triton backend writes,
    prefills and decodes over them as the reference does, through the same three steps."""
    from llmbus.kernels import backends

    monkeypatch.setattr(backends, "HEAD_MAJOR", True)
    tri, tor = TritonAttentionBackend(fmt), TorchPagedAttentionBackend(fmt)
    ca, cb = _agree_over_steps(tri, tor, atol=1e-3 if fmt.startswith("int4") else 2e-5, tails=tails, head_dim=head_dim)
    assert not ca.data.is_contiguous() and ca.data.stride(3) > ca.data.stride(2)  # a block's heads apart


@pytest.mark.parametrize("fmt,head_dim,tails", [("model", 32, False), ("int8", 64, False), ("int4", 64, True),
                                                ("int4", 32, False), ("int4r", 64, True)])
def test_triton_backend_takes_q_k_v_as_views_of_the_qkv_projection(fmt, head_dim, tails):
    """The model hands attention q, k and v as strided views of one qkv row per token (no copies);
    the Triton kernels read them by stride and agree with the reference fed contiguous copies."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype="float32")
    tri, tor = TritonAttentionBackend(fmt), TorchPagedAttentionBackend(fmt)
    n = 4 if tails else 0
    ca, cb = tri.allocate_cache(lay, 8, DEV, n)[0], tor.allocate_cache(lay, 8, DEV, n)[0]
    rows = TailRows(n) if tails else None
    tables = [[3, 5, 0], [6, 1]]
    g = torch.Generator().manual_seed(5)
    for ctx, qlens, nd in [([14, 20], [14, 20], 0), ([15, 31], [1, 11], 1), ([16, 32], [1, 1], 2)]:
        qkv = torch.randn(sum(qlens), 4 + 2 + 2, head_dim, generator=g).to(DEV)
        q, k, v = qkv.split([4, 2, 2], dim=1)
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
        entries = [(t, c - ql, ql) for t, c, ql in zip(tables, ctx, qlens)]
        pairs = [rows.rows_for(str(i), c - ql, ql, 16)[:2] for i, (c, ql) in enumerate(zip(ctx, qlens))] if tails else None
        meta = build_attention_metadata(entries, 16, DEV, pairs)[0]
        a = tri.forward(q, k, v, ca, meta, 0.2)
        b = tor.forward(q.contiguous(), k.contiguous(), v.contiguous(), cb, meta, 0.2)
        torch.testing.assert_close(a, b, atol=1e-3 if fmt.startswith("int4") else 2e-5, rtol=1e-3)


@pytest.mark.parametrize("backend", [TorchPagedAttentionBackend, CpuPagedAttentionBackend, TritonAttentionBackend])
def test_int4r_backends_rotate_queries_and_keys(backend):
    """INT4R: a backend stores each key rotated by the Hadamard matrix (per-token codes of ``k H``, not
    of ``k``) and rotates the queries that meet them, in a prefill and in the decodes after it, so
    attention is that over the keys themselves, within INT4's error; an outlier channel, which
    per-token codes of unrotated keys would spread over every channel's step, costs little."""
    from llmbus.kernels import quant_reference as qr

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    be = backend("int4r")
    cache = be.allocate_cache(lay, 4, DEV, 2)[0]
    rows = TailRows(2)
    g = torch.Generator().manual_seed(11)
    n = 43  # a prefill of 40, then three decodes (the last two from the tail row)
    q, k, v = (torch.randn(n, h, 64, generator=g).to(DEV) for h in (4, 2, 2))
    k[..., 5] += 25.0  # an outlier channel
    table = [2, 0, 3]

    def attend(keys, values, start, end):  # exact attention of rows [start, end) over keys [0, end)
        kv = torch.stack((keys[:end], values[:end]))[:, None]  # one block of end tokens
        return reference.paged_prefill_attention(
            q[start:end], kv, torch.zeros(1, 1, dtype=torch.int32, device=DEV),
            torch.tensor([end], dtype=torch.int32, device=DEV),
            torch.tensor([0, end - start], dtype=torch.int32, device=DEV), 0.125)

    plain = qr.int4_group_dequantize(*qr.int4_group_quantize(k, 64), 64)  # keys' codes without rotation
    errs, unrotated = [], []
    for start, end in [(0, 40), (40, 41), (41, 42), (42, 43)]:
        meta = build_attention_metadata([(table, start, end - start)], 16, DEV,
                                        [rows.rows_for("s", start, end - start, 16)[:2]])[0]
        out = be.forward(q[start:end], k[start:end], v[start:end], cache, meta, 0.125)
        stored = reference.dequantize_blocks(cache, torch.tensor(table, device=DEV),
                                             torch.tensor([True, True, False], device=DEV)).flatten(1, 2)[:, :end]
        exact = attend(k, v, start, end)
        errs.append((out - exact).abs().mean())
        # the same values, keys' codes without rotation: the outlier's range swamps the rest
        unrotated.append((attend(plain, stored[1], start, end) - exact).abs().mean())
    rotated = qr.rotate(k)
    step = (rotated.amax(-1) - rotated.amin(-1)) / 15
    assert ((stored[0] - rotated).abs().amax(-1) <= step / 2 * 1.01 + 1e-3).all()
    assert (qr.rotate(stored[0]) - k).abs().mean() < 0.2 < (stored[0] - k).abs().mean()
    # the filling block's tail row holds the rotated keys themselves
    row = rows.rows_for("s", 43, 1, 16)[0]
    torch.testing.assert_close(cache.k_tail[row * 16 : row * 16 + 11], rotated[32:43], atol=1e-5, rtol=0)
    assert all(e < 0.5 * u for e, u in zip(errs, unrotated)), (errs, unrotated)


@pytest.mark.skipif(not cpu_native.available(), reason="the fused CPU decode kernel did not build here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4r"])
def test_cpu_backend_decodes_quantized_caches_as_the_reference(fmt, dtype):
    """The CPU engine's backend for int8/int4 (dequantized inside the fused kernel; int4r's blocks
    dequantized in C, its queries rounded to int8 as the reference rounds them) against the
    reference, with identical cache bytes after every step."""
    ours, ref = CpuPagedAttentionBackend(fmt), TorchPagedAttentionBackend(fmt)
    ca, cb = _agree_over_steps(ours, ref, dtype, atol=2e-2 if dtype == "bfloat16" else 2e-5, device="cpu")
    assert torch.equal(ours.read_blocks(ca, [3, 5, 6, 1]), ref.read_blocks(cb, [3, 5, 6, 1]))


def test_caches_are_head_major_on_cuda_token_major_elsewhere_unless_forced(monkeypatch):
    """The engine's caches are head-major on CUDA (decode read INT4R's 1.7x as fast so on the H200)
    and token-major elsewhere (the CPU fast paths need them); LLMBUS_KV_HEAD_MAJOR forces either."""
    from llmbus.kernels import backends

    monkeypatch.setattr(backends, "HEAD_MAJOR", None)
    assert backends.head_major("cuda") and backends.head_major(torch.device("cuda", 1))
    assert not backends.head_major("cpu")
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    caches = TorchPagedAttentionBackend("int8").allocate_cache(lay, 4, "cpu")
    assert len(caches) == 2 and all(c.data.is_contiguous() for c in caches)
    for forced in (False, True):
        monkeypatch.setattr(backends, "HEAD_MAJOR", forced)
        assert backends.head_major("cuda") is forced and backends.head_major("cpu") is forced
    cache = TorchPagedAttentionBackend("int8").allocate_cache(lay, 4, "cpu")[0]
    assert not cache.data.is_contiguous() and cache.data.stride(3) > cache.data.stride(2)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_cpu_backend_over_head_major_caches(fmt, monkeypatch):
    """Head-major caches (llmbus.kernels.backends.HEAD_MAJOR) on the CPU backend: the reference's results
    and bytes, and no C kernel handed the cache itself (INT8's fused decode would copy the whole
    layer cache to make it contiguous, every layer and step)."""
    from llmbus.kernels import backends

    if not cpu_native.available():
        pytest.skip("the native CPU library did not build")
    monkeypatch.setattr(backends, "HEAD_MAJOR", True)

    def refuse(*args, **kwargs):
        raise AssertionError("the fused INT8 decode got a head-major cache")

    monkeypatch.setattr(cpu_native, "decode_int8_into", refuse)
    ours, ref = CpuPagedAttentionBackend(fmt), TorchPagedAttentionBackend(fmt)
    ca, cb = _agree_over_steps(ours, ref, device="cpu", head_dim=64)
    assert ca.data.stride(3) > ca.data.stride(2)
    assert torch.equal(ours.read_blocks(ca, [3, 5, 6, 1]), ref.read_blocks(cb, [3, 5, 6, 1]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4r"])
def test_cpu_backend_prefills_quantized_caches_without_the_reference(fmt, dtype, monkeypatch):
    """Prefill chunks over int8/int4 caches (a fresh prompt, one after a cached prefix, then
    decodes) over their context dequantized once: bf16 through the C prefill kernel (where the CPU
    has the bf16 dot instruction), fp32 and fp16 through SDPA in fp32; never the reference's padded
    score matrices."""
    def refuse(*args, **kwargs):
        raise AssertionError("the reference prefill ran")

    prefill = reference.paged_prefill_attention_cache

    class Reference(TorchPagedAttentionBackend):  # the other side still runs it
        @staticmethod
        def _prefill(q, cache, tables, lens, qsl, scale, tail_rows=None, max_query_len=None, chunk=None):
            return prefill(q, cache, tables, lens, qsl, scale, tail_rows, chunk)

    monkeypatch.setattr(reference, "paged_prefill_attention_cache", refuse)
    _agree_over_steps(CpuPagedAttentionBackend(fmt), Reference(fmt), dtype,
                      atol={"bfloat16": 2e-2, "float16": 2e-3}.get(dtype, 2e-5), device="cpu", tails=fmt != "int8")


@pytest.mark.parametrize("dtype,path", [("float32", "sdpa"), ("bfloat16", "sdpa"), ("bfloat16", "c-kernel")])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_cpu_backend_prefill_matches_the_reference_and_ignores_bytes_past_the_end(fmt, dtype, path, monkeypatch):
    """Prefill over a quantized cache against the reference: chunks after a cached prefix, a fresh
    prompt, a zero-length chunk, GQA 4; slots past each sequence's end hold NaN metadata, which
    must not reach the output. ``sdpa``: bf16 as on a CPU without the bf16 dot instruction."""
    from llmbus.kernels.kv_cache import allocate_cache
    from llmbus.kv.formats import KVFormat

    if path == "sdpa":
        monkeypatch.setattr(cpu_native, "has_bf16_dot", lambda: False)
    elif not (cpu_native.available() and cpu_native.has_bf16_dot()):
        pytest.skip("the C prefill kernel needs the bf16 dot instruction, which this CPU lacks")
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    cache = allocate_cache(KVFormat(fmt), lay, 12, "cpu")
    tables = torch.tensor([[3, 5, 0, 7], [6, 1, 0, 0], [2, 4, 0, 0], [8, 9, 10, 0]], dtype=torch.int32)
    ctx, qlens = [45, 20, 9, 33], [13, 20, 0, 5]
    g = torch.Generator().manual_seed(21)
    slots = torch.tensor([lay.slot(tables[b].tolist(), t) for b, n in enumerate(ctx) for t in range(n)])
    k, v = (torch.randn(len(slots), 2, 64, generator=g).to(getattr(torch, dtype)) for _ in range(2))
    reference.write_kv_cache(k, v, cache, slots)
    for b, n in enumerate(ctx):  # NOTE: poison the slots past each end
        blk, off = int(tables[b, n // 16]), n % 16
        if fmt == "int8":
            cache.scale[:, blk, off:] = float("nan")
        else:
            cache.v_meta[blk, off:] = float("nan")
            cache.k_meta[blk, :, 2 * off * (64 // KVFormat.key_group(64, 16)):] = 0x7E00  # NaN fp16 bits
    q = torch.randn(sum(qlens), 8, 64, generator=g).to(getattr(torch, dtype))
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(ctx, dtype=torch.int32)
    ends = torch.tensor(ctx).cumsum(0).tolist()
    chunk = tuple(torch.cat([x[e - ql : e] for e, ql in zip(ends, qlens)]) for x in (k, v))
    want = reference.paged_prefill_attention_cache(q, cache, tables, sl, qsl, 0.125, chunk=chunk)
    got = CpuPagedAttentionBackend(fmt)._prefill(q, cache, tables, sl, qsl, 0.125, chunk=chunk)
    assert torch.isfinite(got.float()).all()
    tol = 2e-2 if path == "c-kernel" else 2e-5 if dtype == "float32" else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backends_agree_with_int4_tail_rows(dtype):
    """Triton, the references and the CPU backend, each writing and reading the rows itself."""
    tol = 2e-2 if dtype == "bfloat16" else 1e-3
    tri, tor, cpu = TritonAttentionBackend("int4"), TorchPagedAttentionBackend("int4"), CpuPagedAttentionBackend("int4")
    ca, cb = _agree_over_steps(tri, tor, dtype, atol=tol, tails=True)
    assert torch.equal(ca.k_tail, cb.k_tail) and ca.k_tail.abs().sum() > 0
    assert torch.equal(ca.v_tail, cb.v_tail) and ca.v_tail.abs().sum() > 0
    cc, cd = _agree_over_steps(cpu, tor, dtype, atol=tol, device="cpu", tails=True)
    assert torch.equal(cc.k_tail, cd.k_tail) and torch.equal(cc.v_tail, cd.v_tail)
    plain, _ = _agree_over_steps(tor, tor, dtype, device="cpu")
    assert not torch.equal(plain.data, cd.data)  # sealed from exact keys: other bytes


def test_make_attention_backend_choices_and_errors():
    cpu = make_attention_backend("cpu", "int4")
    assert isinstance(cpu, CpuPagedAttentionBackend) and cpu.kv_format.name == "int4"
    with pytest.raises(ValueError, match="unknown KV format"):
        make_attention_backend("cpu", "int3")
    with pytest.raises(ValueError, match="unsupported device"):
        make_attention_backend("meta", "model")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            make_attention_backend("cuda", "int8")
    else:
        assert isinstance(make_attention_backend("cuda", "int8"), TritonAttentionBackend)


@pytest.mark.parametrize("backend", [TorchPagedAttentionBackend, CpuPagedAttentionBackend, TritonAttentionBackend])
def test_backends_attend_to_a_filling_blocks_exact_kv_through_the_metadata(backend):
    """Engine-shaped steps (TailRows + build_attention_metadata), one of which seals a block from
    a row and starts the next in the other: every query's output equals attention over the full
    blocks as stored and the filling block's exact keys and values (a prefill chunk's over its own
    keys and values as computed, whichever blocks they fill)."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")
    be = backend("int4")
    dev = DEV if backend is TritonAttentionBackend else "cpu"  # NOTE: the others are CPU-only or torch
    cache = be.allocate_cache(lay, 8, dev, 4)[0]
    rows = TailRows(4)
    tables = [[3, 5, 0], [6, 1, 2]]
    g = torch.Generator().manual_seed(7)
    keys = [torch.randn(40, 2, 32, generator=g) * 2 for _ in tables]
    values = [torch.randn(40, 2, 32, generator=g) for _ in tables]
    done = [0, 0]
    # (seq, new tokens) per step, decodes first; step 2's chunk of seq 0 seals block 0 from its
    # row and starts block 1 in the other
    for step in ([(0, 5), (1, 20)], [(1, 1), (0, 20)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]):
        pairs = [rows.rows_for(str(i), done[i], n, 16)[:2] for i, n in step]
        meta, _ = build_attention_metadata([(tables[i], done[i], n) for i, n in step], 16, dev, pairs)
        k = torch.cat([keys[i][done[i] : done[i] + n] for i, n in step])
        v = torch.cat([values[i][done[i] : done[i] + n] for i, n in step])
        q = torch.randn(k.shape[0], 4, 32, generator=g)
        out = be.forward(q.to(dev), k.to(dev), v.to(dev), cache, meta, 0.2).cpu()
        row = 0
        for i, n in step:
            end = done[i] + n
            nblk = -(-end // 16)
            full = torch.tensor([(j + 1) * 16 <= end for j in range(nblk)])
            kv = reference.dequantize_blocks(cache, torch.tensor(tables[i][:nblk], device=dev), full.to(dev))
            kv = kv.cpu().flatten(1, 2)[:, :end]
            cut = end // 16 * 16  # the filling block exact, and a prefill chunk's own positions
            if n > 1:
                cut = min(cut, done[i])
            kk, vv = torch.cat((kv[0, :cut], keys[i][cut:end])), torch.cat((kv[1, :cut], values[i][cut:end]))
            mask = (torch.arange(end)[None, :] <= torch.arange(done[i], end)[:, None])[None, None]
            want = reference._attend(q[row : row + n].transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                     vv.transpose(0, 1)[None], mask, 0.2)[0].transpose(0, 1)
            torch.testing.assert_close(out[row : row + n], want, atol=2e-5, rtol=1e-4)
            row += n
            done[i] = end
    assert pairs[0] != pairs[1]  # the sequences hold their own rows


def test_context_table_names_each_sequences_blocks_in_turn():
    """The table both context builders share (the quantized read-back and fresh prompts' chunks)."""
    starts, table = reference.context_table(torch.tensor([2, 0, 3]))
    assert starts.tolist() == [0, 2, 2]
    assert table.dtype == torch.int32 and table.tolist() == [[0, 1, 0], [0, 0, 0], [2, 3, 4]]
    starts, table = reference.context_table(torch.tensor([0, 0]))  # all empty: zeros, one column
    assert starts.tolist() == [0, 0] and table.tolist() == [[0], [0]]
    assert reference.context_table(torch.zeros(0, dtype=torch.int64))[1].shape == (0, 1)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dequantized_context_holds_each_sequences_own_blocks(fmt):
    """One long sequence beside short and empty ones: the context holds each sequence's own blocks
    (not B x the longest), row i of the table names them in order, each equal to its block
    dequantized alone; slots past each end are zeroed (zero_past_end) and int4 tail rows stand in
    for a partial last block's codes."""
    from llmbus.kernels.kv_cache import allocate_cache
    from llmbus.kv.formats import KVFormat

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")
    cache = allocate_cache(KVFormat(fmt), lay, 16, "cpu", tail_rows=2)
    tables = torch.tensor([[3, 5, 7, 9, 11, 12], [6, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]],
                          dtype=torch.int32)
    lens = torch.tensor([90, 7, 16, 0], dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    slots = torch.tensor([lay.slot(tables[b].tolist(), t) for b, n in enumerate(lens.tolist()) for t in range(n)])
    k, v = (torch.randn(len(slots), 2, 32, generator=g) for _ in range(2))
    reference.write_kv_cache(k, v, cache, slots)
    counts = [6, 1, 1, 0]
    for zero in (True, False):
        kv, table = reference.dequantized_context(cache, tables, lens, zero_past_end=zero)
        assert kv.shape[1] == sum(counts) and table.shape == (4, 6)
        for b, n in enumerate(counts):
            ids = table[b, :n].tolist()
            if n:  # its own blocks, one after another (an empty sequence has none)
                assert ids == list(range(ids[0], ids[0] + n))
            assert (table[b, n:] == 0).all()  # padding names a block of the context
            for j in range(n):
                full = torch.tensor([(j + 1) * 16 <= int(lens[b])])
                want = reference.dequantize_blocks(cache, tables[b, j : j + 1].long(), full)[:, 0]
                if zero:
                    want[:, max(0, int(lens[b]) - 16 * j):] = 0
                torch.testing.assert_close(kv[:, ids[j]], want)
    for width in (0, 3):  # an all-empty batch, even with a table of no columns: one block
        kv, table = reference.dequantized_context(cache, torch.zeros(2, width, dtype=torch.int32),
                                                  torch.zeros(2, dtype=torch.int32))
        assert kv.shape[1] == 1 and (table == 0).all() and (kv == 0).all()
    if fmt == "int4":  # sequence 1's partial block from tail row 1
        cache.k_tail[16:32], cache.v_tail[16:32] = 3.0, -2.0
        kv, table = reference.dequantized_context(cache, tables, lens, tail_rows=torch.tensor([-1, 1, -1, -1]))
        assert (kv[0, table[1, 0], :7] == 3.0).all() and (kv[1, table[1, 0], :7] == -2.0).all()
        assert (kv[:, table[1, 0], 7:] == 0).all()


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU library did not build")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4r"])
def test_cpu_backend_lays_fresh_prompts_out_from_their_chunks(fmt, dtype, monkeypatch):
    """A prefill of fresh prompts alone (no cached prefix) attends over a context laid out from its
    chunks' own keys and values: the bytes the kernels read (every position below each sequence's
    end) and the table equal the dequantized context's with the chunks written over it, no block is
    dequantized, and the output is the reference's."""
    from llmbus.kernels import backends

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    lens, tables = [37, 16, 1, 50], [[3, 5, 0], [6], [1], [2, 4, 7, 8]]
    meta = _meta(lay, tables, lens, lens, 0, "cpu")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(lens), h, 64, generator=g).to(getattr(torch, dtype)) for h in (8, 2, 2))
    ours, ref = CpuPagedAttentionBackend(fmt), TorchPagedAttentionBackend(fmt)
    cache, ref_cache = ours.allocate_cache(lay, 10, "cpu")[0], ref.allocate_cache(lay, 10, "cpu")[0]
    want = ref.forward(q, k, v, ref_cache, meta, 0.125)

    ours._write(k, v, cache, meta.slot_mapping)  # the codes the slow path would have read
    qsl = meta.query_start_loc
    slow, slow_table = reference.dequantized_context(cache, meta.block_tables, meta.seq_lens, zero_past_end=False)
    reference.exact_chunks(slow, slow_table, k, v, meta.seq_lens, qsl)
    fast, table = backends._chunk_context(k, v, qsl, 16, torch.float32)
    assert torch.equal(table, slow_table)
    for i, n in enumerate(lens):
        def rows(kv):
            return kv[:, table[i, : -(-n // 16)].long()].flatten(1, 2)[:, :n]
        assert torch.equal(rows(fast), rows(slow))

    def refuse(*args, **kwargs):
        raise AssertionError("a fresh prompt's context was dequantized")

    monkeypatch.setattr(reference, "dequantized_context", refuse)
    got = ours.forward(q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if dtype == "bfloat16" else 2e-5, rtol=1e-3)

"""Triton paged prefill attention vs reference.paged_prefill_attention_cache (TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch

from llmbus.kernels import reference as ref  # noqa: E402
from llmbus.kernels.kv_cache import PagedKVCache, allocate_cache  # noqa: E402
from llmbus.kernels.paged_decode import int4_lanes, int8_words
from llmbus.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from llmbus.kv.formats import KVFormat  # noqa: E402
from llmbus.kv.layout import KVLayout  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}


def _check(name, dtype, hkv, group, head_dim, bs, ctx, qlens, seed=0, fast=None, head_major=False, exact=True,
           **launch):
    """Sequences with ``ctx[i]`` tokens of context whose last ``qlens[i]`` are this step's chunk
    (``exact``: attended as computed, as the engine's backends pass them)."""
    lay = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=head_dim, block_size=bs, dtype=dtype)
    nblocks = sum(lay.num_blocks_for(n) for n in ctx) + 2
    cache = allocate_cache(KVFormat(name), lay, nblocks, DEV, head_major=head_major)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables = torch.zeros(len(ctx), max(lay.num_blocks_for(n) for n in ctx), dtype=torch.int32)
    chunk_k, chunk_v = [], []
    for i, n in enumerate(ctx):
        blocks = [perm.pop() for _ in range(lay.num_blocks_for(n))]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = (torch.randn(n, hkv, head_dim, generator=g) + 0.3).to(DEV, cache.model_dtype)
        v = torch.randn(n, hkv, head_dim, generator=g).to(DEV, cache.model_dtype)
        ref.write_kv_cache(k, v, cache, torch.tensor(lay.slot_mapping(blocks, 0, n), device=DEV))
        chunk_k.append(k[n - qlens[i]:])
        chunk_v.append(v[n - qlens[i]:])
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = torch.randn(int(qsl[-1]), hkv * group, head_dim, generator=g).to(DEV, cache.model_dtype)
    sl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    tables = tables.to(DEV)
    chunk = (torch.cat(chunk_k), torch.cat(chunk_v)) if exact else None
    want = ref.paged_prefill_attention_cache(q, cache, tables, sl, qsl, head_dim**-0.5, chunk=chunk)
    got = paged_prefill_attention(q, cache, tables, sl, qsl, head_dim**-0.5, chunk=chunk, **launch)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if fast is not None:  # whether the decode loops (words / lanes) serve this cache
        assert (int8_words(cache) or int4_lanes(cache)) == fast


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("exact", [True, False])
def test_prefill_chunks_over_prefix(name, dtype, exact):
    # a chunk over a cached prefix, a fresh prompt, a single-token chunk, an empty chunk
    _check(name, dtype, hkv=2, group=2, head_dim=16, bs=16, ctx=[45, 19, 33, 8], qlens=[21, 19, 1, 0], exact=exact)


def _filled(name, lay, ctx, seed):
    """A cache of ``name`` holding random keys and values for sequences of ``ctx`` tokens (block
    tables in order), and each sequence's ``[2, n, H, D]`` keys and values."""
    cache = allocate_cache(KVFormat(name), lay, sum(lay.num_blocks_for(n) for n in ctx) + 1, DEV)
    g = torch.Generator().manual_seed(seed)
    tables = torch.zeros(len(ctx), max(lay.num_blocks_for(n) for n in ctx), dtype=torch.int32)
    kvs, first = [], 1
    for i, n in enumerate(ctx):
        blocks = list(range(first, first + lay.num_blocks_for(n)))
        first += len(blocks)
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        kvs.append((torch.randn(2, n, lay.num_kv_heads, lay.head_dim, generator=g) * 2 + 0.5).to(DEV, cache.model_dtype))
        ref.write_kv_cache(kvs[-1][0], kvs[-1][1], cache, torch.tensor(lay.slot_mapping(blocks, 0, n), device=DEV))
    return cache, tables.to(DEV), kvs


@pytest.mark.parametrize("name", ["int8", "int4", "int4r"])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the prefix through the decode loops
def test_exact_chunk_of_a_fresh_prompt_is_the_model_dtypes_attention(name, head_dim):
    """A prompt's one-pass prefill over a quantized cache, given its keys and values, is the same
    attention as over a model-dtype cache (nothing it reads was quantized); a chunk after a cached
    prefix attends to the prefix as the cache holds it (dequantized, checked against the cache's
    own round trip) and to itself exactly. Both backends, the reference and the Triton kernel."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype="float32")
    ctx, qlens = [37, 40, 16], [37, 23, 16]
    cache, tables, kvs = _filled(name, lay, ctx, seed=head_dim)
    plain, _, _ = _filled("model", lay, ctx, seed=head_dim)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = torch.randn(int(qsl[-1]), 4, head_dim, generator=torch.Generator().manual_seed(1)).to(DEV)
    sl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    chunk = tuple(torch.cat([kv[i, n - ql:] for kv, n, ql in zip(kvs, ctx, qlens)]) for i in (0, 1))
    if name == "int4r":  # the queries as INT4R's kernels meet them (rounded to int8)
        q = ref.cache_query(q, cache)
    want = ref.paged_prefill_attention(q, plain.data, tables, sl, qsl, 0.3)  # exact everywhere
    dq, dtables = ref.dequantized_context(cache, tables, sl)
    pre = ctx[1] - qlens[1]  # sequence 1's prefix as the cache holds it, its chunk exact
    ctx1 = torch.cat([ref.gather_kv(dq, dtables[1], pre)[0], chunk[0][qsl[1]:qsl[2]].float()])
    val1 = torch.cat([ref.gather_kv(dq, dtables[1], pre)[1], chunk[1][qsl[1]:qsl[2]].float()])
    mixed = torch.stack([ctx1, val1])[:, None]  # [2, 1 block of 40, H, D]
    want[qsl[1]:qsl[2]] = ref.paged_prefill_attention(q[qsl[1]:qsl[2]], mixed, torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                                                      sl[1:2], qsl[1:3] - qsl[1], 0.3)
    assert (dq[:, : lay.num_blocks_for(pre)].flatten(1, 2)[:, :pre] - torch.stack(kvs[1][:, :pre].unbind())).abs().max() > 1e-3
    for got in (ref.paged_prefill_attention_cache(q, cache, tables, sl, qsl, 0.3, chunk=chunk),
                paged_prefill_attention(q, cache, tables, sl, qsl, 0.3, chunk=chunk)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    quantized = ref.paged_prefill_attention_cache(q, cache, tables, sl, qsl, 0.3)  # the chunk read back
    assert (quantized - want).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
def test_prefill_head_major_storage(name):
    """Prefill over a head-major cache (allocate_cache(head_major=True)) as over the token-major one."""
    _check(name, "float16", hkv=2, group=2, head_dim=64, bs=16, ctx=[45, 19, 8], qlens=[21, 19, 1],
           fast=name != "model", head_major=True)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_gqa_ratios(group):
    _check("int4", "float16", hkv=1, group=group, head_dim=32, bs=16, ctx=[40, 3], qlens=[17, 3], seed=group)


@pytest.mark.parametrize("name", ["int8", "int4", "int4r"])
@pytest.mark.parametrize("head_dim,bs,group", [(64, 16, 4), (128, 32, 2)])
def test_prefill_quantized_contexts_through_the_decode_loops(name, head_dim, bs, group):
    """From 64 channels, INT8 and INT4 contexts go through the decode kernel's loops (words /
    lanes by channel class) with the causal mask per row: a chunk after a long prefix whose rows
    end mid-block and span several blocks, a fresh prompt, one token, an empty chunk; INT4's partial
    last blocks through the generic load."""
    _check(name, "bfloat16", hkv=2, group=group, head_dim=head_dim, bs=bs, ctx=[110, 37, 64, 9], qlens=[45, 37, 1, 0],
           seed=head_dim, fast=True)


@pytest.mark.parametrize("name", ["int8", "int4", "int4r"])
@pytest.mark.parametrize("head_dim,bs", [(64, 16), (64, 32), (128, 64)])
def test_prefill_decode_loops_at_the_cuda_launch(name, head_dim, bs):
    """The CUDA defaults (64-row query blocks, multi-block tiles: 64 positions, 128 for INT4's
    64-token blocks) with chunks longer than a query block, contexts that end on a block boundary and
    mid-block."""
    _check(name, "float16", hkv=1, group=2, head_dim=head_dim, bs=bs, ctx=[300, 130, 128, 70], qlens=[150, 130, 100, 3],
           seed=bs, fast=True, block_m=64, tile=max(64, 2 * bs if name == "int4" else bs))


def test_prefill_tile_defaults_and_checks():
    """INT4 on CUDA takes tiles of two blocks or more (one-block INT4 tiles went wrong on an H200)."""
    from llmbus.kernels.paged_decode import tile_size

    def cache(name, bs):
        return allocate_cache(KVFormat(name), KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=bs), 1, "cpu")

    assert tile_size(cache("int4", 64), None, True, 64) == 128 and tile_size(cache("int4", 16), None, True, 64) == 64
    assert tile_size(cache("model", 64), None, True, 64) == 64 and tile_size(cache("int4", 64), None, False, 64) == 64
    with pytest.raises(ValueError, match="two|2 \\* block_size"):
        tile_size(cache("int4", 64), 64, True, 64)
    with pytest.raises(ValueError, match="power-of-two multiple"):
        tile_size(cache("int8", 16), 48, False, 64)


def test_prefill_block_size_32_head_dim_64():
    _check("int8", "float16", hkv=1, group=2, head_dim=64, bs=32, ctx=[70], qlens=[35])


def test_prefill_high_block_ids_do_not_overflow_int32():
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype="float16")
    n = (2**31) // (16 * 16) + 40
    try:
        data = torch.empty(2, n, 16, 1, 16, dtype=torch.float16, device=DEV)
    except RuntimeError as exc:  # pragma: no cover
        pytest.skip(f"cannot reserve a {n}-block cache: {exc}")
    cache = PagedKVCache(KVFormat("model"), lay, data)
    hi = [n - 2, n - 30]
    k, v = torch.randn(25, 1, 16).half().to(DEV), torch.randn(25, 1, 16).half().to(DEV)
    ref.write_kv_cache(k, v, cache, torch.tensor(lay.slot_mapping(hi, 0, 25), device=DEV))
    tables = torch.tensor([hi], dtype=torch.int32, device=DEV)
    sl = torch.tensor([25], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 9], dtype=torch.int32, device=DEV)
    q = torch.randn(9, 1, 16).half().to(DEV)
    want = ref.paged_prefill_attention_cache(q, cache, tables, sl, qsl, 0.25)
    torch.testing.assert_close(paged_prefill_attention(q, cache, tables, sl, qsl, 0.25), want, atol=3e-3, rtol=3e-3)


def test_prefill_bad_input_is_a_value_error():
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16)
    cache = allocate_cache(KVFormat("model"), lay, 2, DEV)
    q = torch.randn(2, 1, 16, device=DEV)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    sl = torch.tensor([2], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        paged_prefill_attention(q, cache, tables, sl, torch.tensor([0, 2], device=DEV), 1.0)


@pytest.mark.parametrize("name", ["int4", "int4r"])
@pytest.mark.parametrize("head_dim", [32, 64])  # 64: full blocks through the lane loop
def test_prefill_reads_partial_int4_blocks_from_tail_rows(name, head_dim):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype="float32")
    ctx, qlens = [45, 19, 32, 8], [21, 19, 4, 3]
    cache = allocate_cache(KVFormat(name), lay, 12, DEV, tail_rows=4)
    g = torch.Generator().manual_seed(5)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 6, 0], [7, 0, 0]], dtype=torch.int32, device=DEV)
    for i, n in enumerate(ctx):
        kv = torch.randn(2, n, 2, head_dim, generator=g).to(DEV)
        blocks = tables[i, : lay.num_blocks_for(n)].tolist()
        ref.write_kv_cache(kv[0], kv[1], cache, torch.tensor(lay.slot_mapping(blocks, 0, n), device=DEV))
    # NOTE: rows holding keys the codes do not, so which one a kernel reads shows in its output
    for tail in (cache.k_tail, cache.v_tail):
        tail.copy_(torch.randn(tail.shape, generator=g).to(DEV) * 2)
    rows = torch.tensor([3, -1, 1, 0], dtype=torch.int32, device=DEV)  # seq 1 has none, seq 2 is full
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = torch.randn(int(qsl[-1]), 4, head_dim, generator=g).to(DEV)
    sl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    want = ref.paged_prefill_attention_cache(q, cache, tables, sl, qsl, 0.25, rows)
    got = paged_prefill_attention(q, cache, tables, sl, qsl, 0.25, tail_rows=rows)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    plain = ref.paged_prefill_attention_cache(q, cache, tables, sl, qsl, 0.25)
    moved = [bool((want[a:b] - plain[a:b]).abs().max() > 1e-2) for a, b in zip(qsl[:-1].tolist(), qsl[1:].tolist())]
    assert moved == [True, False, False, True]


@pytest.mark.parametrize("head_dim", [32, 64])  # 64: full blocks through the decode loop
def test_prefill_int4r_rounds_queries_as_the_reference_ties_included(head_dim):
    """The chunk's rows rounded to int8 as quant_reference.round_query rounds them, ties (a channel at
    half its row's largest magnitude) half up, as in the decode kernel (tests/test_kernels_decode.py)."""
    from tests.test_kernels_decode import _tie_queries

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype="float32")
    ctx, qlens = [45, 19, 32], [21, 19, 4]
    cache = allocate_cache(KVFormat("int4r"), lay, 8, DEV)
    g = torch.Generator().manual_seed(8)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 6, 0]], dtype=torch.int32, device=DEV)
    for i, n in enumerate(ctx):
        kv = torch.randn(2, n, 2, head_dim, generator=g).to(DEV)
        blocks = tables[i, : lay.num_blocks_for(n)].tolist()
        ref.write_kv_cache(kv[0], kv[1], cache, torch.tensor(lay.slot_mapping(blocks, 0, n), device=DEV))
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = _tie_queries((int(qsl[-1]), 4, head_dim), seed=9).to(DEV)
    sl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    want = ref.paged_prefill_attention_cache(q, cache, tables, sl, qsl, 0.3)
    torch.testing.assert_close(paged_prefill_attention(q, cache, tables, sl, qsl, 0.3), want, atol=2e-5, rtol=2e-5)


def test_exact_chunks_places_rows_by_their_chunks_not_their_offset():
    """``reference.exact_chunks`` places each chunk's rows at the last ``q_len`` positions of its
    sequence, whatever the first chunk's offset in ``query_start_loc`` (a mixed step's prompts
    come after its decodes' rows)."""
    bs, h, d = 4, 1, 2
    kv = torch.zeros(2, 5, bs, h, d)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    key = torch.arange(1.0, 6.0)[:, None, None].expand(5, h, d)
    for start in (0, 3):
        got = kv.clone()
        ref.exact_chunks(got, tables, key, -key, torch.tensor([6, 3]), torch.tensor([start, start + 2, start + 5]))
        flat = got.flatten(1, 2)[..., 0, 0]  # [2, positions across the blocks]
        assert flat[0].tolist() == [0, 0, 0, 0, 1, 2, 0, 0, 3, 4, 5] + [0] * 9
        assert torch.equal(flat[1], -flat[0])

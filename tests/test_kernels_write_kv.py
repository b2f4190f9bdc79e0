"""Triton KV write vs reference.write_kv_cache, under TRITON_INTERPRET=1 on CPU."""

import pytest
import torch

from llmbus.kernels import reference as ref  # noqa: E402
from llmbus.kernels.kv_cache import PagedKVCache, allocate_cache, read_blocks, write_blocks  # noqa: E402
from llmbus.kernels.write_kv import write_kv  # noqa: E402
from llmbus.engine.attention import build_attention_metadata  # noqa: E402
from llmbus.engine.runner import TailRows  # noqa: E402
from llmbus.kv.formats import KVFormat  # noqa: E402
from llmbus.kv.layout import KVLayout  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
def test_write_matches_reference_prefill_then_decode(name, dtype):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype)
    torch.manual_seed(1)
    tables = [[5, 2, 7], [1, 3]]
    lens = [37, 17]
    mine, theirs = (allocate_cache(KVFormat(name), lay, 8, DEV) for _ in range(2))
    k = [torch.randn(n, 2, 32, device=DEV).to(mine.model_dtype) * 2 + 1 for n in lens]
    v = [torch.randn(n, 2, 32, device=DEV).to(mine.model_dtype) for n in lens]
    # step 1: both sequences prefill a chunk (seq 0 fills one block and leaves a tail)
    first = [20, 15]
    kk = torch.cat([k[i][: first[i]] for i in range(2)])
    vv = torch.cat([v[i][: first[i]] for i in range(2)])
    sm = torch.tensor(sum((lay.slot_mapping(tables[i], 0, first[i]) for i in range(2)), []), device=DEV)
    ref.write_kv_cache(kk, vv, theirs, sm)
    write_kv(kk, vv, mine, sm)
    # then decode steps, both sequences per step, crossing block boundaries
    for step in range(2):
        pos = [first[i] + step for i in range(2)]
        kk = torch.stack([k[i][pos[i]] for i in range(2)])
        vv = torch.stack([v[i][pos[i]] for i in range(2)])
        sm = torch.tensor([lay.slot(tables[i], pos[i]) for i in range(2)], device=DEV)
        ref.write_kv_cache(kk, vv, theirs, sm)
        write_kv(kk, vv, mine, sm)
    a, b = read_blocks(mine, range(8)), read_blocks(theirs, range(8))
    if name != "int4" and DEV == "cpu":  # GPU division is not correctly rounded: ties may flip
        assert torch.equal(a, b)
    # int4: rounding ties may fall differently; compare dequantized values within one step
    # full blocks: 5, 2 (seq 0) and 1 (seq 1); tails: 7 (seq 0) and 3 (seq 1)
    ids = torch.tensor([5, 2, 1, 7, 3], device=DEV)
    full = torch.tensor([True, True, True, False, False], device=DEV)
    da = ref.dequantize_blocks(mine, ids, full)
    db = ref.dequantize_blocks(theirs, ids, full)
    step = {"model": 0.0, "int8": 0.1, "int4": 0.6, "int4r": 0.6}[name] if DEV == "cuda" else {"model": 0.0, "int8": 0.0, "int4": 0.6, "int4r": 0.6}[name]
    assert (da - db).abs().max() <= step  # at most one quantization step apart
    if name != "model":
        assert (a != b).float().mean() < 0.01


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
def test_write_head_major_storage_moves_the_same_bytes(name):
    """The KV write into a head-major cache (allocate_cache(head_major=True)) leaves the blocks a
    token-major cache holds: read_blocks' bytes (the handoff's and kvpool's) are the same, and
    write_blocks puts them back in either."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
    torch.manual_seed(2)
    token_major, head_major = allocate_cache(KVFormat(name), lay, 4, DEV), allocate_cache(KVFormat(name), lay, 4, DEV,
                                                                                         head_major=True)
    k, v = torch.randn(37, 2, 64, device=DEV).half(), torch.randn(37, 2, 64, device=DEV).half()
    sm = torch.tensor(lay.slot_mapping([3, 0, 2], 0, 37), device=DEV)
    for cache in (token_major, head_major):
        write_kv(k, v, cache, sm)
    assert torch.equal(read_blocks(head_major, range(4)), read_blocks(token_major, range(4)))
    again = allocate_cache(KVFormat(name), lay, 4, DEV, head_major=True)
    write_blocks(again, range(4), read_blocks(token_major, range(4)))
    assert torch.equal(read_blocks(again, range(4)), read_blocks(token_major, range(4)))


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
def test_reference_write_of_a_slot_twice_keeps_the_last_in_either_storage(name):
    """A call that writes a slot twice keeps its last write (index_copy_'s rule), in a head-major
    cache (written by indexing) as in a token-major one (through a flat view of its slots)."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=4, dtype="float32")
    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([5, 1, 5, 6, 1, 5, 2, 3], device=DEV)  # block 0 fills (INT4 seals it)
    k, v = torch.randn(8, 2, 32, generator=g).to(DEV), torch.randn(8, 2, 32, generator=g).to(DEV)
    token_major, head_major = (allocate_cache(KVFormat(name), lay, 3, DEV, head_major=hm) for hm in (False, True))
    for cache in (token_major, head_major):
        ref.write_kv_cache(k, v, cache, slots)
    assert torch.equal(read_blocks(head_major, range(3)), read_blocks(token_major, range(3)))
    last = allocate_cache(KVFormat(name), lay, 3, DEV)
    keep = torch.tensor([3, 4, 5, 6, 7])  # each slot's last write
    ref.write_kv_cache(k[keep], v[keep], last, slots[keep])
    assert torch.equal(read_blocks(last, range(3)), read_blocks(token_major, range(3)))


@pytest.mark.parametrize("head_major", [False, True])
def test_reference_write_refuses_slots_outside_the_cache(head_major):
    """A slot of -1 (or past the last block) is an error, not a write into the last block."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=4, dtype="float32")
    for name in ("model", "int8", "int4"):
        cache = allocate_cache(KVFormat(name), lay, 3, DEV, head_major=head_major)
        k = torch.randn(2, 2, 32, device=DEV)
        for bad in (-1, 12):
            with pytest.raises(ValueError, match=r"slots must lie in \[0, 12\)"):
                ref.write_kv_cache(k, k, cache, torch.tensor([0, bad], device=DEV))
        assert not read_blocks(cache, range(3)).any()


def test_write_bad_input_is_a_value_error():
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16)
    cache = allocate_cache(KVFormat("int8"), lay, 2, DEV)
    k = torch.randn(3, 2, 32, device=DEV)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        write_kv(k, k, cache, torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="key/value must be"):
        write_kv(k[:, :1], k[:, :1], cache, torch.tensor([0, 1, 2], device=DEV))


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
def test_write_takes_keys_and_values_of_different_strides(name):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16)
    mine, theirs = (allocate_cache(KVFormat(name), lay, 2, DEV) for _ in range(2))
    k = torch.randn(3, 2, 32, device=DEV)
    v = torch.randn(3, 2, 64, device=DEV)[..., :32]  # rows 64 apart: a view of a wider tensor
    sm = torch.tensor([16, 17, 18], device=DEV)
    write_kv(k, v, mine, sm)
    ref.write_kv_cache(k, v, theirs, sm)
    if DEV == "cpu":  # NOTE: GPU division is not correctly rounded: quantization ties may flip there
        assert torch.equal(read_blocks(mine, [1]), read_blocks(theirs, [1]))
    ids, full = torch.tensor([1], device=DEV), torch.tensor([False], device=DEV)
    got, want = ref.dequantize_blocks(mine, ids, full), ref.dequantize_blocks(theirs, ids, full)
    assert (got - want).abs().max() <= {"model": 0.0, "int8": 0.1, "int4": 0.6, "int4r": 0.6}[name]


def test_write_high_block_ids_do_not_overflow_int32():
    """block_id * block stride > 2**31 elements: offsets must be computed in int64.
    The cache is torch.empty (untouched pages cost no RAM); only two high blocks are used."""
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype="float16")
    n = (2**31) // (16 * 16) + 64
    try:
        data = torch.empty(2, n, 16, 1, 16, dtype=torch.float16, device=DEV)
    except RuntimeError as exc:  # pragma: no cover - machine without the address space
        pytest.skip(f"cannot reserve a {n}-block cache: {exc}")
    cache = PagedKVCache(KVFormat("model"), lay, data)
    hi = [n - 3, n - 1]
    data[:, hi] = 0
    k, v = torch.randn(20, 1, 16, device=DEV).half(), torch.randn(20, 1, 16, device=DEV).half()
    write_kv(k, v, cache, torch.tensor(lay.slot_mapping(hi, 0, 20), device=DEV))
    got_k, got_v = ref.gather_kv(data, torch.tensor(hi), 20)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


@pytest.mark.parametrize("name", ["int4", "int4r"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_tail_rows_match_reference(name, dtype):
    """Exact tail rows through the engine's row rule (``TailRows``): the kernel seals from
    them (INT4) and fills them as the reference does, with a rowless sequence in the same launches."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype)
    torch.manual_seed(2)
    fmt = KVFormat(name)
    mine, theirs = (allocate_cache(fmt, lay, 8, DEV, tail_rows=2) for _ in range(2))
    tables = [[5, 2, 7, 0], [1, 3, 4]]
    lens = [53, 40]
    k = [(torch.randn(n, 2, 32, device=DEV) * 3 + 1).to(mine.model_dtype) for n in lens]
    v = [torch.randn(n, 2, 32, device=DEV).to(mine.model_dtype) for n in lens]
    rows = TailRows(2)  # NOTE: rows for seq 0 only; seq 1 gets -1 and seals from its codes
    steps = [[5, 9], [20, 20]] + [[1, 1]] * 8 + [[20, 3]]  # the last seals from one row, starts the other
    done = [0, 0]
    for chunk in steps:
        entries = [(tables[i], done[i], chunk[i]) for i in range(2)]
        pairs = [rows.rows_for(f"s{i}", done[i], chunk[i], 16)[:2] for i in range(2)]
        order = sorted(range(2), key=lambda i: chunk[i] != 1)  # decodes first
        meta, _ = build_attention_metadata([entries[i] for i in order], 16, DEV, [pairs[i] for i in order])
        kk = torch.cat([k[i][done[i] : done[i] + chunk[i]] for i in order])
        vv = torch.cat([v[i][done[i] : done[i] + chunk[i]] for i in order])
        ref.write_kv_cache(kk, vv, theirs, meta.slot_mapping, meta.tail_slots)
        write_kv(kk, vv, mine, meta.slot_mapping, meta.tail_slots)
        done = [done[i] + chunk[i] for i in range(2)]
    assert pairs[1] == (-1, -1) and done == [53, 40]
    assert torch.equal(mine.k_tail, theirs.k_tail) and torch.equal(mine.v_tail, theirs.v_tail)
    at = pairs[0][1] * 16  # the later-blocks row
    assert torch.equal(mine.k_tail[at : at + 5], k[0][48:53]) and torch.equal(mine.v_tail[at : at + 5], v[0][48:53])
    ids = torch.tensor([5, 2, 7, 1, 3, 0, 4], device=DEV)
    full = torch.tensor([True] * 5 + [False] * 2, device=DEV)
    da, db = ref.dequantize_blocks(mine, ids, full), ref.dequantize_blocks(theirs, ids, full)
    assert (da - db).abs().max() <= 0.6  # at most one quantization step apart (rounding ties)
    assert (read_blocks(mine, range(8)) != read_blocks(theirs, range(8))).float().mean() < 0.01


def test_write_rejects_bad_tail_slots():
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16)
    k = torch.randn(2, 2, 32, device=DEV)
    sm = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="no tail rows"):
        write_kv(k, k, allocate_cache(KVFormat("int4"), lay, 2, DEV), sm, torch.tensor([0, 1], device=DEV))
    with pytest.raises(ValueError, match="tail_slots must be int64"):
        write_kv(k, k, allocate_cache(KVFormat("int4"), lay, 2, DEV, tail_rows=1), sm,
                 torch.tensor([0, 1], dtype=torch.int32, device=DEV))

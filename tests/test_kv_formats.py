"""KV formats: sizes from (format, layout) alone, quantization round-trip bounds, block bytes I/O."""

import pytest
import torch

from llmbus.kernels import quant_reference as qr
from llmbus.kernels import reference as ref
from llmbus.kernels.kv_cache import PagedKVCache, allocate_cache, read_blocks, write_blocks
from llmbus.engine.attention import build_attention_metadata
from llmbus.engine.runner import TailRows
from llmbus.kv.formats import KVFormat, parse_kv_format
from llmbus.kv.layout import KVLayout


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bytes_per_token_vs_bf16(head_dim):
    lay = KVLayout(num_layers=4, num_kv_heads=8, head_dim=head_dim, block_size=16, dtype="bfloat16")
    bf16 = KVFormat("model").bytes_per_token(lay)
    assert bf16 == lay.bytes_per_token
    assert KVFormat("int8").bytes_per_token(lay) <= 0.52 * bf16
    assert KVFormat("int4").bytes_per_token(lay) <= 0.30 * bf16
    assert KVFormat("int4r").bytes_per_token(lay) <= 0.30 * bf16
    # INT4R: the codes and one (scale, min) pair a token, head and K or V
    assert KVFormat("int4r").layer_block_bytes(lay) == 2 * 16 * 8 * (head_dim // 2 + 4)


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
def test_block_bytes_match_allocated_tensors(name):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype="float16")
    cache = allocate_cache(KVFormat(name), lay, 3, "cpu")
    total = sum(t.numel() * t.element_size() for t, _ in cache.parts())
    assert total == 3 * KVFormat(name).layer_block_bytes(lay)


def test_bad_formats_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown KV format 'fp8'"):
        parse_kv_format("fp8")
    with pytest.raises(ValueError, match="scale_dtype"):
        KVFormat("int4", scale_dtype="float32")
    with pytest.raises(ValueError, match="head_dim must be even"):
        KVFormat("int4").layer_block_bytes(KVLayout(1, 1, 15))
    assert parse_kv_format(" INT8 ") == KVFormat("int8")
    with pytest.raises(ValueError, match="head_dim must be a power of two, got 96"):
        KVFormat("int4r").layer_block_bytes(KVLayout(1, 1, 96))
    with pytest.raises(ValueError, match="int4r KV stores its scales as float16"):
        KVFormat("int4r", scale_dtype="float32")


def test_int8_round_trip_bound():
    x = torch.randn(64, 4, 128) * torch.logspace(-2, 2, 64)[:, None, None]
    q, s = qr.int8_quantize(x)
    err = (qr.int8_dequantize(q, s) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    assert (err <= amax / 254 * 1.01 + 1e-7).all()  # half a step (fp16 scale rounding included)


def test_int4_value_round_trip_bound():
    x = torch.randn(64, 4, 128) * 3 + 1
    q, s, mn = qr.int4_group_quantize(x, 64)
    err = (qr.int4_group_dequantize(q, s, mn, 64) - x).abs().unflatten(-1, (2, 64))
    rng = x.unflatten(-1, (2, 64))
    step = (rng.amax(-1) - rng.amin(-1)) / 15
    assert (err <= (step / 2 * 1.01 + rng.abs().amax(-1) * 2**-10)[..., None]).all()


def test_int4_key_block_round_trip_bound_with_outlier_channels():
    x = torch.randn(16, 4, 64)
    x[:, :, 5] += 40.0  # an outlier channel, the case per-channel keys exist for
    q, codes, lo, hi = qr.int4_key_block_quantize(x)
    err = (qr.int4_key_block_dequantize(q, codes, lo, hi) - x).abs()
    chan_step = (x.amax(0) - x.amin(0)) / 15
    head_step = (hi.float() - lo.float()) / 255
    bound = (chan_step + 2 * head_step[:, None] / 15) / 2 * 1.01 + 1e-6
    assert (err <= bound).all()
    per_token_err = (qr.int4_group_dequantize(*qr.int4_group_quantize(x, 64), 64) - x).abs()
    assert err.mean() < per_token_err.mean() / 3


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
def test_read_write_blocks_round_trip(name):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype="bfloat16")
    src = allocate_cache(KVFormat(name), lay, 6, "cpu")
    table = [4, 1, 3]
    k, v = torch.randn(40, 2, 32), torch.randn(40, 2, 32)
    ref.write_kv_cache(k, v, src, torch.tensor(lay.slot_mapping(table, 0, 40)))
    dst = allocate_cache(KVFormat(name), lay, 5, "cpu")
    write_blocks(dst, [0, 2, 4], read_blocks(src, table))
    lens = torch.tensor([40], dtype=torch.int32)
    q = torch.randn(1, 4, 32, dtype=torch.bfloat16)
    a = ref.paged_decode_attention_cache(q, src, torch.tensor([table], dtype=torch.int32), lens, 0.2)
    b = ref.paged_decode_attention_cache(q, dst, torch.tensor([[0, 2, 4]], dtype=torch.int32), lens, 0.2)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="block ids"):
        read_blocks(src, [6])
    with pytest.raises(ValueError, match="write_blocks expects uint8"):
        write_blocks(dst, [0], torch.zeros(1, 3, dtype=torch.uint8))


@pytest.mark.parametrize("name", ["int8", "int4", "int4r"])
def test_decode_written_cache_matches_prefill_written_within_bound(name):
    """Token-by-token writes (decode) and one bulk write (prefill) store nearly the same KV."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    torch.manual_seed(0)
    k, v = torch.randn(37, 2, 64), torch.randn(37, 2, 64)
    table = [2, 0, 1]
    bulk, step = (allocate_cache(KVFormat(name), lay, 3, "cpu") for _ in range(2))
    ref.write_kv_cache(k, v, bulk, torch.tensor(lay.slot_mapping(table, 0, 37)))
    for t in range(37):
        ref.write_kv_cache(k[t : t + 1], v[t : t + 1], step, torch.tensor([lay.slot(table, t)]))
    full = torch.tensor([True, True, False])
    a = ref.dequantize_blocks(bulk, torch.tensor(table), full).flatten(1, 2)[:, :37]
    b = ref.dequantize_blocks(step, torch.tensor(table), full).flatten(1, 2)[:, :37]
    kv = torch.stack((k, v))
    assert (a - kv).abs().max() < (0.05 if name == "int8" else 0.9)
    assert (b - kv).abs().max() < (0.05 if name == "int8" else 1.2)
    if name != "int4":  # NOTE: only INT4 re-quantizes a block when it fills
        assert torch.equal(a, b)


def _write_in_steps(cache, lay, k, v, table, steps, tails: bool):
    """Write ``k``/``v`` [L, H, D] in chunks of ``steps`` tokens, as the engine does: slots and tail
    slots from ``build_attention_metadata``, two tail rows held through ``TailRows`` (or none)."""
    rows = TailRows(cache.num_tail_rows) if tails else None
    start = 0
    for n in steps:
        pair = [rows.rows_for("seq", start, n, lay.block_size)[:2]] if tails else None
        meta, _ = build_attention_metadata([(table, start, n)], lay.block_size, "cpu", pair)
        ref.write_kv_cache(k[start : start + n], v[start : start + n], cache, meta.slot_mapping, meta.tail_slots)
        start += n
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_tail_rows_seal_blocks_exactly_as_a_prefill_does(dtype):
    """With a tail row, blocks filled over several steps seal from exact keys: byte for byte what
    one bulk write stores. Without one they seal from per-token codes (keys rounded twice)."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    torch.manual_seed(0)
    k = (torch.randn(53, 2, 64) * torch.linspace(0.2, 4, 64)).to(getattr(torch, dtype))  # channel spread
    v = torch.randn(53, 2, 64).to(getattr(torch, dtype))
    table = [3, 0, 2, 1]
    fmt = KVFormat("int4")
    bulk, tailed, untailed = (allocate_cache(fmt, lay, 4, "cpu", tail_rows=2) for _ in range(3))
    ref.write_kv_cache(k, v, bulk, torch.tensor(lay.slot_mapping(table, 0, 53)))
    steps = [5, 20, 1, 1, 9, 1] + [1] * 16  # chunks sealing in-launch and across launches
    rows = _write_in_steps(tailed, lay, k, v, table, steps, tails=True)
    _write_in_steps(untailed, lay, k, v, table, steps, tails=False)
    full = [3, 0, 2]
    assert torch.equal(read_blocks(tailed, full), read_blocks(bulk, full))
    assert not torch.equal(read_blocks(untailed, full), read_blocks(bulk, full))
    # the filling block: same per-token codes either way, its exact keys in the row
    assert torch.equal(read_blocks(tailed, [1]), read_blocks(untailed, [1]))
    current = rows.rows_for("seq", 53, 1, 16)[0]
    assert torch.equal(tailed.k_tail[current * 16 : current * 16 + 5], k[48:53])
    assert torch.equal(tailed.v_tail[current * 16 : current * 16 + 5], v[48:53])
    # the row's error against bulk-sealed keys: exact sealing is what a prefill gets
    ids, is_full = torch.tensor(full), torch.tensor([True] * 3)
    exact = ref.dequantize_blocks(bulk, ids, is_full)[0]
    twice = ref.dequantize_blocks(untailed, ids, is_full)[0]
    kk = k[:48].float().view(3, 16, 2, 64)
    assert (exact - kk).abs().mean() < (twice - kk).abs().mean()


def test_int4_fill_tail_starts_a_row_from_per_token_codes():
    """A sequence handed over mid-block gets a row holding its filling block's keys and values as
    their per-token codes decode."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    torch.manual_seed(1)
    k, v = torch.randn(22, 2, 64), torch.randn(22, 2, 64)
    cache = allocate_cache(KVFormat("int4"), lay, 2, "cpu", tail_rows=1)
    ref.write_kv_cache(k, v, cache, torch.tensor(lay.slot_mapping([1, 0], 0, 22)))  # no row: block 0 fills
    ref.fill_tail(cache, 0, 0)
    decoded = ref.dequantize_blocks(cache, torch.tensor([0]), torch.tensor([False]))[:, 0, :6]
    assert torch.equal(cache.k_tail[:6], decoded[0]) and torch.equal(cache.v_tail[:6], decoded[1])
    assert (decoded[0] - k[16:22]).abs().max() < 0.6  # per-token codes: within a step of the keys
    assert (decoded[1] - v[16:22]).abs().max() < 0.6


def test_tail_slots_are_checked():
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16)
    cache = allocate_cache(KVFormat("int4"), lay, 2, "cpu", tail_rows=1)
    k = torch.randn(2, 1, 16)
    sm = torch.tensor([16, 17])
    with pytest.raises(ValueError, match="at the slot's block offset 0"):
        ref.write_kv_cache(k, k, cache, sm, torch.tensor([1, 2]))  # offsets one off
    with pytest.raises(ValueError, match="cache's 1 tail rows"):
        ref.write_kv_cache(k, k, cache, sm, torch.tensor([16, 17]))  # row 1 of one
    with pytest.raises(ValueError, match="like slot_mapping"):
        ref.write_kv_cache(k, k, cache, sm, torch.tensor([0]))
    with pytest.raises(ValueError, match="tail_rows must be >= 0"):
        allocate_cache(KVFormat("int4"), lay, 2, "cpu", tail_rows=-1)
    ref.write_kv_cache(k, k, cache, sm, torch.tensor([-1, 1]))  # -1: that token has no row
    assert torch.equal(cache.k_tail[1], k[1]) and torch.equal(cache.v_tail[1], k[1])


def test_tail_row_bytes():
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    assert KVFormat("int4").tail_row_bytes(lay) == 2 * 3 * 16 * 2 * 64 * 2  # keys and values, 3 layers
    assert KVFormat("int8").tail_row_bytes(lay) == KVFormat("model").tail_row_bytes(lay) == 0
    cache = allocate_cache(KVFormat("int4"), KVLayout(1, 2, 64, 16, "bfloat16"), 2, "cpu", tail_rows=5)
    one_layer = (cache.k_tail.numel() + cache.v_tail.numel()) * 2
    assert cache.num_tail_rows == 5 and one_layer * 3 == 5 * KVFormat("int4").tail_row_bytes(lay)
    assert allocate_cache(KVFormat("int8"), lay, 2, "cpu", tail_rows=5).v_tail is None
    parts = dict(data=cache.data, k_meta=cache.k_meta, v_meta=cache.v_meta)
    with pytest.raises(ValueError, match="k_tail and v_tail must both be given"):
        PagedKVCache(cache.fmt, cache.layout, **parts, k_tail=cache.k_tail)
    with pytest.raises(ValueError, match="one shape and layout"):
        PagedKVCache(cache.fmt, cache.layout, **parts, k_tail=cache.k_tail, v_tail=cache.v_tail.transpose(1, 2))


def test_int4_attention_reads_a_partial_block_exactly_from_its_tail_row():
    """Decode attention with tail rows: full blocks as stored, the filling block's keys and values exact."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    torch.manual_seed(3)
    k, v = torch.randn(37, 2, 64) * 2, torch.randn(37, 2, 64)
    table = [2, 0, 1]
    cache = allocate_cache(KVFormat("int4"), lay, 3, "cpu", tail_rows=2)
    rows = _write_in_steps(cache, lay, k, v, table, [20] + [1] * 17, tails=True)
    row = rows.rows_for("seq", 37, 1, 16)[0]
    q = torch.randn(1, 4, 64)
    lens, tables = torch.tensor([37], dtype=torch.int32), torch.tensor([table], dtype=torch.int32)
    got = ref.paged_decode_attention_cache(q, cache, tables, lens, 0.125, torch.tensor([row], dtype=torch.int32))
    kv = ref.dequantize_blocks(cache, torch.tensor(table), torch.tensor([True, True, False])).flatten(1, 2)[:, :37]
    keys, values = torch.cat((kv[0, :32], k[32:])), torch.cat((kv[1, :32], v[32:]))  # the filling block exact
    want = ref._attend(q[:, :, None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], None, 0.125)[:, :, 0]
    torch.testing.assert_close(got, want)
    codes = ref.paged_decode_attention_cache(q, cache, tables, lens, 0.125)  # without: per-token codes
    assert (codes - want).abs().max() > 1e-3


def test_hadamard_rotation_is_orthonormal_and_its_own_inverse():
    for d in (1, 2, 16, 128):
        h = qr.hadamard(d)
        torch.testing.assert_close(h @ h.T, torch.eye(d), atol=1e-6, rtol=0)
        assert torch.equal(h, h.T)
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    torch.testing.assert_close(qr.rotate(qr.rotate(x)), x, atol=1e-6, rtol=0)
    q, k = torch.randn(7, 64), torch.randn(7, 64)
    torch.testing.assert_close((qr.rotate(q) * qr.rotate(k)).sum(-1), (q * k).sum(-1), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two head_dim, got 48"):
        qr.hadamard(48)
    with pytest.raises(ValueError, match="power-of-two head_dim, got 48"):
        qr.rotate(torch.randn(2, 48))
    # the butterflies are the matrix product, up to the product's roundings
    for d in (1, 2, 64, 256):
        x = torch.randn(9, d)
        torch.testing.assert_close(qr.rotate(x), x @ qr.hadamard(d), atol=1e-5, rtol=1e-5)
    # first built inside inference mode (as in an engine step), the matrix still serves autograd
    qr._hadamard.cache_clear()
    with torch.inference_mode():
        qr.rotate(torch.randn(2, 8))
    x = torch.randn(2, 8, requires_grad=True)
    qr.rotate(x).sum().backward()
    assert x.grad is not None


def test_int4r_stores_every_key_per_token_within_half_a_step():
    """INT4R keys and values: per token, one (scale, min) pair a head, full blocks included (no
    sealing); each element within half a step (fp16 rounding of the pair included)."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    torch.manual_seed(3)
    k, v = torch.randn(40, 2, 64) * 2 + 0.5, torch.randn(40, 2, 64)
    cache = allocate_cache(KVFormat("int4r"), lay, 3, "cpu")
    assert cache.k_meta.shape == (3, 2, 32) and cache.v_meta.shape == (3, 16, 2, 1, 2)
    ref.write_kv_cache(k, v, cache, torch.arange(40))
    kv = ref.dequantize_blocks(cache, torch.arange(3), torch.tensor([True, True, False])).flatten(1, 2)[:, :40]
    for got, x in zip(kv, (k, v)):
        step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 15
        assert ((got - x).abs() <= step / 2 * 1.01 + x.abs().amax(-1, keepdim=True) * 2**-10).all()
    # block 0's first token: its pair at k_meta slots 0, 1 (fp16 scale, min)
    pair = cache.k_meta[0, 0, :2].view(torch.float16).float()
    assert torch.allclose(pair, torch.stack(((k[0, 0].max() - k[0, 0].min()) / 15, k[0, 0].min())), rtol=2e-3)


def test_round_query_rounds_rows_to_int8_half_up():
    """INT4R's queries (quant_reference.round_query): per row, codes of max |q| / 127, ties half up
    (2.375 / 2 is 63.5 steps, which 2.375 / 2 * (127 / 2.375) in fp32 misses by an ulp), within half
    a step, zero rows zero, and rounding twice changes nothing."""
    q = torch.tensor([[2.375, 1.1875, -1.1875, 0.59375, -2.0], [0.0] * 5])
    got = qr.round_query(q)
    step = 2.375 / 127
    assert (got[0] / step).round().tolist() == [127, 64, -63, 32, -107]
    assert torch.equal(got[1], torch.zeros(5)) and got.dtype == torch.float32
    x = torch.randn(6, 3, 64, dtype=torch.bfloat16)
    r = qr.round_query(x)
    amax = x.float().abs().amax(-1, keepdim=True)
    assert ((r - x.float()).abs() <= amax / 254 * (1 + 1e-5)).all()
    assert torch.equal(qr.round_query(r), r)


def test_int4r_tier_conversion_rotates_keys_back():
    """Blocks converted from INT4R to another format (a tier's) hold the keys, not their rotation;
    and back, the rotation again."""
    from llmbus.kv.tier_format import convert_blocks, dequantize

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")
    torch.manual_seed(4)
    k, v = torch.randn(32, 2, 32), torch.randn(32, 2, 32)
    caches = [allocate_cache(KVFormat("int4r"), lay, 2, "cpu") for _ in range(2)]
    for c in caches:  # what the backend writes: rotated keys
        ref.write_kv_cache(qr.rotate(k), v, c, torch.arange(32))
    rows = torch.cat([read_blocks(c, [0, 1]) for c in caches], 1)  # 2 blocks x (2 layers' bytes)
    logical = dequantize(rows, lay, KVFormat("int4r"))  # [n, layers, 2, bs, H, D], keys rotated back
    assert (logical[:, 0, 0].flatten(0, 1) - k).abs().max() < 0.5
    as_model = convert_blocks(rows, lay, KVFormat("int4r"), KVFormat("model"))
    torch.testing.assert_close(dequantize(as_model, lay, KVFormat("model")), logical, atol=1e-5, rtol=0)
    back = convert_blocks(as_model, lay, KVFormat("model"), KVFormat("int4r"))
    assert (dequantize(back, lay, KVFormat("int4r")) - logical).abs().max() < 0.5

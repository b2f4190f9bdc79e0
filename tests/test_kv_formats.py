"""KV formats: sizes from (format, layout) alone, quantization round-trip bounds, block bytes I/O."""

import pytest
import torch

from kernels import quant_reference as qr
from kernels import reference as ref
from kernels.kv_cache import allocate_cache, read_blocks, write_blocks
from llmbus.kv.formats import KVFormat, parse_kv_format
from llmbus.kv.layout import KVLayout


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bytes_per_token_vs_bf16(head_dim):
    lay = KVLayout(num_layers=4, num_kv_heads=8, head_dim=head_dim, block_size=16, dtype="bfloat16")
    bf16 = KVFormat("model").bytes_per_token(lay)
    assert bf16 == lay.bytes_per_token
    assert KVFormat("int8").bytes_per_token(lay) <= 0.52 * bf16
    assert KVFormat("int4").bytes_per_token(lay) <= 0.30 * bf16


@pytest.mark.parametrize("name", ["model", "int8", "int4"])
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


@pytest.mark.parametrize("name", ["model", "int8", "int4"])
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


@pytest.mark.parametrize("name", ["int8", "int4"])
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
    if name == "int8":
        assert torch.equal(a, b)

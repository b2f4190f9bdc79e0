"""Packed projection weights on CPU (oneDNN's layout, or ours blocked for bf16 and float32): the
same products as F.linear, one copy of each weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmbus.kernels import cpu_native
from llmbus.engine.config import EngineConfig
from llmbus.engine.engine import Engine
from llmbus.model import cpu_linear
from llmbus.model.cpu_linear import PackedWeight
from llmbus.model.demo import make_demo_model

CPU = torch.device("cpu")


def _greedy(engine: Engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """12 greedy tokens and their logprobs."""
    from llmbus.engine.sampling_params import SamplingParams

    engine.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0))
    toks, lps = [], []
    while engine.has_unfinished():
        for out in engine.step():
            toks += out.new_token_ids
            lps += [lp.logprob for lp in out.logprobs or []]
    return toks, lps


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("gemm", ["auto", "onednn"])  # "auto": the blocked kernel where it runs
def test_packed_linear_equals_f_linear(dtype, atol, rows, with_bias, gemm, monkeypatch):
    monkeypatch.setenv("LLMBUS_CPU_GEMM", gemm)
    if not cpu_linear.packing_supported(dtype, CPU):
        pytest.skip(f"no packed layout for {dtype} here (LLMBUS_CPU_GEMM={gemm})")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 80, generator=g).to(dtype)
    packed = cpu_linear.pack(w)
    blocked = gemm == "auto" and cpu_native.linear_supported(w)  # bf16: the bf16 dot; fp32: AVX-512
    assert (packed.blocked is not None, packed.onednn is not None) == (blocked, not blocked)
    got = cpu_linear.linear(x, w, b, packed)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, 96)
    # bf16: both round the fp32-accumulated product once; compare against the fp32 product
    tol = atol if dtype == torch.float32 else 2 ** -7 * want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= tol + 1e-5


def test_packing_is_refused_where_unsupported():
    assert not cpu_linear.packing_supported(torch.float16, CPU)
    assert not cpu_linear.packing_supported(torch.float32, torch.device("meta"))


def test_engine_packs_its_model_and_keeps_one_copy(tmp_path):
    model_dir = make_demo_model(tmp_path / "m", "small")
    prompt = list(range(3, 40))
    packed = Engine.from_model_dir(str(model_dir), EngineConfig(dtype="float32", device="cpu"))
    plain = Engine.from_model_dir(str(model_dir), EngineConfig(dtype="float32", device="cpu", pack_cpu_weights=False))
    layer = packed.model.layers[0]
    assert set(layer.self_attn.packed) == {"qkv", "o"} and set(layer.mlp.packed) == {"gate_up", "down"}
    assert layer.self_attn.qkv_weight.numel() == 0 and layer.mlp.down_weight.numel() == 0  # plain copies freed
    assert plain.model.layers[0].self_attn.packed == {}
    assert packed.model.pack_cpu_weights() is False  # once only
    outs = {}
    for name, engine in (("packed", packed), ("plain", plain)):
        outs[name] = _greedy(engine, prompt)
    assert outs["packed"][0] == outs["plain"][0]
    assert outs["packed"][1] == pytest.approx(outs["plain"][1], abs=1e-4)


needs_bf16_kernel = pytest.mark.skipif(not cpu_native.has_linear_bf16(), reason="no bf16 linear kernel here (or no C compiler)")


def test_cpus_with_avx2_and_fma_have_both_linear_kernels():
    """AVX2 with FMA is enough for the blocked kernels of both dtypes (bf16 widened), so CPUs
    without AVX-512 (or without the bf16 dot instruction) still run the fused decode layers."""
    flags = set(cpu_native._cpu_flags().split())
    if not cpu_native.available() or not ({"avx2", "fma"} <= flags or "avx512f" in flags):
        pytest.skip("no C compiler, or a CPU with neither AVX2 with FMA nor AVX-512")
    assert cpu_native.has_linear_f32() and cpu_native.has_linear_bf16()
    assert cpu_linear.packing_supported(torch.bfloat16, CPU) and cpu_linear.packing_supported(torch.float32, CPU)


def _needs_kernel(dtype: torch.dtype) -> None:
    if not cpu_native.has_linear(dtype):
        pytest.skip(f"no blocked {dtype} kernel on this CPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(16, 2), (96, 80), (1280, 768), (64, 2048)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 150])
def test_blocked_linear_matches_the_fp64_product(n, k, rows, dtype):
    """Every row count the kernel special-cases (1-8 in registers, then passes of 8), and with K =
    2048 row tiles (150 rows: several tiles, the last partial); with and without bias."""
    _needs_kernel(dtype)
    g = torch.Generator().manual_seed(n * rows + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    blocked = cpu_native.to_blocked(w)
    for bias in (None, b):
        got = cpu_native.linear(x, blocked, bias)
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == dtype and got.shape == (rows, n)
        # fp32 sums (rounded once to bf16: within half a bf16 ulp) plus the fp32 summation error
        rounding = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -24
        err = (got.double() - want).abs() - rounding * want.abs()
        assert err.max().item() <= 1e-4 * k ** 0.5 * (1 + want.abs().max().item())


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (3, 32, 16, 2)), (torch.float32, (3, 64, 16))])
def test_blocked_layout_round_trips_and_takes_strided_rows(dtype, shape):
    _needs_kernel(dtype)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g).to(dtype)
    blocked = cpu_native.to_blocked(w)
    assert blocked.shape == shape and torch.equal(cpu_native.from_blocked(blocked), w)
    wide = torch.randn(5, 128, generator=g).to(dtype)
    rows = wide[:, 32:96]  # rows 128 apart
    assert torch.equal(cpu_native.linear(rows, blocked, None), cpu_native.linear(rows.contiguous(), blocked, None))
    with pytest.raises(ValueError, match="features"):
        cpu_native.linear(torch.zeros(2, 62, dtype=dtype), blocked, None)
    with pytest.raises(ValueError, match="bias has 16 values, the weight 48"):
        cpu_native.linear(rows, blocked, torch.zeros(16, dtype=dtype))
    assert cpu_native.linear(rows.to(torch.float16), blocked, None) is None  # other rows: the caller unblocks
    assert not cpu_native.linear_supported(torch.zeros(16, 0, dtype=dtype))  # nothing to block


@needs_bf16_kernel
def test_pack_chooses_the_blocked_layout_for_bf16_where_it_applies(monkeypatch):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)  # leading dims kept
    packed = cpu_linear.pack(w)
    assert packed.blocked is not None and packed.onednn is None
    assert torch.equal(cpu_linear.linear(x, w, None, packed), cpu_native.linear(x.reshape(6, 64), packed.blocked, None).reshape(2, 3, 32))
    # outputs not a multiple of 16, or oneDNN asked for: oneDNN's layout where it has one for bf16
    narrow = torch.randn(20, 64).to(torch.bfloat16)
    onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu_linear.can_pack(narrow) == onednn_bf16
    if onednn_bf16:
        assert cpu_linear.pack(narrow).onednn is not None
    else:
        with pytest.raises(ValueError, match="no packed layout"):
            cpu_linear.pack(narrow)
    assert cpu_linear.pack(torch.randn(20, 64)).onednn is not None
    assert (cpu_linear.pack(torch.randn(32, 64)).blocked is not None) == cpu_native.has_linear_f32()
    monkeypatch.setenv("LLMBUS_CPU_GEMM", "onednn")
    assert cpu_linear.can_pack(w) == onednn_bf16
    if onednn_bf16:
        assert cpu_linear.pack(w).blocked is None
    # rows the kernel does not take (features strided): the plain product from the unblocked weight
    cols = torch.randn(64, 2, generator=g).to(torch.bfloat16).T
    got = cpu_linear.linear(cols, w, None, PackedWeight(blocked=cpu_native.to_blocked(w)))
    assert torch.equal(got, F.linear(cols, w))


@needs_bf16_kernel
def test_bf16_engine_with_blocked_weights_generates_as_the_plain_model(tmp_path):
    model_dir = make_demo_model(tmp_path / "m", "small")
    prompt = list(range(3, 40))
    outs = {}
    for name, pack_weights in (("blocked", True), ("plain", False)):
        engine = Engine.from_model_dir(str(model_dir), EngineConfig(dtype="bfloat16", device="cpu", pack_cpu_weights=pack_weights))
        if pack_weights:
            assert engine.model.layers[0].mlp.packed["down"].blocked is not None
            assert engine.model.packed_lm_head.blocked is not None
        outs[name] = _greedy(engine, prompt)
    assert outs["blocked"][0] == outs["plain"][0]
    assert outs["blocked"][1] == pytest.approx(outs["plain"][1], abs=0.05)


def test_a_weight_no_layout_takes_leaves_the_model_unpacked(tmp_path, monkeypatch):
    """A bf16 model whose vocabulary is not a multiple of 16 (its head no blocked kernel takes) on a
    CPU where oneDNN has no bf16: nothing is packed, not half the model, and it still generates."""
    from llmbus.model.demo import write_random_model

    monkeypatch.setattr(cpu_linear, "_onednn_supported", lambda dtype, device: dtype == torch.float32)
    model_dir = write_random_model(tmp_path / "m", {"vocab_size": 1000, "num_hidden_layers": 2, "dtype": "bfloat16"})
    engine = Engine.from_model_dir(str(model_dir), EngineConfig(dtype="bfloat16", device="cpu"))
    model = engine.model
    assert model.packed_lm_head is None and model.layers[0].mlp.packed == {} and model.decode_stack is None
    assert model.layers[0].mlp.down_weight.numel() > 0  # the plain weights are kept
    toks, _ = _greedy(engine, list(range(3, 20)))
    assert len(toks) == 12 and all(0 <= t < 1000 for t in toks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_narrow_weights_split_rows_across_threads(dtype):
    """One block of 16 outputs and many rows (a narrow projection's prefill): the threads split the
    rows, each output summed as with one thread (the same bits)."""
    _needs_kernel(dtype)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(16, 256, generator=g).to(dtype)
    x = torch.randn(200, 256, generator=g).to(dtype)
    blocked = cpu_native.to_blocked(w)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.linear(x, blocked, None)
        torch.set_num_threads(2)
        two = cpu_native.linear(x, blocked, None)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)
    want = F.linear(x.double(), w.double())
    assert (one.double() - want).abs().max().item() <= 0.02 * want.abs().max().item()


def test_float32_sums_stay_accurate_over_long_rows():
    """Partial sums per chunk of inputs: at K = 14,336 (Llama-3-8B's MLP width) the relative error
    stays near oneDNN's (one running sum reached 3e-6)."""
    _needs_kernel(torch.float32)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 14336, generator=g)
    x = torch.randn(4, 14336, generator=g)
    got = cpu_native.linear(x, cpu_native.to_blocked(w), None).double()
    want = F.linear(x.double(), w.double())
    assert ((got - want).abs().max() / want.abs().max()).item() < 1.5e-6


AMX = pytest.mark.skipif(not cpu_native.has_amx_bf16(), reason="no AMX-BF16 here (or not granted)")


@AMX
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 130, 531])
@pytest.mark.parametrize("n,k", [(32, 64), (48, 96), (1280, 768), (96, 2048)])
def test_amx_linear_matches_the_fp64_product(rows, n, k):
    """The tiles over the blocked weight as it is: odd block counts (a pair's second block
    missing), rows not a multiple of 16 (padded), strided rows, a bias; rows past one pass's
    block of rows (256 at K = 768, 96 at 2,048) and weights past one run of pairs."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k + 8, generator=g).to(torch.bfloat16)[:, 4 : 4 + k]  # strided rows
    y = cpu_native.linear_amx(x, cpu_native.to_blocked(w), bias)
    want = (x.double() @ w.double().T + bias.double()).to(torch.bfloat16)
    torch.testing.assert_close(y, want, atol=1e-2, rtol=1e-2)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)


@AMX
def test_blocked_bf16_products_take_the_tiles_and_fall_back_where_they_cannot(monkeypatch):
    calls = []
    amx = cpu_native.linear_amx
    monkeypatch.setattr(cpu_native, "linear_amx", lambda *a: calls.append(1) or amx(*a))
    for k, tiles in [(64, True), (48, False)]:  # the tiles take inputs 32 at a time
        w = (torch.randn(32, k) * 0.05).to(torch.bfloat16)
        x = torch.randn(5, k).to(torch.bfloat16)
        y = cpu_linear.linear(x, w, None, cpu_linear.pack(w))
        torch.testing.assert_close(y, F.linear(x, w), atol=1e-2, rtol=1e-2)
        assert cpu_native.linear_amx(x, cpu_native.to_blocked(w), None) is not None if tiles else \
            cpu_native.linear_amx(x, cpu_native.to_blocked(w), None) is None
    assert calls


def test_llmbus_cpu_amx_0_keeps_the_avx512_kernel(monkeypatch):
    monkeypatch.setenv("LLMBUS_CPU_AMX", "0")
    cpu_linear.amx_bf16.cache_clear()
    try:
        assert not cpu_linear.amx_bf16()
    finally:
        monkeypatch.delenv("LLMBUS_CPU_AMX")
        cpu_linear.amx_bf16.cache_clear()

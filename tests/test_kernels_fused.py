"""llmbus.kernels.fused (a layer's norms, residual adds, rotation, SiLU-and-multiply in Triton) against
the torch references in llmbus.kernels.reference, under TRITON_INTERPRET=1 on CPU; and the model's
forward with them against its torch forward."""

import pytest
import torch

from llmbus.kernels import fused, reference
from llmbus.engine.attention import build_attention_metadata
from llmbus.model.rope import RotaryEmbedding
from llmbus.model.rope_config import RopeConfig

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# one rounding of the model dtype apart at most (the kernels sum and round in their own order)
TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.float32: dict(rtol=1e-5, atol=1e-5)}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [64, 100])
def test_rms_norm_with_and_without_the_residual_add(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(7, n, generator=g) * 3).to(DEV, dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(DEV, dtype)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), **TOL[dtype])
    residual = torch.randn(7, n, generator=g).to(DEV, dtype)
    want_sum = residual + x  # the model dtype's sum, exactly what the kernel must store
    out = fused.rms_norm(x, w, 1e-5, residual)
    if dtype == torch.bfloat16 and DEV == "cpu":  # NOTE: the interpreter truncates fp32 -> bf16 (a GPU rounds)
        torch.testing.assert_close(residual, want_sum, rtol=2**-7, atol=0)
    else:
        assert torch.equal(residual, want_sum)
    torch.testing.assert_close(out, reference.rms_norm(want_sum, w, 1e-5), **TOL[dtype])
    wide = torch.randn(7, 2 * n, generator=g).to(DEV, dtype)[:, :n]  # strided rows
    torch.testing.assert_close(fused.rms_norm(wide, w, 1e-6), reference.rms_norm(wide, w, 1e-6), **TOL[dtype])
    assert fused.rms_norm(x[:0], w, 1e-6).shape == (0, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,d", [((4, 2), 64), ((12, 4), 128), ((3, 1), 16), ((64, 8), 128), ((32, 8), 256)])
def test_rotary_in_place_on_the_qkv_projections_view(dtype, heads, d):
    hq, hkv = heads
    g = torch.Generator().manual_seed(d + hq)
    t = 9
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(DEV, dtype)
    before = qkv.clone()
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)  # strided rows, as the model hands it over
    positions = torch.randint(0, 4000, (t,), generator=g).to(DEV)
    cos, sin = RotaryEmbedding(RopeConfig(), d, 4096, DEV).cos_sin(positions, dtype)
    want = reference.rotary(qk.clone(), cos, sin)
    out = fused.rotary_(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    # NOTE: not bit for bit: on the H200 about one output in three still differed from torch's by
    # an ulp with the products rounded first (the interpreter truncates to bf16 besides), so the
    # bound is an ulp of the products, which near cancellation is what torch's own roundings cost
    ulp = {torch.bfloat16: 2**-7, torch.float32: 2**-23}[dtype] * float(before.abs().max())
    torch.testing.assert_close(out, want, rtol=0, atol=2 * ulp)
    assert torch.equal(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :])  # v untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("i", [48, 1500])
def test_silu_mul(dtype, i):
    g = torch.Generator().manual_seed(i)
    gate_up = (torch.randn(5, 2 * i, generator=g) * 4).to(DEV, dtype)
    torch.testing.assert_close(fused.silu_mul(gate_up), reference.silu_mul(gate_up), **TOL[dtype])


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="unit stride"):
        fused.rms_norm(torch.randn(4, 6, device=DEV).T, torch.ones(4, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused.rms_norm(torch.randn(4, 6), torch.ones(6), 1e-6, torch.randn(4, 5))
    with pytest.raises(ValueError, match="even"):
        fused.rotary_(torch.randn(2, 1, 5), torch.randn(2, 1, 2), torch.randn(2, 1, 2))
    with pytest.raises(ValueError, match="even"):
        fused.silu_mul(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"cos and sin of \[2, 1, 4\]"):
        fused.rotary_(torch.randn(2, 1, 8), torch.randn(2, 1, 2), torch.randn(2, 1, 2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_models_forward_with_fused_glue_matches_its_torch_forward(tmp_path, dtype):
    """The fused layer loop (residual carried, each norm adding the sublayer before it) gives the
    torch layers' hidden states, through prefill and decode steps."""
    from llmbus.engine.attention import TorchAttentionBackend
    from llmbus.model.loader import load_model
    from tests.model_factory import write_random_model

    model = load_model(write_random_model(tmp_path, {"num_hidden_layers": 3}, seed=5), dtype=dtype, device=DEV).model
    backend = TorchAttentionBackend()
    model.backend = backend
    cfg = model.config
    layout = cfg.kv_layout(16, dtype)
    outs = {}
    for fused_ops in (False, True):
        model.fused_ops = fused_ops
        caches = backend.allocate_cache(layout, 8, torch.device(DEV))
        tables = [[0, 1, 2], [3, 4, 5]]
        prompt = torch.randint(3, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1)).to(DEV)
        meta, pos = build_attention_metadata([(tables[0], 0, 21), (tables[1], 0, 21)], 16, DEV)
        steps = [model(prompt.reshape(-1), pos, caches, meta)]
        for t in range(21, 24):
            meta, pos = build_attention_metadata([(tables[0], t, 1), (tables[1], t, 1)], 16, DEV)
            steps.append(model(torch.tensor([5 + t, 9 + t], device=DEV), pos, caches, meta))
        outs[fused_ops] = steps
    # relative error of each step's hidden states: roundings in another order (and, under the
    # interpreter, bf16 conversions that truncate) stay at the dtype's precision after 3 layers
    bound = {"bfloat16": 4e-2, "float32": 1e-5}[dtype]  # measured 1.6-1.9% and 3.5e-7; a missing add: 135%
    for a, b in zip(outs[False], outs[True]):
        assert float((b.float() - a.float()).norm() / a.float().norm()) < bound

"""oneDNN-packed projection weights on CPU: the same products as F.linear, one copy of each weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmbus.engine.config import EngineConfig
from llmbus.engine.engine import Engine
from llmbus.model import cpu_linear
from llmbus.model.demo import make_demo_model

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(dtype, atol, rows, with_bias):
    if not cpu_linear.packing_supported(dtype, CPU):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 80, generator=g).to(dtype)
    got = cpu_linear.linear(x, w, b, cpu_linear.pack(w))
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
    from llmbus.engine.sampling_params import SamplingParams

    outs = {}
    for name, engine in (("packed", packed), ("plain", plain)):
        engine.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0))
        toks, lps = [], []
        while engine.has_unfinished():
            for out in engine.step():
                toks += out.new_token_ids
                lps += [lp.logprob for lp in out.logprobs or []]
        outs[name] = (toks, lps)
    assert outs["packed"][0] == outs["plain"][0]
    assert outs["packed"][1] == pytest.approx(outs["plain"][1], abs=1e-4)

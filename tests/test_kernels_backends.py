"""Attention backends: Triton and torch agree step by step through the AttentionBackend protocol."""

import pytest
import torch

from kernels.backends import TorchPagedAttentionBackend, TritonAttentionBackend, make_attention_backend  # noqa: E402
from llmbus.engine.attention import AttentionMetadata  # noqa: E402
from llmbus.kv.layout import KVLayout  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _meta(lay, tables, ctx, qlens, num_decodes):
    slots = sum((lay.slot_mapping(t, c - q, c) for t, c, q in zip(tables, ctx, qlens)), [])
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEV),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=DEV),
        query_start_loc=torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV),
        num_decodes=num_decodes,
    )


@pytest.mark.parametrize("fmt", ["model", "int8", "int4"])
def test_triton_and_torch_backends_agree_over_steps(fmt):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")
    tri, tor = TritonAttentionBackend(fmt), TorchPagedAttentionBackend(fmt)
    ca, cb = tri.allocate_cache(lay, 8, DEV)[0], tor.allocate_cache(lay, 8, DEV)[0]
    tables = [[3, 5, 0], [6, 1]]
    g = torch.Generator().manual_seed(3)
    # step 1: two prefill chunks; step 2: seq 0 decodes while seq 1 prefills more; step 3: both decode
    plan = [([14, 20], [14, 20], 0), ([15, 31], [1, 11], 1), ([16, 32], [1, 1], 2)]
    for ctx, qlens, nd in plan:
        t = sum(qlens)
        q = torch.randn(t, 4, 32, generator=g).to(DEV)
        k, v = torch.randn(t, 2, 32, generator=g).to(DEV), torch.randn(t, 2, 32, generator=g).to(DEV)
        meta = _meta(lay, tables, ctx, qlens, nd)
        a = tri.forward(q, k, v, ca, meta, 0.2)
        b = tor.forward(q, k, v, cb, meta, 0.2)
        torch.testing.assert_close(a, b, atol=1e-3 if fmt == "int4" else 2e-5, rtol=1e-3)
    # the handoff bytes move between backends
    blocks = tri.read_blocks(ca, [3, 5])
    tor.write_blocks(cb, [2, 4], blocks)
    assert torch.equal(tor.read_blocks(cb, [2, 4]), blocks)


def test_make_attention_backend_choices_and_errors():
    cpu = make_attention_backend("cpu", "int4")
    assert isinstance(cpu, TorchPagedAttentionBackend) and cpu.kv_format.name == "int4"
    with pytest.raises(ValueError, match="unknown KV format"):
        make_attention_backend("cpu", "int3")
    with pytest.raises(ValueError, match="unsupported device"):
        make_attention_backend("meta", "model")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            make_attention_backend("cuda", "int8")
    else:
        assert isinstance(make_attention_backend("cuda", "int8"), TritonAttentionBackend)

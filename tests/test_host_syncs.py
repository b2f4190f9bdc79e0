"""On CUDA a step's layers must queue without reading a device tensor back to the host: each such
read (``int(t)``, ``.item()``, ``.tolist()``) waits for every kernel launched before it. The
Triton path runs here on CPU tensors under ``TRITON_INTERPRET=1``; a read shows up as torch's
``_local_scalar_dense`` op on any device, which these tests count."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmbus.kernels.backends import TritonAttentionBackend
from llmbus.engine.attention import build_attention_metadata
from llmbus.engine.runner import TailRows
from llmbus.kv.layout import KVLayout
from llmbus.model.loader import load_model
from tests.model_factory import PagedDriver, write_random_model


class ScalarReads(TorchDispatchMode):
    """Counts tensor-to-host reads inside the ``with`` block: scalar reads, and ``tolist`` (which
    bypasses the dispatcher). NOTE: inference mode hides ops from dispatch modes, so the block
    leaves it (under ``no_grad``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __enter__(self):
        self._modes = (torch.inference_mode(False), torch.no_grad())
        for m in self._modes:
            m.__enter__()
        self._tolist = torch.Tensor.tolist
        probe = self

        def tolist(t):
            probe.count += 1
            return probe._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        torch.Tensor.tolist = self._tolist
        for m in reversed(self._modes):
            m.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_probe_sees_host_reads_in_inference_mode():
    with torch.inference_mode():
        t = torch.tensor([3, 4])
        with ScalarReads() as reads:
            int(t.max()), t.tolist()
    assert reads.count == 2


@pytest.mark.parametrize("fmt,fused", [("model", False), ("int8", False), ("int4", False), ("int4r", False),
                                       ("model", True)])
def test_model_steps_on_the_triton_backend_read_nothing_back(tmp_path, fmt, fused):
    """Prefill, mixed and decode-only steps through every layer of a model (``fused``: its glue
    in llmbus.kernels.fused, as on CUDA)."""
    loaded = load_model(write_random_model(tmp_path, {"num_hidden_layers": 2}, seed=3),
                        backend=TritonAttentionBackend(fmt))
    loaded.model.fused_ops = fused
    driver = PagedDriver(loaded.model, num_blocks=16, backend=loaded.model.backend)
    forward = loaded.model.forward
    counts = []

    def counted(*args, **kwargs):
        with ScalarReads() as reads:
            out = forward(*args, **kwargs)
        counts.append(reads.count)
        return out

    loaded.model.forward = counted
    driver.step([("a", list(range(1, 21))), ("b", list(range(5, 12)))])  # two prompts
    driver.step([("a", [7]), ("c", list(range(2, 19)))])  # a decode beside a prompt
    driver.step([("a", [8]), ("b", [9]), ("c", [10])])  # decodes only
    assert counts == [0, 0, 0]


def test_int4_tail_rows_read_nothing_back():
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    backend = TritonAttentionBackend("int4")
    cache = backend.allocate_cache(lay, 16, "cpu", tail_rows=4)[0]
    rows = TailRows(4)
    g = torch.Generator().manual_seed(0)
    for entries in ([([1, 2], 0, 20), ([3], 0, 5)], [([1, 2], 20, 1), ([3, 4], 5, 14)], [([1, 2], 21, 1), ([3, 4], 19, 1)]):
        pairs = [rows.rows_for(str(i), start, n, 16)[:2] for i, (_, start, n) in enumerate(entries)]
        meta, pos = build_attention_metadata(entries, 16, "cpu", pairs)
        t = pos.shape[0]
        q = torch.randn(t, 8, 64, generator=g).bfloat16()
        k, v = torch.randn(2, t, 2, 64, generator=g).bfloat16()
        with ScalarReads() as reads:
            backend.forward(q, k, v, cache, meta, 0.125)
        assert reads.count == 0

"""Attention metadata for one batched step, and the backends that consume it.

A step's tokens are flattened: the first ``num_decodes`` sequences are decodes (one query token
each), the rest are prefill chunks. The model hands each layer's q/k/v and that layer's opaque
cache object to the backend; only the backend knows what a cache object holds (a model-dtype
tensor here, data plus scales for quantized formats).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kernels import reference
from llmbus.kv.layout import KVLayout


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    block_tables: torch.Tensor  # [B, M] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step's write
    query_start_loc: torch.Tensor  # [B+1] int32: cumulative query lengths
    num_decodes: int  # sequences [0, num_decodes) have exactly one query token
    # NOTE: per-step data a backend derives from the fields above at the first layer and reuses in
    # every other layer (keyed by backend name). The fields above must not change within a step.
    backend_plans: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


class AttentionBackend(Protocol):
    name: str

    def allocate_cache(self, layout: KVLayout, num_blocks: int, device: torch.device) -> list[object]: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        cache: object,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [T, Hq, D]


_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


class TorchAttentionBackend:
    """Pure-torch paged attention (the kernels' reference), used on CPU."""

    name = "torch"

    def allocate_cache(self, layout: KVLayout, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        dtype = torch_dtype(layout.dtype)
        return [torch.zeros(layout.cache_shape(num_blocks), dtype=dtype, device=device) for _ in range(layout.num_layers)]

    @staticmethod
    def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """uint8 ``[n, layer_block_bytes]``: block ``i``'s keys then values."""
        sel = cache.index_select(1, block_ids).movedim(1, 0).contiguous()
        return sel.reshape(block_ids.numel(), -1).view(torch.uint8)

    @staticmethod
    def write_blocks(cache: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        n = block_ids.numel()
        shape = (n, 2, *cache.shape[2:])
        rows = data.to(cache.device).contiguous().view(cache.dtype).reshape(shape).movedim(0, 1)
        cache.index_copy_(1, block_ids, rows)

    def forward(self, q, k, v, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        reference.write_kv(k, v, cache, meta.slot_mapping)
        nd = meta.num_decodes
        out = torch.empty_like(q)
        if nd:
            out[:nd] = reference.paged_decode_attention(
                q[:nd], cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
            )
        if nd < meta.seq_lens.shape[0]:
            qsl = meta.query_start_loc[nd:] - meta.query_start_loc[nd]
            out[nd:] = reference.paged_prefill_attention(
                q[nd:], cache, meta.block_tables[nd:], meta.seq_lens[nd:], qsl, scale
            )
        return out

"""One layer's paged KV cache in a given format (see ``llmbus.kv.formats`` for the encodings).

A ``PagedKVCache`` is the opaque per-layer cache object the attention backends hand the model.
``read_blocks`` / ``write_blocks`` move whole blocks as bytes (``uint8 [n, layer_block_bytes]``),
the format-independent unit of the KV handoff between workers and tiers. An INT4 or INT4R cache
may also hold exact tail rows (``llmbus.kv.formats``), which are the worker's state and never move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmbus.kv.formats import KVFormat
from llmbus.kv.layout import KVLayout

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class PagedKVCache:
    fmt: KVFormat
    layout: KVLayout
    data: torch.Tensor  # [2, N, bs, H, D] model dtype | int8 [2, N, bs, H, D] | uint8 [2, N, bs, H, D/2]
    scale: torch.Tensor | None = None  # int8: [2, N, bs, H] fp16/fp32
    k_meta: torch.Tensor | None = None  # int4, int4r: int16 [N, H, key_meta_slots]
    v_meta: torch.Tensor | None = None  # int4, int4r: fp16 [N, bs, H, D/value group, 2]
    k_tail: torch.Tensor | None = None  # int4, int4r: model dtype [rows * bs, H, D], exact keys of filling blocks
    v_tail: torch.Tensor | None = None  # int4, int4r: as k_tail, their exact values

    def __post_init__(self) -> None:
        # NOTE: the kernels address both tails with one set of strides
        if (self.k_tail is None) != (self.v_tail is None) or (
                self.k_tail is not None and (self.k_tail.shape != self.v_tail.shape
                                             or self.k_tail.stride() != self.v_tail.stride())):
            raise ValueError("k_tail and v_tail must both be given, with one shape and layout, or neither")

    @property
    def num_tail_rows(self) -> int:
        return 0 if self.k_tail is None else self.k_tail.shape[0] // self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.data.shape[1]

    @property
    def model_dtype(self) -> torch.dtype:
        return _DTYPES[self.layout.dtype]

    def parts(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor of the cache with the index of its block dimension."""
        out = [(self.data, 1)]
        if self.scale is not None:
            out.append((self.scale, 1))
        if self.k_meta is not None:
            out += [(self.k_meta, 0), (self.v_meta, 0)]
        return out


def allocate_cache(fmt: KVFormat, layout: KVLayout, num_blocks: int, device: torch.device | str,
                   tail_rows: int = 0, head_major: bool = False) -> PagedKVCache:
    """Zeroed cache of ``num_blocks`` blocks for one layer; an INT4 or INT4R one with ``tail_rows``
    exact tail rows (other formats need none and ignore it).

    ``head_major``: the same tensors (shapes, dtypes, contents, ``read_blocks`` bytes) stored with
    each block's heads outside its tokens (``[.., N, H, bs, ..]`` in memory, viewed as
    ``[.., N, bs, H, ..]``), so one head's rows of a block are one contiguous run (for INT4 at
    head_dim 128, 1 KB where token-major storage gives 64-byte runs 512 bytes apart). The Triton
    kernels and the references take either (they index by strides); the CPU fast paths need the
    token-major default."""
    fmt.check(layout)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if tail_rows < 0:
        raise ValueError(f"tail_rows must be >= 0, got {tail_rows}")
    n, bs, h, d = num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim

    def zeros(*shape: int, dtype: torch.dtype, tokens: int) -> torch.Tensor:
        """Zeros of ``shape`` whose dimension ``tokens`` (a block's tokens, heads next) is stored
        inside the heads' when ``head_major``."""
        if not head_major:
            return torch.zeros(*shape, dtype=dtype, device=device)
        order = list(range(len(shape)))
        order[tokens], order[tokens + 1] = order[tokens + 1], order[tokens]
        return torch.zeros(*(shape[i] for i in order), dtype=dtype, device=device).permute(*order)

    if fmt.name == "model":
        return PagedKVCache(fmt, layout, zeros(2, n, bs, h, d, dtype=_DTYPES[layout.dtype], tokens=2))
    if fmt.name == "int8":
        data = zeros(2, n, bs, h, d, dtype=torch.int8, tokens=2)
        scale = zeros(2, n, bs, h, dtype=_DTYPES[fmt.scale_dtype], tokens=2)
        return PagedKVCache(fmt, layout, data, scale=scale)
    data = zeros(2, n, bs, h, d // 2, dtype=torch.uint8, tokens=2)
    k_meta = torch.zeros(n, h, fmt.key_meta_slots(d, bs), dtype=torch.int16, device=device)
    v_meta = zeros(n, bs, h, d // fmt.groups(d, bs)[0], 2, dtype=torch.float16, tokens=1)
    tails = [torch.zeros(tail_rows * bs, h, d, dtype=_DTYPES[layout.dtype], device=device) if tail_rows else None
             for _ in range(2)]
    return PagedKVCache(fmt, layout, data, k_meta=k_meta, v_meta=v_meta, k_tail=tails[0], v_tail=tails[1])


def _block_ids(cache: PagedKVCache, block_ids) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.long).reshape(-1).to(cache.data.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cache.num_blocks):
        raise ValueError(f"block ids must lie in [0, {cache.num_blocks}), got {ids.tolist()}")
    return ids


def read_blocks(cache: PagedKVCache, block_ids) -> torch.Tensor:
    """Bytes of the given blocks: ``uint8 [len(block_ids), fmt.layer_block_bytes(layout)]``."""
    ids = _block_ids(cache, block_ids)
    chunks = []
    for t, dim in cache.parts():
        sel = t.index_select(dim, ids).movedim(dim, 0).contiguous()
        chunks.append(sel.reshape(ids.numel(), -1).view(torch.uint8))
    return torch.cat(chunks, dim=1)


def write_blocks(cache: PagedKVCache, block_ids, data: torch.Tensor) -> None:
    """Inverse of ``read_blocks``: overwrite the given blocks with bytes read from a cache of the
    same format and layout."""
    ids = _block_ids(cache, block_ids)
    want = (ids.numel(), cache.fmt.layer_block_bytes(cache.layout))
    if data.dtype != torch.uint8 or tuple(data.shape) != want:
        raise ValueError(f"write_blocks expects uint8 {list(want)}, got {data.dtype} {list(data.shape)}")
    data = data.to(cache.data.device)
    col = 0
    for t, dim in cache.parts():
        shape = list(t.shape)
        shape.pop(dim)
        width = t.element_size() * int(torch.Size(shape).numel())
        part = data[:, col : col + width].contiguous().view(t.dtype).reshape(ids.numel(), *shape)
        t.index_copy_(dim, ids, part.movedim(0, dim))
        col += width

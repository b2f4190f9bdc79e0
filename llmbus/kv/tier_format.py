"""Converting whole KV blocks between formats at tier moves (tier 0 -> CPU -> SSD and back).

A block travels as uint8 rows ``[n, num_layers * layer_block_bytes]`` in one format of
``llmbus.kv.formats`` (what ``Engine.read_blocks`` gives, flattened per block). Conversion
dequantizes to fp32 with the torch references in ``llmbus/kernels/`` and re-encodes; every layer of every
block is independent, so the ``n * num_layers`` layer-blocks are converted as one batch.

NOTE: only full blocks are ever cached (their hashes name them), so INT4 keys are always in the
per-channel (sealed) encoding here. INT4R blocks hold rotated keys: a conversion to or from
another format rotates them (the Hadamard rotation is its own inverse). Quantized -> model dtype hands back dequantized values: a
lossy tier loses what its format loses, and promotion cannot restore it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmbus.kv.formats import KVFormat, parse_kv_format
from llmbus.kv.layout import KVLayout

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BlockCodec:
    """Sizes and conversion of one deployment's blocks: the layout and the tier-0 format."""

    layout: KVLayout
    tier0: KVFormat

    def block_bytes(self, fmt: KVFormat | None = None) -> int:
        return (fmt or self.tier0).bytes_per_block(self.layout)

    def convert(self, rows: torch.Tensor, src: KVFormat, dst: KVFormat) -> torch.Tensor:
        """uint8 ``[n, block_bytes(src)]`` -> uint8 ``[n, block_bytes(dst)]``."""
        return convert_blocks(rows, self.layout, src, dst)


def parse_tier_format(name: str, tier0: KVFormat) -> KVFormat:
    """``"same"`` (the tier-0 format), or a format of ``llmbus.kv.formats``."""
    return tier0 if name == "same" else parse_kv_format(name)


def convert_blocks(rows: torch.Tensor, layout: KVLayout, src: KVFormat, dst: KVFormat) -> torch.Tensor:
    from llmbus.kernels import reference
    from llmbus.kernels.quant_reference import rotate
    from llmbus.kernels.kv_cache import allocate_cache, read_blocks, write_blocks

    n = rows.shape[0]
    want = src.bytes_per_block(layout)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != want:
        raise ValueError(f"expected uint8 [n, {want}] blocks in format {src.name}, got {rows.dtype} {list(rows.shape)}")
    if src == dst or n == 0:
        return rows.clone() if n else rows.new_zeros((0, dst.bytes_per_block(layout)))
    m = n * layout.num_layers  # one "block" per (block, layer)
    ids = torch.arange(m)
    cache = allocate_cache(src, layout, m, "cpu")
    write_blocks(cache, ids, rows.reshape(m, src.layer_block_bytes(layout)))
    kv = reference.dequantize_blocks(cache, ids, torch.ones(m, dtype=torch.bool))  # [2, m, bs, H, D] fp32
    out = allocate_cache(dst, layout, m, "cpu")
    bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    k, v = kv[0].reshape(m * bs, h, d), kv[1].reshape(m * bs, h, d)
    if src.rotates_keys != dst.rotates_keys:
        k = rotate(k)
    if dst.name == "model":
        k, v = k.to(_DTYPES[layout.dtype]), v.to(_DTYPES[layout.dtype])
    reference.write_kv_cache(k, v, out, torch.arange(m * bs))
    return read_blocks(out, ids).reshape(n, dst.bytes_per_block(layout))


def dequantize(rows: torch.Tensor, layout: KVLayout, fmt: KVFormat) -> torch.Tensor:
    """Blocks as fp32 ``[n, num_layers, 2, bs, H, D]`` (what the tests compare), INT4R's keys rotated back."""
    from llmbus.kernels import reference
    from llmbus.kernels.quant_reference import rotate
    from llmbus.kernels.kv_cache import allocate_cache, write_blocks

    n = rows.shape[0]
    m = n * layout.num_layers
    ids = torch.arange(m)
    cache = allocate_cache(fmt, layout, m, "cpu")
    write_blocks(cache, ids, rows.reshape(m, fmt.layer_block_bytes(layout)))
    kv = reference.dequantize_blocks(cache, ids, torch.ones(m, dtype=torch.bool))
    if fmt.rotates_keys:
        kv[0] = rotate(kv[0])
    return kv.movedim(0, 1).reshape(n, layout.num_layers, 2, *kv.shape[2:])

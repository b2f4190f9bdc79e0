"""KV storage formats, defined once: the engine, the kernels and kvpool size and read blocks by them.

Four formats, all on the paged layout of ``llmbus.kv.layout`` (per layer, ``N`` blocks of
``bs`` tokens, ``H`` KV heads of ``D`` channels):

- ``model``: keys and values in the model dtype, one ``[2, N, bs, H, D]`` tensor.
- ``int8``: symmetric per token and head: ``data`` int8 ``[2, N, bs, H, D]`` and ``scale``
  ``[2, N, bs, H]`` (fp16 by default, or fp32); ``x ~= q * scale`` with ``scale = absmax / 127``.
- ``int4`` (KIVI-style, asymmetric, two values per byte, low nibble = even channel):
  ``data`` uint8 ``[2, N, bs, H, D/2]``.
  Values are quantized per token in groups of ``value_group`` channels; ``v_meta`` fp16
  ``[N, bs, H, D/value_group, 2]`` holds (scale, min) and ``x ~= min + q * scale``.
  Keys are quantized per channel over the block's tokens once the block is full (the group is
  the block). ``k_meta`` int16 ``[N, H, key_meta_slots]`` holds, for a full block, one uint16 per
  channel (low byte: min code, high byte: max code) and two fp16 bit patterns ``lo, hi`` at slots
  ``D, D+1``: channel ``c`` spans ``[lo + min_c * step, lo + max_c * step]`` with
  ``step = (hi - lo) / 255`` (a second-level quantization of the per-channel ranges, which is what
  keeps INT4 under 0.30x of bf16 with 16-token blocks). While a block is partial (the decode tail),
  its keys are stored per token in groups of ``key_group`` channels with fp16 (scale, min) pairs in
  the same ``k_meta`` slots: slot ``2 * (offset * D / key_group + g)`` is the scale, the next the min.

- ``int4r`` (INT4 with rotated keys, per token): keys are first rotated by the head_dim's
  orthonormal Hadamard matrix ``Hd`` (Sylvester's, scaled by ``1/sqrt(D)``: ``k' = k Hd``, computed
  in fp32 by the fast Walsh-Hadamard butterflies, ``quant_reference.rotate``), which
  spreads the outlier channels that KIVI's per-channel ranges exist for, then stored as INT4's
  partial-block keys are, per token, in every block, full or not, but in one group of all ``D``
  channels: ``k_meta`` int16 ``[N, H, 2 * bs]``, slot ``2 * offset`` the fp16 scale, the next
  the min. Values as INT4's, but in one group of ``D`` channels too. Attention is
  unchanged when the query is rotated the same way (``q . k = q Hd . k Hd``): the attention
  backends rotate queries and keys on the way in, so everything that reads the cache sees
  rotated keys. With per-token scales a decode kernel applies them to a tile's scores and
  probabilities, as INT8's, instead of to every code. Attention over an INT4R cache meets it
  with each query row (token, head) rounded to int8, symmetrically (step ``max |q| / 127``;
  ``llmbus.kernels.quant_reference.round_query``): the kernels' key dots are integer ones. Tail rows as
  INT4's (holding rotated keys). ``head_dim`` must be a power of two.

NOTE: whether an INT4 block is full is not stored: a reader knows it from the sequence length
(block ``j`` of a sequence of ``L`` tokens is full iff ``(j + 1) * bs <= L``), and the writer
re-quantizes a block per channel in the step that writes its last slot.

Exact tail rows (INT4, KIVI's full-precision residual): re-quantizing a sealing block from its
per-token codes would round its keys twice. So the writer may also keep each filling block's keys
and values exact in a *tail row* (``bs`` tokens of ``H x D`` keys and values in the model dtype,
outside the paged blocks: a worker's state, never part of a block's bytes) and seal from it;
attention then reads a partial block's keys and values from its row instead of their per-token
codes. The engine gives each running sequence two rows and switches to the other only when one
step both seals a block from its current row and starts the next block. A sequence without rows
(none left) uses its per-token codes; one handed over mid-block from another worker starts its row
from them (so those tokens' keys end up rounded twice).

Prefill over a quantized cache (all three quantized formats): a chunk's queries attend to the
prefix before it as the cache holds it and to the chunk's own keys and values as the model
computed them (the attention backends pass them beside the cache; ``llmbus.kernels.reference.exact_chunks``),
as KIVI's prefill does. Quantizing what a prompt writes then changes nothing in a prompt
prefilled in one pass: not its first token, and not the keys and values its later layers compute
and write (INT4R: but for its queries' int8 rounding). A prompt prefilled in several chunks, or
after a prefix-cache hit, reads its earlier part quantized, so its logits depend a little on how
it was scheduled (as an INT4 filling block's already did, exact in its tail row until sealed).
Decodes (one new token) read what the cache holds. This module is torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmbus.kv.layout import DTYPE_BYTES, KVLayout

KV_FORMATS = ("model", "int8", "int4", "int4r")
SCALE_DTYPES = ("float16", "float32")


@dataclass(frozen=True)
class KVFormat:
    name: str = "model"
    scale_dtype: str = "float16"  # int8 only; int4 metadata is always fp16

    def __post_init__(self) -> None:
        if self.name not in KV_FORMATS:
            raise ValueError(f"unknown KV format {self.name!r}: expected one of {', '.join(KV_FORMATS)}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"KVFormat.scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if self.int4_codes and self.scale_dtype != "float16":
            raise ValueError(f"{self.name} KV stores its scales as float16; scale_dtype must be 'float16'")

    @property
    def quantized(self) -> bool:
        return self.name != "model"

    @property
    def rotates_keys(self) -> bool:
        """Keys (and the queries that meet them) are rotated by the head_dim's Hadamard matrix."""
        return self.name == "int4r"

    @property
    def int4_codes(self) -> bool:
        """INT4 and INT4R: nibble-packed codes with ``k_meta`` / ``v_meta`` (one tensor layout, read
        and written by the same kernels and C passes, which tell the two apart by their groups)."""
        return self.name in ("int4", "int4r")

    @property
    def rewrites_slots(self) -> bool:
        """Each token's slot is encoded from that token alone (model dtype, INT8), so a slot written
        ahead and then given up (a speculative token the step rejected) is simply written again
        later. INT4's keys are sealed per block and its tail rows switch as blocks fill: neither
        can be taken back."""
        return not self.int4_codes

    @property
    def keeps_tails(self) -> bool:
        """The format may keep exact tail rows of filling blocks (INT4's two formats)."""
        return self.int4_codes

    def check(self, layout: KVLayout) -> None:
        """Raise ValueError if this format cannot store ``layout``."""
        if self.name == "int4" and layout.head_dim % 2:
            raise ValueError(f"int4 KV packs two channels per byte: head_dim must be even, got {layout.head_dim}")
        d = layout.head_dim
        if self.name == "int4r" and (d < 2 or d & (d - 1)):
            raise ValueError(f"int4r KV rotates keys by a Hadamard matrix: head_dim must be a power of two, got {d}")

    # -- int4 grouping ------------------------------------------------------------------------
    @staticmethod
    def value_group(head_dim: int) -> int:
        """Channels per (scale, min) pair of an INT4 value row."""
        return math.gcd(head_dim, 64)

    @staticmethod
    def key_group(head_dim: int, block_size: int) -> int:
        """Channels per (scale, min) pair of an INT4 key row while its block is partial."""
        return math.gcd(head_dim, 2 * block_size)

    def groups(self, head_dim: int, block_size: int) -> tuple[int, int]:
        """``(value group, per-token key group)`` of an INT4 row; INT4R's are the whole head
        (one (scale, min) pair per token, head and K or V: ``decode_tiles.int4_tokens_loop``)."""
        if self.name == "int4r":
            return head_dim, head_dim
        return self.value_group(head_dim), self.key_group(head_dim, block_size)

    def key_meta_slots(self, head_dim: int, block_size: int) -> int:
        """int16 slots of ``k_meta`` per block and head: room for either key encoding (INT4), the
        per-token one (INT4R)."""
        per_token = 2 * block_size * (head_dim // self.groups(head_dim, block_size)[1])
        return per_token if self.name == "int4r" else max(head_dim + 2, per_token)

    # -- sizes --------------------------------------------------------------------------------
    def layer_block_bytes(self, layout: KVLayout) -> int:
        """Bytes one block occupies in one layer, keys and values, metadata included."""
        self.check(layout)
        bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
        if self.name == "model":
            return 2 * bs * h * d * DTYPE_BYTES[layout.dtype]
        if self.name == "int8":
            return 2 * bs * h * d + 2 * bs * h * DTYPE_BYTES[self.scale_dtype]
        data = 2 * bs * h * (d // 2)
        k_meta = h * self.key_meta_slots(d, bs) * 2
        v_meta = bs * h * (d // self.groups(d, bs)[0]) * 2 * 2
        return data + k_meta + v_meta

    def bytes_per_block(self, layout: KVLayout) -> int:
        """Bytes one block occupies across all layers."""
        return self.layer_block_bytes(layout) * layout.num_layers

    def tail_row_bytes(self, layout: KVLayout) -> int:
        """Bytes of one exact tail row (keys and values) across all layers (0 for formats that need none)."""
        if not self.keeps_tails:
            return 0
        return 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim * DTYPE_BYTES[layout.dtype]

    def bytes_per_token(self, layout: KVLayout) -> float:
        """Average bytes per token across all layers (a block's bytes over its tokens)."""
        return self.bytes_per_block(layout) / layout.block_size


def parse_kv_format(name: str) -> KVFormat:
    """``"model" | "int8" | "int4" | "int4r"`` (the ``--kv-format`` option) -> KVFormat."""
    return KVFormat(name=name.strip().lower() if isinstance(name, str) else name)


def kv_block_bytes(layout: KVLayout, kv_format: str) -> int:
    """Bytes one block takes across all layers in ``kv_format`` (scales included)."""
    return parse_kv_format(kv_format).bytes_per_block(layout)

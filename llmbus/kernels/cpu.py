"""Fast paged attention on CPU for caches in the model dtype (``kv_format == "model"``).

Same cache objects and results as ``llmbus.engine.attention.TorchAttentionBackend`` (one raw
``[2, num_blocks, block_size, Hkv, D]`` tensor per layer, so ``read_blocks``/``write_blocks`` move
the same bytes), computed with batched matmuls (decodes) and
``torch.nn.functional.scaled_dot_product_attention`` (prefill chunks):

- Everything that depends only on the step (which blocks each sequence reads, padding and causal
  masks, how decodes are grouped) is built once, at the first layer, as a ``StepPlan`` kept on the
  ``AttentionMetadata``; the other layers reuse it.
- Decodes are processed in groups small enough that the gathered K/V stay in the CPU caches while
  they are read; the gather goes into one reused workspace (fresh multi-MB tensors per layer cost
  page faults). It gathers head-major (``[2, Hkv, blocks, bs, D]``), so each KV head's context is
  one contiguous matrix and the scores and the weighted sum are two batched matmuls over
  ``Hkv x group`` matrices, softmax in fp32 between them (2x faster than SDPA, whose flash kernel
  is tuned for long query blocks, not a decode's ``G`` rows). GQA needs no repeat: a decode's query
  heads are viewed as ``[Hkv, G]`` rows over their one KV head.
- Where the fused C kernel builds (``llmbus.kernels.cpu_native``, the default), decodes skip all of that:
  one call per layer reads every sequence's blocks in place (no gather, no padding to the longest
  sequence), 20% off a large-demo-model decode step at batch 32 against the gathered path.
- A prefill chunk with no cached prefix attends to its own k/v directly (no gather, causal SDPA);
  one with a prefix gathers its context blocks and uses a bottom-right causal mask.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmbus.kernels import cpu_native, reference
from llmbus.engine.attention import AttentionMetadata, TorchAttentionBackend, torch_dtype
from llmbus.kv.layout import KVLayout

# Gathered K+V bytes per decode group: small enough to stay in L2/L3 between gather and SDPA.
DECODE_GROUP_BYTES = 4 << 20
# NOTE: with several torch threads every group is a parallel region whose barrier costs dearly on a
# busy machine (measured on 2 shared cores: 32 MiB groups 1.3-2.7x faster than 4 MiB), so groups
# grow by this factor; with one thread small, cache-resident groups win.
THREADED_GROUP_FACTOR = 8


@dataclass
class DecodeGroup:
    start: int  # first decode row of the group
    end: int
    block_ids: torch.Tensor  # [(end - start) * nblk] int64: each sequence's first nblk blocks
    nblk: int
    mask: torch.Tensor | None  # [1, g, 1, nblk * bs] fp32 additive (0 / -inf); None when no padding


@dataclass
class PrefillChunk:
    start: int  # query rows [start, end) of the step
    end: int
    ctx: int  # context length after this step's write
    block_ids: torch.Tensor | None  # [nblk] int64; None when the chunk is its whole context
    mask: torch.Tensor | None  # [ql, ctx] additive causal mask aligned to the end; None with block_ids


@dataclass
class NativeDecodes:
    """The step's decode rows for the fused kernel, converted and checked once per step."""

    tables: torch.Tensor  # [num_decodes, max_blocks] int32, contiguous
    lens: torch.Tensor  # [num_decodes] int32


@dataclass
class NativePrefills:
    """The step's prefill chunks for the C prefill kernel (``cpu_native.prefill_into``)."""

    tables: torch.Tensor  # [chunks, max_blocks] int32
    rows: torch.Tensor  # [chunks] int32: first query row
    lens: torch.Tensor  # [chunks] int32: query rows
    ctxs: torch.Tensor  # [chunks] int32: context after this step's write


@dataclass
class StepPlan:
    """What every layer of one step shares: derived once from the step's AttentionMetadata."""

    decode_groups: list[DecodeGroup]
    empty_decodes: torch.Tensor | None  # decode rows with seq_len 0 (their output is zeros)
    prefills: list[PrefillChunk]
    native: NativeDecodes | None = None  # set: the fused kernel computes every decode row
    native_prefills: NativePrefills | None = None  # set: the C kernel computes every prefill row


def build_plan(meta: AttentionMetadata, block_size: int, row_bytes: int, dtype: torch.dtype,
               group_bytes: int = DECODE_GROUP_BYTES, native: bool = False, native_prefill: bool = False) -> StepPlan:
    """``row_bytes``: bytes of one token's keys plus values in one layer; ``group_bytes``: the
    gathered K/V budget of one decode group (a group holds at least one sequence); ``native``: the
    decodes go to the fused kernel instead of gathered groups; ``native_prefill``: the prefill
    chunks go to the C prefill kernel instead of SDPA."""
    nd = meta.num_decodes
    lens = meta.seq_lens.tolist()
    starts = meta.query_start_loc.tolist()
    if len(starts) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(starts)} entries for {len(lens)} sequences (expected one more)")
    if any(starts[i + 1] - starts[i] != 1 for i in range(nd)):
        raise ValueError("the first num_decodes sequences must have exactly one query token each")
    tables = meta.block_tables.to(torch.int64)
    dev = meta.block_tables.device
    groups: list[DecodeGroup] = []
    i = nd if native else 0
    while i < nd:
        j, longest = i, 0
        while j < nd:
            longest_j = max(longest, lens[j])
            if j > i and (j + 1 - i) * longest_j * row_bytes > group_bytes:
                break
            longest, j = longest_j, j + 1
        groups.append(_decode_group(tables, lens, i, j, longest, block_size, dev))
        i = j
    empty = [] if native else [r for r in range(nd) if lens[r] == 0]
    prefills = []
    chunks = []  # (sequence, first row, rows, context) for the C prefill kernel
    for s in range(nd, len(lens)):
        q0, q1, ctx = starts[s], starts[s + 1], lens[s]
        ql = q1 - q0
        if ql == 0:
            continue
        if ql > ctx:
            raise ValueError(f"sequence {s} has {ql} query tokens but a context of only {ctx}")
        if native_prefill:
            chunks.append((s, q0, ql, ctx))
            continue
        if ctx == ql:
            prefills.append(PrefillChunk(q0, q1, ctx, None, None))
            continue
        nblk = -(-ctx // block_size)
        q_pos = torch.arange(ctx - ql, ctx, device=dev)
        k_pos = torch.arange(ctx, device=dev)
        mask = _additive(k_pos[None, :] <= q_pos[:, None], dtype)
        prefills.append(PrefillChunk(q0, q1, ctx, tables[s, :nblk].contiguous(), mask))
    empty_rows = torch.tensor(empty, dtype=torch.int64, device=dev) if empty else None
    fused = None
    if native and nd:
        fused = NativeDecodes(*cpu_native.prepare_tables(meta.block_tables[:nd], meta.seq_lens[:nd], block_size))
    native_prefills = None
    if chunks:
        seqs, rows, qls, ctxs = (torch.tensor(col, dtype=torch.int32) for col in zip(*chunks))
        native_prefills = NativePrefills(meta.block_tables[seqs.long()].to(torch.int32).contiguous(), rows, qls, ctxs)
    return StepPlan(groups, empty_rows, prefills, fused, native_prefills)


def _decode_group(tables, lens, i, j, longest, block_size, dev) -> DecodeGroup:
    nblk = max(1, -(-longest // block_size))
    ids = tables[i:j, :nblk].reshape(-1)
    if all(lens[r] == nblk * block_size for r in range(i, j)):
        return DecodeGroup(i, j, ids, nblk, None)
    pos = torch.arange(nblk * block_size, device=dev)
    seq = torch.tensor(lens[i:j], device=dev)
    # NOTE: a zero-length row would be all -inf (NaN in the softmax); it attends to its padding instead
    # and the backend zeroes its output afterwards.
    live = (pos[None, :] < seq[:, None]) | (seq[:, None] == 0)
    return DecodeGroup(i, j, ids, nblk, _additive(live, torch.float32)[None, :, None, :])


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def _checked_ids(cache: torch.Tensor, block_ids) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1).to(cache.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cache.shape[1]):
        raise ValueError(f"block ids must lie in [0, {cache.shape[1]}), got {ids.tolist()}")
    return ids


class CpuAttentionBackend:
    """Implements ``llmbus.engine.attention.AttentionBackend`` for model-dtype caches on CPU."""

    name = "cpu"

    def __init__(self, decode_group_bytes: int | None = None, native: bool | None = None) -> None:
        """``decode_group_bytes``: gathered K/V budget of one decode group; None picks it from the
        number of torch threads at each step. ``native``: decodes through the fused C kernel (True:
        required, False: never, None: where it builds and supports the shape)."""
        if decode_group_bytes is not None and (not isinstance(decode_group_bytes, int) or decode_group_bytes < 1):
            raise ValueError(f"decode_group_bytes must be a positive integer or None, got {decode_group_bytes!r}")
        self.decode_group_bytes = decode_group_bytes
        self.native = native
        if native is not False:
            cpu_native.available()  # NOTE: builds (or loads) the kernel now, not inside the first step
        self._local = threading.local()  # NOTE: one gather workspace per thread (micro-batches run in parallel)

    def allocate_cache(self, layout: KVLayout, num_blocks: int, device: torch.device,
                       tail_rows: int = 0) -> list[torch.Tensor]:
        """``tail_rows``: exact tail rows, which the model dtype does not need (ignored)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        dtype = torch_dtype(layout.dtype)
        return [torch.zeros(layout.cache_shape(num_blocks), dtype=dtype, device=device) for _ in range(layout.num_layers)]

    @staticmethod
    def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """uint8 ``[n, layer_block_bytes]`` (block ``i``'s keys then values): the same bytes as
        ``llmbus.kernels.kv_cache.read_blocks`` for a ``model``-format cache."""
        return TorchAttentionBackend.read_blocks(cache, _checked_ids(cache, block_ids))

    @staticmethod
    def write_blocks(cache: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        ids = _checked_ids(cache, block_ids)
        want = (ids.numel(), cache[:, 0].numel() * cache.element_size())
        if data.dtype != torch.uint8 or tuple(data.shape) != want:
            raise ValueError(f"write_blocks expects uint8 {list(want)}, got {data.dtype} {list(data.shape)}")
        TorchAttentionBackend.write_blocks(cache, ids, data)

    def _native(self, cache: torch.Tensor, num_q_heads: int) -> bool:
        _, _, bs, hkv, d = cache.shape
        if self.native is False:
            return False
        ok = cpu_native.supports(cache.dtype, num_q_heads, hkv, d, bs) and cpu_native.available()
        if self.native and not ok:
            raise ValueError(f"the fused CPU decode kernel was asked for but cannot serve {cache.dtype} caches with "
                             f"{num_q_heads}/{hkv} heads, head_dim {d}, block size {bs} (or did not build)")
        return ok

    def plan(self, cache: torch.Tensor, meta: AttentionMetadata, num_q_heads: int) -> StepPlan:
        """The step's plan, built by the first layer that asks and kept on ``meta``."""
        plan = meta.backend_plans.get(self.name)
        if plan is None:
            _, _, bs, h, d = cache.shape
            budget = self.decode_group_bytes or DECODE_GROUP_BYTES * (
                THREADED_GROUP_FACTOR if torch.get_num_threads() > 1 else 1)
            plan = build_plan(meta, bs, 2 * h * d * cache.element_size(), cache.dtype, budget,
                              native=self._native(cache, num_q_heads),
                              native_prefill=self.native is not False and cpu_native.prefill_supports(
                                  cache.dtype, num_q_heads, h, d, bs))  # fmt: skip
            meta.backend_plans[self.name] = plan
        return plan

    def native_decode_tables(self, cache, meta: AttentionMetadata, num_q_heads: int) -> NativeDecodes | None:
        """The step's tables for the fused kernel when it computes every row of the step (all
        decodes, a cache it serves: ``cpu_native.supports``), else None: what a caller running the
        whole step's attention in C (``cpu_native.decode_layers``) needs."""
        if not isinstance(cache, torch.Tensor) or cache.dim() != 5:
            return None
        plan = self.plan(cache, meta, num_q_heads)
        if plan.decode_groups or plan.prefills or plan.native_prefills is not None:
            return None
        return plan.native

    def forward(self, q, k, v, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``; writes k/v into ``cache`` first."""
        if not isinstance(cache, torch.Tensor) or cache.dim() != 5:
            raise ValueError("CpuAttentionBackend needs the raw [2, N, bs, Hkv, D] cache tensors it allocated")
        if q.dtype != cache.dtype:
            raise ValueError(f"queries are {q.dtype} but the cache holds {cache.dtype}: this backend needs the model dtype")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
        reference.write_kv(k, v, cache, meta.slot_mapping)
        plan = self.plan(cache, meta, q.shape[1])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # NOTE: contiguous even if q is a permuted view
        if plan.native is not None:
            nd = plan.native.lens.shape[0]
            cpu_native.decode_into(out[:nd], q[:nd].contiguous(), cache, plan.native.tables, plan.native.lens, scale)
        for g in plan.decode_groups:
            out[g.start : g.end] = self._decode(q[g.start : g.end], cache, g, scale)
        if plan.empty_decodes is not None:
            out.index_fill_(0, plan.empty_decodes, 0)
        if plan.native_prefills is not None:
            p = plan.native_prefills
            cpu_native.prefill_into(out, q, cache, p.tables, p.rows, p.lens, p.ctxs, scale)
        for c in plan.prefills:
            out[c.start : c.end] = self._prefill(q, k, v, cache, c, scale)
        return out

    def _workspace(self, cache: torch.Tensor, numel: int) -> torch.Tensor:
        """``numel`` elements of this thread's reused gather workspace."""
        ws = getattr(self._local, "workspace", None)
        if ws is None or ws.numel() < numel or ws.dtype != cache.dtype or ws.device != cache.device:
            keep = ws.numel() if ws is not None and ws.dtype == cache.dtype else 0
            ws = self._local.workspace = torch.empty(max(numel, keep), dtype=cache.dtype, device=cache.device)
        return ws[:numel]

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """``[2, n, bs, Hkv, D]``: the blocks' keys and values, in the reused workspace."""
        n_blocks = cache.shape[1]
        per_block = cache[0, 0].numel()
        out = self._workspace(cache, 2 * block_ids.numel() * per_block).view(2, block_ids.numel(), per_block)
        torch.index_select(cache.view(2, n_blocks, per_block), 1, block_ids, out=out)
        return out.view(2, block_ids.numel(), *cache.shape[2:])

    def _gather_by_head(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """``[2, Hkv, n, bs, D]``: the blocks' keys and values, head-major, in the workspace."""
        _, _, bs, h, d = cache.shape
        out = self._workspace(cache, 2 * block_ids.numel() * bs * h * d).view(2, h, block_ids.numel(), bs, d)
        torch.index_select(cache.permute(0, 3, 1, 2, 4), 2, block_ids, out=out)
        return out

    def _decode(self, q, cache, g: DecodeGroup, scale: float) -> torch.Tensor:
        b, hq, d = q.shape
        hkv = cache.shape[3]
        kv = self._gather_by_head(cache, g.block_ids).view(2, hkv, b, -1, d)  # [2, Hkv, b, L, D]
        # NOTE: query head h reads KV head h // G, so [b, Hq, D] viewed as [b, Hkv, G, D] puts each
        # group of query heads as G query rows over its one KV head.
        qg = q.view(b, hkv, hq // hkv, d).transpose(0, 1)  # [Hkv, b, G, D]
        scores = torch.matmul(qg, kv[0].transpose(-1, -2)).float().mul_(scale)  # [Hkv, b, G, L]
        if g.mask is not None:
            scores.add_(g.mask)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, kv[1]).transpose(0, 1).reshape(b, hq, d)

    def _prefill(self, q, k, v, cache, c: PrefillChunk, scale: float) -> torch.Tensor:
        hq, hkv = q.shape[1], k.shape[1]
        qc = q[c.start : c.end].transpose(0, 1)[None]  # [1, Hq, ql, D]
        if c.block_ids is None:
            kc = k[c.start : c.end].transpose(0, 1)[None]
            vc = v[c.start : c.end].transpose(0, 1)[None]
            res = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale,
                                                 enable_gqa=hq != hkv)
        else:
            kv = self._gather(cache, c.block_ids).flatten(1, 2)[:, : c.ctx].transpose(1, 2)  # [2, Hkv, ctx, D]
            res = F.scaled_dot_product_attention(qc, kv[0][None], kv[1][None], attn_mask=c.mask, scale=scale,
                                                 enable_gqa=hq != hkv)
        return res[0].transpose(0, 1)

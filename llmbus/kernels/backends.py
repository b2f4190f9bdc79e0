"""Attention backends over paged caches of any KV format (``llmbus.kv.formats``).

Both implement ``llmbus.engine.attention.AttentionBackend``; their per-layer cache objects are
``llmbus.kernels.kv_cache.PagedKVCache``. ``read_blocks`` / ``write_blocks`` move whole blocks as bytes
for the KV handoff between workers and tiers (same bytes on either backend).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from llmbus.kernels import cpu_native, kv_cache, reference
from llmbus.kernels import quant_reference as qr
from llmbus.kernels.cpu import NativeDecodes
from llmbus.kv.formats import KVFormat, parse_kv_format
from llmbus.kv.layout import KVLayout

# NOTE: on CUDA the engine's paged caches are stored head-major (kv_cache.allocate_cache: the same
# tensors and bytes, one head's rows of a block contiguous). On the H200 (2026-12-04, batch 256 x
# 32,768, scripts/bench_gpu.py) decode read INT4R's 88% of peak bandwidth head-major against 51%
# token-major, INT4's 48% against 43%, INT8's 88% against 82%, bf16's 93-94% either way: a program
# reads one long run a block instead of 64-256-byte slices. LLMBUS_KV_HEAD_MAJOR=1 or 0 forces
# either; the CPU fast paths need token-major caches (head-major there falls back to the torch
# references and, for decode, C attention over a dequantized copy).
HEAD_MAJOR = {"0": False, "1": True}.get(os.environ.get("LLMBUS_KV_HEAD_MAJOR", ""))
# The CPU backend lays a prefill of fresh prompts out from their chunks' own keys and values instead
# of dequantizing their blocks and writing the chunks over them (the same bytes; off: the long way,
# for comparison)
FRESH_FROM_CHUNKS = True


def head_major(device) -> bool:
    """Whether the engine stores its paged caches head-major on ``device`` (``HEAD_MAJOR``)."""
    return torch.device(device).type == "cuda" if HEAD_MAJOR is None else HEAD_MAJOR


class _PagedBackend:
    name = "paged"
    _rotate = staticmethod(qr.rotate)  # INT4R's rotation of queries and keys

    def __init__(self, kv_format: str | KVFormat = "model") -> None:
        self.kv_format = kv_format if isinstance(kv_format, KVFormat) else parse_kv_format(kv_format)

    def allocate_cache(self, layout: KVLayout, num_blocks: int, device,
                       tail_rows: int = 0) -> list[kv_cache.PagedKVCache]:
        """One cache per layer; ``tail_rows``: exact tail rows, for formats that keep them."""
        return [kv_cache.allocate_cache(self.kv_format, layout, num_blocks, device, tail_rows,
                                         head_major=head_major(device))
                for _ in range(layout.num_layers)]

    @staticmethod
    def fill_tail(cache: kv_cache.PagedKVCache, block: int, row: int) -> None:
        """Start tail row ``row`` from filling block ``block`` (written before the row was given)."""
        reference.fill_tail(cache, block, row)

    read_blocks = staticmethod(kv_cache.read_blocks)
    write_blocks = staticmethod(kv_cache.write_blocks)

    def forward(self, q, k, v, cache: kv_cache.PagedKVCache, meta, scale: float) -> torch.Tensor:
        """Write this step's K/V, then decodes (the first ``meta.num_decodes`` sequences) and
        prefill chunks attend over the cache. NOTE: nothing here reads a device tensor back to the
        host (the bounds come from the metadata's host-side fields), so on CUDA a step's layers
        queue without waiting on one another. INT4R rotates the queries and keys first
        (``llmbus.kv.formats``): what the cache holds and the kernels meet are rotated keys. A prefill
        chunk attends to its own keys and values as computed (``reference.exact_chunks``), to its
        prefix as the cache holds it."""
        if self.kv_format.rotates_keys:
            q, k = self._rotate(q), self._rotate(k)
        self._write(k, v, cache, meta.slot_mapping, meta.tail_slots)
        nd, b = meta.num_decodes, meta.seq_lens.shape[0]
        rows = meta.tail_rows
        if nd == b:  # a decode-only step: no copy into a joint output
            return self._decode(q, cache, meta.block_tables, meta.seq_lens, scale, rows, meta.max_decode_len)
        if nd == 0:
            return self._prefill(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, rows,
                                 meta.max_query_len, (k, v))
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                None if rows is None else rows[:nd], meta.max_decode_len)
        out[nd:] = self._prefill(q[nd:], cache, meta.block_tables[nd:], meta.seq_lens[nd:], meta.prefill_query_start_loc(),
                                 scale, None if rows is None else rows[nd:], meta.max_query_len, (k[nd:], v[nd:]))
        return out


class TorchPagedAttentionBackend(_PagedBackend):
    """Pure-torch references over any KV format; the CPU engine's backend for int8/int4."""

    name = "torch"
    _write = staticmethod(reference.write_kv_cache)

    @staticmethod
    def _decode(q, cache, block_tables, seq_lens, scale, tail_rows=None, max_seq_len=None):
        return reference.paged_decode_attention_cache(q, cache, block_tables, seq_lens, scale, tail_rows)

    @staticmethod
    def _prefill(q, cache, block_tables, seq_lens, qsl, scale, tail_rows=None, max_query_len=None, chunk=None):
        return reference.paged_prefill_attention_cache(q, cache, block_tables, seq_lens, qsl, scale, tail_rows, chunk)


def _sdpa_chunks(q, kv, tables, seq_lens, qsl, scale, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Prefill chunks over an fp32 context ``kv [2, n, bs, Hkv, D]`` with ``tables`` into it as
    ``reference.dequantized_context`` returns them (row i: consecutive ids), each by torch's SDPA in
    fp32: chunk i's queries ``q[qsl[i]:qsl[i+1]]`` end at position ``seq_lens[i]``; the output in
    ``out_dtype`` (default ``q``'s). NOTE: each chunk sees its context cut at ``seq_lens[i]``: slots
    past a sequence's end may decode to inf/NaN, which SDPA would spread even from masked positions."""
    bs, hq, hkv = kv.shape[2], q.shape[1], kv.shape[3]
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype)
    for i, (q0, q1, ctx) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), seq_lens.tolist())):
        if q1 == q0:
            continue
        first = int(tables[i, 0])
        ctx_kv = kv[:, first : first + -(-ctx // bs)].flatten(1, 2)[:, :ctx].transpose(1, 2)  # [2, Hkv, ctx, D]
        qc = q[q0:q1].float().transpose(0, 1)[None]
        if ctx == q1 - q0:  # a fresh prompt: plain causal
            res = F.scaled_dot_product_attention(qc, ctx_kv[0][None], ctx_kv[1][None], is_causal=True, scale=scale,
                                                 enable_gqa=hq != hkv)
        else:
            allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - (q1 - q0), ctx)[:, None]
            res = F.scaled_dot_product_attention(qc, ctx_kv[0][None], ctx_kv[1][None], attn_mask=allowed, scale=scale,
                                                 enable_gqa=hq != hkv)
        out[q0:q1] = res[0].transpose(0, 1).to(out.dtype)
    return out


class CpuPagedAttentionBackend(TorchPagedAttentionBackend):
    """The CPU engine's backend for int8/int4 caches (``llmbus.kernels.cpu_native``): decodes through the
    fused C kernel, int8 and int4 dequantized inside it (int4, where the kernel does not take the
    query's dtype, dequantized first for the blocks its batch reads with the C pass
    ``dequantize_int4_blocks``, then attended in fp32); prefill chunks over their context dequantized
    once, through the C prefill kernel (bf16, where the CPU has the bf16 dot instruction) or torch's
    SDPA in fp32; the quantizing writes in C. Each replaces the reference's padded, head-repeated
    einsums (a large-demo-model step at batch 32 spent ~400 ms there in decode; prefill of 8 x 1,024
    tokens took 3x the bf16 model's). Where the C kernels did not build, decode and writes use the
    references."""

    name = "cpu-paged"

    @staticmethod
    def _rotate(x: torch.Tensor) -> torch.Tensor:
        # NOTE: one C pass, the reference's bits (torch's butterflies take three passes a stage)
        out = cpu_native.rotate(x)
        return qr.rotate(x) if out is None else out

    @staticmethod
    def _write(k, v, cache, slot_mapping, tail_slots=None):
        # NOTE: the quantizing writes in one C call, the same bytes as the reference's torch ops
        if cache.fmt.int4_codes and cpu_native.write_int4(k, v, cache, slot_mapping, tail_slots):
            return
        if cache.fmt.name == "int8" and cpu_native.write_int8(k, v, cache, slot_mapping):
            return
        reference.write_kv_cache(k, v, cache, slot_mapping, tail_slots)

    def native_decode_tables(self, cache, meta, num_q_heads: int) -> NativeDecodes | None:
        """The step's tables for ``cpu_native.decode_layers`` (which runs every layer of a step in
        one C call) when every row of the step is a decode whose quantizing write and attention the
        C kernels do, over an int8, int4 or int4r cache in the model dtype; None otherwise (the layers run
        one by one, each through ``forward``). ``cache`` is the first layer's; the others must
        match it (``decode_layers`` raises otherwise: the engine allocates them alike)."""
        lay, nd = cache.layout, meta.num_decodes
        if (cache.fmt.name == "model" or nd == 0 or nd != meta.seq_lens.shape[0] or not cpu_native.available()
                or not cpu_native.supports(cache.model_dtype, num_q_heads, lay.num_kv_heads, lay.head_dim,
                                           lay.block_size)):
            return None
        if cache.fmt.name == "int8" and not cpu_native.int8_tensors_fit(cache):
            return None
        if cache.fmt.int4_codes and not (cpu_native.INT4_FUSED
                                         and cpu_native.int4_tensors_fit(cache, cache.model_dtype, tails=True)):
            return None
        plan = meta.backend_plans.get(self.name)
        if plan is None:
            plan = meta.backend_plans[self.name] = NativeDecodes(
                *cpu_native.prepare_tables(meta.block_tables, meta.seq_lens, lay.block_size))
        return plan

    @staticmethod
    def _prefill(q, cache, block_tables, seq_lens, qsl, scale, tail_rows=None, max_query_len=None, chunk=None):
        lay = cache.layout
        if cache.fmt.name == "model" or block_tables.shape[0] == 0 or not q.is_floating_point():
            return reference.paged_prefill_attention_cache(q, cache, block_tables, seq_lens, qsl, scale, tail_rows,
                                                           chunk)
        # NOTE: INT4R's rounded query (fp32) goes to SDPA as it is; the C kernel takes it in bf16,
        # as it takes the context (a bf16 rounding of each, within the model dtype's tolerance)
        dtype = q.dtype
        c_kernel = dtype == torch.bfloat16 and cpu_native.available() and cpu_native.prefill_supports(
            dtype, q.shape[1], lay.num_kv_heads, lay.head_dim, lay.block_size)
        # the C prefill kernel reads bf16 (as the GPU kernels round the context to fp16), SDPA fp32
        kv_dtype = torch.bfloat16 if c_kernel else torch.float32
        lens = qsl[1:] - qsl[:-1]
        if FRESH_FROM_CHUNKS and chunk is not None and torch.equal(seq_lens.to(lens.device, lens.dtype), lens):
            # NOTE: fresh prompts attend to their own chunks alone, which the cache's codes would only
            # have been overwritten with (exact_chunks): laid out from the chunks, nothing dequantized
            # (the same bytes reach the kernels; ~6% of a 4 x 1,024-token INT4 prefill)
            kv, tables = _chunk_context(*chunk, qsl, lay.block_size, kv_dtype)
        else:
            # NOTE: the chunks' context dequantized once, then attended as model-dtype context is: the
            # reference's padded fp32 score matrices made quantized prefill ~3x the bf16 one
            dequantize = cpu_native.dequantize_int4_blocks if cache.fmt.int4_codes else None
            kv, tables = reference.dequantized_context(cache, block_tables, seq_lens, zero_past_end=False,
                                                       tail_rows=tail_rows, dequantize=dequantize)
            if chunk is not None:
                reference.exact_chunks(kv, tables, *chunk, seq_lens, qsl)
            kv = kv.to(kv_dtype)
        qsl = qsl.to(torch.int32)
        if c_kernel:
            q = _cache_query(q, cache, dtype)
            if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
                q = q.contiguous()
            out = torch.empty(q.shape, dtype=dtype)
            cpu_native.prefill_into(out, q, kv, tables, qsl[:-1].contiguous(), lens.to(torch.int32).contiguous(),
                                    seq_lens.to(torch.int32).contiguous(), scale)
            return out
        return _sdpa_chunks(_cache_query(q, cache), kv, tables, seq_lens, qsl, scale, dtype)

    @staticmethod
    def _decode(q, cache, block_tables, seq_lens, scale, tail_rows=None, max_seq_len=None):
        lay = cache.layout
        if (cache.fmt.name == "model" or q.shape[0] == 0 or not cpu_native.available()
                or not cpu_native.supports(torch.float32, q.shape[1], lay.num_kv_heads, lay.head_dim, lay.block_size)):
            return reference.paged_decode_attention_cache(q, cache, block_tables, seq_lens, scale, tail_rows)
        if cache.fmt.name == "int8" and q.dtype in (torch.float32, torch.bfloat16) and cpu_native.int8_tensors_fit(cache):
            # NOTE: int8 dequantizes inside the kernel, reading half the bytes of a bf16 cache (a
            # head-major cache takes the dequantized copy below: the kernel would copy it whole)
            return cpu_native.paged_decode(q, cache.data, block_tables, seq_lens, scale, scales=cache.scale)
        if cache.fmt.int4_codes:
            # NOTE: int4 (and int4r) widen their blocks inside the kernel; the dequantized copy below is the fallback
            out = cpu_native.paged_decode_int4(q, cache, block_tables, seq_lens, scale, tail_rows)
            if out is not None:
                return out
        dequantize = cpu_native.dequantize_int4_blocks if cache.fmt.int4_codes else None
        kv, tables = reference.dequantized_context(cache, block_tables, seq_lens, zero_past_end=False,
                                                   tail_rows=tail_rows, dequantize=dequantize)
        return cpu_native.paged_decode(_cache_query(q, cache, torch.float32), kv, tables, seq_lens, scale).to(q.dtype)


def _chunk_context(key: torch.Tensor, value: torch.Tensor, qsl: torch.Tensor, bs: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh prompts' context, laid out as ``reference.dequantized_context`` lays out a context
    (``kv [2, n, bs, Hkv, D]`` in ``dtype``, each sequence's blocks one after another, and an int32
    table into them), from the chunks' own keys and values (``[T, Hkv, D]``, rows as ``qsl`` places
    them) alone. Slots past each chunk's end are left unwritten (no kernel reads them)."""
    qsl = qsl.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    counts = (lens + bs - 1) // bs
    starts, table = reference.context_table(counts)
    total = max(1, int(counts.sum()))  # NOTE: all empty: one block, so the table's zeros point into it
    kv = torch.empty(2, total * bs, *key.shape[1:], dtype=dtype)
    # NOTE: a slice copy a chunk (an index_put of every row took twice as long)
    for row, n, at in zip((qsl[:-1] - qsl[0]).tolist(), lens.tolist(), (starts * bs).tolist()):
        kv[0, at : at + n] = key[row : row + n]
        kv[1, at : at + n] = value[row : row + n]
    return kv.view(2, total, bs, *key.shape[1:]), table


def _cache_query(q: torch.Tensor, cache: kv_cache.PagedKVCache, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``reference.cache_query`` (in ``dtype`` where given): INT4R's rounding in one C pass where
    the library serves (``cpu_native.round_query``: the same values)."""
    if cache.fmt.rotates_keys:
        out = cpu_native.round_query(q, dtype or torch.float32)
        if out is not None:
            return out
    q = reference.cache_query(q, cache)
    return q if dtype is None else q.to(dtype)


class TritonAttentionBackend(_PagedBackend):
    """Triton kernels (CUDA; also runs on CPU tensors under ``TRITON_INTERPRET=1``)."""

    name = "triton"

    @staticmethod
    def _rotate(x: torch.Tensor) -> torch.Tensor:
        # NOTE: one matrix product (the reference's butterflies are three small ops a stage, ~20
        # launches a tensor and layer in an eager prefill); equal up to rounding, as the kernels are
        return (x.float() @ qr.hadamard(x.shape[-1], x.device)).to(x.dtype)

    @staticmethod
    def _write(k, v, cache, slot_mapping, tail_slots=None):
        from llmbus.kernels.write_kv import write_kv

        # NOTE: k and v are views into the step's qkv projection; the kernel takes their strides
        write_kv(k, v, cache, slot_mapping.to(torch.int64), tail_slots)

    @staticmethod
    def _decode(q, cache, block_tables, seq_lens, scale, tail_rows=None, max_seq_len=None):
        from llmbus.kernels.paged_decode import paged_decode_attention

        return paged_decode_attention(q, cache, block_tables.to(torch.int32), seq_lens.to(torch.int32), scale,
                                      max_seq_len=max_seq_len, tail_rows=tail_rows)

    @staticmethod
    def _prefill(q, cache, block_tables, seq_lens, qsl, scale, tail_rows=None, max_query_len=None, chunk=None):
        from llmbus.kernels.paged_prefill import paged_prefill_attention

        return paged_prefill_attention(q, cache, block_tables.to(torch.int32), seq_lens.to(torch.int32), qsl, scale,
                                       max_query_len=max_query_len, tail_rows=tail_rows, chunk=chunk)


def make_attention_backend(device: str | torch.device, kv_format: str = "model") -> _PagedBackend:
    """Triton on CUDA; on CPU the references, with decodes through the fused C kernel where it
    builds; for KV format ``model | int8 | int4 | int4r``."""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    fmt = parse_kv_format(kv_format)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} asked for but CUDA is not available")
        return TritonAttentionBackend(fmt)
    if dev.type == "cpu":
        return CpuPagedAttentionBackend(fmt)
    raise ValueError(f"unsupported device {str(device)!r}: expected 'cpu' or 'cuda[:N]'")

"""Pure-torch references for every kernel. The CPU engine runs these; tests use them as oracles.

Cache layout is ``llmbus.kv.layout``: one tensor per layer shaped
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = keys, 1 = values).

Batches are variable-length: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` and, after this step's KV write, ``seq_lens[i]``
tokens of context; its query row ``j`` sits at position ``seq_lens[i] - q_len_i + j`` and attends
causally to every cached position up to and including its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmbus.kernels import quant_reference as qr

if TYPE_CHECKING:
    from llmbus.kernels.kv_cache import PagedKVCache


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Scatter new keys and values into the paged cache by slot. A slot given twice keeps one of
    its writes, unspecified (``index_copy_``'s rule; the engine gives each slot once a step);
    ``write_kv_cache`` keeps the last."""
    _, n, bs, h, d = cache.shape
    if cache.stride(1) != bs * cache.stride(2):  # head-major: scatter_slots indexes
        scatter_slots(cache, (0,), slot_mapping, key.to(cache.dtype))
        scatter_slots(cache, (1,), slot_mapping, value.to(cache.dtype))
        return
    # NOTE: the CPU engine's every layer and step: one view for keys and values (scatter_slots
    # would take one each, a third again of the call's time)
    flat = cache.view(2, n * bs, h, d)
    flat[0].index_copy_(0, slot_mapping, key.to(cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(cache.dtype))


def scatter_slots(t: torch.Tensor, lead: tuple, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``t[*lead, slot // bs, slot % bs] = values[i]`` for each ``slots[i]``, ``t``'s dimensions
    after ``lead`` being ``[N, bs, ..]``; of a slot given twice, one write stays, unspecified.
    NOTE: through a view of the blocks as one row of slots where there is one (token-major caches:
    the CPU engine's every layer and step), else (head-major caches, ``kv_cache.allocate_cache``)
    by indexing."""
    blocks = t[lead] if lead else t
    n, bs = blocks.shape[:2]
    if blocks.stride(0) == bs * blocks.stride(1):
        blocks.view(n * bs, *blocks.shape[2:]).index_copy_(0, slots, values)
    else:
        blocks[slots // bs, slots % bs] = values


def last_writes(slots: torch.Tensor) -> torch.Tensor:
    """Positions in ``slots`` of each distinct slot's last occurrence (in slot order)."""
    uniq, inverse = torch.unique(slots, return_inverse=True)
    order = torch.arange(slots.numel(), device=slots.device)
    return torch.full_like(uniq, -1).scatter_reduce(0, inverse, order, "amax")


def gather_kv(
    cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    block_table: torch.Tensor,  # [M] int
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence's first ``seq_len`` positions: two ``[seq_len, Hkv, D]``."""
    bs = cache.shape[2]
    nblk = -(-seq_len // bs)
    blocks = cache[:, block_table[:nblk].long()]  # [2, nblk, bs, H, D]
    kv = blocks.reshape(2, nblk * bs, *cache.shape[3:])[:, :seq_len]
    return kv[0], kv[1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] -> [B, Hq, Lq, D], fp32 softmax, GQA by head groups."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float())


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """One query token per sequence, attending to all ``seq_lens[i]`` cached tokens.
    A sequence with ``seq_len == 0`` yields zeros."""
    b = query.shape[0]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    if b == 0:
        return out.to(query.dtype)
    bs = cache.shape[2]
    max_len = int(seq_lens.max())
    if max_len == 0:
        return out.to(query.dtype)
    nblk = -(-max_len // bs)
    blocks = cache[:, block_tables[:, :nblk].long()]  # [2, B, nblk, bs, H, D]
    kv = blocks.reshape(2, b, nblk * bs, *cache.shape[3:]).transpose(2, 3)  # [2, B, H, L, D]
    pos = torch.arange(nblk * bs, device=query.device)
    mask = (pos[None, :] < seq_lens[:, None].to(pos.device))[:, None, None, :]  # [B, 1, 1, L]
    res = _attend(query[:, :, None, :], kv[0], kv[1], mask, scale)[:, :, 0]  # [B, Hq, D]
    live = seq_lens > 0
    out[live] = res[live]
    return out.to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including this chunk
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Variable-length chunks over a paged prefix: full attention to the cached prefix, causal
    within the chunk. Handles any mix of chunk lengths, decodes included."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        ql = e - s
        if ql == 0:
            continue
        k, v = gather_kv(cache, block_tables[i], ctx)
        q_pos = torch.arange(ctx - ql, ctx, device=query.device)
        k_pos = torch.arange(ctx, device=query.device)
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, ql, ctx]
        res = _attend(query[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale)
        out[s:e] = res[0].transpose(0, 1).to(query.dtype)
    return out


# -- paged caches in any KV format (llmbus.kernels.kv_cache.PagedKVCache) -------------------------------
def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cache: "PagedKVCache",
    slot_mapping: torch.Tensor,  # [T] int64
    tail_slots: torch.Tensor | None = None,  # [T] int64: row * bs + offset in cache.k_tail, or -1
) -> None:
    """``write_kv`` for every format: quantizes on the way for int8/int4/int4r (see
    llmbus.kv.formats; INT4R's keys come rotated, as the attention backends pass them). An INT4
    block whose last slot is written in this call is re-quantized per channel, from this call's
    keys where they are given and, for the rest, from the exact tail row of the token sealing it
    (``tail_slots``) or else from the stored per-token encoding (INT4R keeps every key per token:
    nothing is re-quantized). The keys and values of blocks left filling are also copied exactly
    into their tokens' tail rows; a call must not seal a block from a row it also writes (the
    Triton kernel's programs would race: see ``TailRows``)."""
    slots = slot_mapping.long()
    n, bs = cache.data.shape[1:3]
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= n * bs):
        raise ValueError(f"slots must lie in [0, {n * bs}), got {slots.tolist()}")
    # NOTE: only each slot's last write is scattered: of repeated indices a scatter keeps one, unspecified
    last = last_writes(slots)
    at = slots[last]
    if cache.fmt.name == "model":
        scatter_slots(cache.data, (0,), at, key[last].to(cache.data.dtype))
        scatter_slots(cache.data, (1,), at, value[last].to(cache.data.dtype))
        return
    if cache.fmt.name == "int8":
        for i, x in enumerate((key, value)):
            q, s = qr.int8_quantize(x[last], cache.scale.dtype)
            scatter_slots(cache.data, (i,), at, q)
            scatter_slots(cache.scale, (i,), at, s)
        return
    tails = check_tail_slots(cache, slots, tail_slots)
    d = key.shape[-1]
    gv, gk = cache.fmt.groups(d, bs)
    q, s, mn = qr.int4_group_quantize(value[last], gv)
    scatter_slots(cache.data, (1,), at, qr.pack_nibbles(q))
    scatter_slots(cache.v_meta, (), at, torch.stack((s, mn), -1))
    slot_list = slots.tolist()
    row_of = {sl: i for i, sl in enumerate(slot_list)}
    completed = {sl // bs for sl in slot_list if sl % bs == bs - 1}  # blocks whose last slot this call writes
    tail = [i for i, sl in enumerate(slot_list) if sl // bs not in completed]
    # NOTE: INT4R keeps every key per token, so it seals nothing; INT4 seals the completed blocks
    per_token = cache.fmt.name == "int4r"
    sealed = [] if per_token else sorted(completed)
    # the keys stored per token, each slot's last write: the filling blocks' (INT4R: every block's)
    kl = last if per_token else torch.tensor(
        [i for i in last.tolist() if slot_list[i] // bs not in completed], dtype=torch.long, device=key.device)
    if kl.numel():
        q, s, mn = qr.int4_group_quantize(key[kl], gk)
        scatter_slots(cache.data, (0,), slots[kl], qr.pack_nibbles(q))
        meta = torch.stack((s, mn), -1).view(torch.int16).flatten(-2)  # [t, H, 2 * D/gk]
        width = meta.shape[-1]
        blk, off = slots[kl] // bs, slots[kl] % bs
        cols = off[:, None] * width + torch.arange(width, device=key.device)  # [t, width]
        heads = torch.arange(key.shape[1], device=key.device)
        cache.k_meta[blk[:, None, None], heads[None, :, None], cols[:, None, :]] = meta
    for b in sealed:
        base = int(tails[row_of[b * bs + bs - 1]]) - (bs - 1) if tails is not None else -1
        # [bs, H, D] fp32; NOTE: a copy, since the fresh keys below must not reach the row
        x = cache.k_tail[base : base + bs].to(torch.float32, copy=True) if base >= 0 else _int4_tail_keys(cache, b)
        for o in range(bs):
            if b * bs + o in row_of:
                x[o] = key[row_of[b * bs + o]].float()
        q, codes, lo, hi = qr.int4_key_block_quantize(x)
        cache.data[0, b] = qr.pack_nibbles(q)
        cache.k_meta[b, :, :d] = codes
        cache.k_meta[b, :, d] = lo.view(torch.int16)
        cache.k_meta[b, :, d + 1] = hi.view(torch.int16)
    if tail and tails is not None:  # NOTE: after sealing, which reads rows earlier calls wrote
        idx = torch.tensor(tail, dtype=torch.long, device=key.device)
        rows, ks, vs = tails[idx], key[idx], value[idx]
        keep = rows >= 0
        if not bool(keep.all()):
            rows, ks, vs = rows[keep], ks[keep], vs[keep]
        cache.k_tail.index_copy_(0, rows, ks.to(cache.k_tail.dtype))
        cache.v_tail.index_copy_(0, rows, vs.to(cache.v_tail.dtype))


def check_tail_slots(cache: "PagedKVCache", slots: torch.Tensor, tail_slots: torch.Tensor | None) -> torch.Tensor | None:
    """``tail_slots`` as int64 on the slots' device, checked against the cache and the slots; None
    when unused."""
    if tail_slots is None or not cache.fmt.keeps_tails:
        return None
    if tail_slots.shape != slots.shape:
        raise ValueError(f"tail_slots must be [{slots.numel()}] like slot_mapping, got {list(tail_slots.shape)}")
    ts = tail_slots.to(slots.device).long()
    bs, limit = cache.layout.block_size, cache.num_tail_rows * cache.layout.block_size
    bad = ((ts >= limit) | (ts % bs != slots % bs)) & (ts >= 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"tail slot {int(ts[i])} for cache slot {int(slots[i])}: expected a row of the cache's "
                         f"{cache.num_tail_rows} tail rows at the slot's block offset {int(slots[i]) % bs}")
    return ts


def fill_tail(cache: "PagedKVCache", block: int, row: int) -> None:
    """Give tail row ``row`` the keys and values of filling block ``block`` as their per-token codes
    decode: for a sequence whose filling block was written before it had a row (a handoff)."""
    bs = cache.layout.block_size
    kv = dequantize_blocks(cache, torch.tensor([block], device=cache.data.device), torch.tensor([False]))
    cache.k_tail[row * bs : (row + 1) * bs] = kv[0, 0].to(cache.k_tail.dtype)
    cache.v_tail[row * bs : (row + 1) * bs] = kv[1, 0].to(cache.v_tail.dtype)


def _int4_tail_keys(cache: "PagedKVCache", blocks) -> torch.Tensor:
    """Keys of blocks stored in the partial (per-token) encoding: ``[..., bs, H, D]`` fp32."""
    bs, d = cache.data.shape[2], cache.data.shape[4] * 2
    gk = cache.fmt.groups(d, bs)[1]
    ng = d // gk
    meta = cache.k_meta[blocks, :, : bs * ng * 2].view(torch.float16)  # [..., H, bs * ng * 2]
    meta = meta.unflatten(-1, (bs, ng, 2)).transpose(-4, -3)  # [..., bs, H, ng, 2]
    q = qr.unpack_nibbles(cache.data[0, blocks])
    return qr.int4_group_dequantize(q, meta[..., 0], meta[..., 1], gk)


def dequantize_blocks(
    cache: "PagedKVCache",
    block_ids: torch.Tensor,  # [n] int
    full: torch.Tensor,  # [n] bool: block is full (INT4 keys per channel) or a partial tail
) -> torch.Tensor:  # [2, n, bs, H, D] fp32
    ids = block_ids.long()
    if cache.fmt.name == "model":
        return cache.data[:, ids].float()
    if cache.fmt.name == "int8":
        return qr.int8_dequantize(cache.data[:, ids], cache.scale[:, ids])
    d = cache.data.shape[-1] * 2
    vm = cache.v_meta[ids]
    gv = cache.fmt.groups(d, cache.data.shape[2])[0]
    v = qr.int4_group_dequantize(qr.unpack_nibbles(cache.data[1, ids]), vm[..., 0], vm[..., 1], gv)
    if cache.fmt.name == "int4r":  # every key per token
        return torch.stack((_int4_tail_keys(cache, ids), v))
    km = cache.k_meta[ids]
    lo, hi = km[:, :, d].view(torch.float16), km[:, :, d + 1].view(torch.float16)
    k = qr.int4_key_block_dequantize(qr.unpack_nibbles(cache.data[0, ids]), km[:, :, :d], lo, hi)
    partial = (~full.to(ids.device)).nonzero().flatten()
    if partial.numel():  # NOTE: only the partial blocks (a sequence's last) are per token
        k[partial] = _int4_tail_keys(cache, ids[partial])
    return torch.stack((k, v))


def context_table(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a context holding each sequence's ``counts[i]`` blocks one after another: where each
    sequence's blocks start, and the int32 block table into it (row i: consecutive ids; entries
    past a sequence's blocks, and the rows of sequences with none: 0)."""
    col = torch.arange(max(1, int(counts.max())) if counts.numel() else 1, device=counts.device)
    starts = torch.cumsum(counts, 0) - counts
    return starts, torch.where(col[None, :] < counts[:, None], starts[:, None] + col[None, :], 0).to(torch.int32)


def dequantized_context(cache: "PagedKVCache", block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        zero_past_end: bool = True, tail_rows: torch.Tensor | None = None,
                        dequantize=None):
    """The blocks the batch reads, dequantized to fp32, with a block table into them: each
    sequence's own blocks (``ceil(len / bs)``, at least one in all), one after another, so row i of
    the table holds consecutive ids (entries past a sequence's blocks: 0). A batch of one long and
    many short sequences dequantizes what they hold, not B times the longest.
    ``zero_past_end=False`` leaves slots past each sequence's end as they decode (for a consumer
    that never reads them, such as the fused CPU kernel). ``tail_rows`` ([B], -1: none): the INT4
    tail row holding each sequence's partial last block, whose exact keys and values are read
    instead of its codes. ``dequantize``: ``dequantize_blocks`` (the default) or a twin of it."""
    b, bs = block_tables.shape[0], cache.data.shape[2]
    dev = block_tables.device
    lens = seq_lens.to(dev).long()
    counts = (lens + bs - 1) // bs
    nblk = max(1, int(counts.max())) if b else 1
    col = torch.arange(nblk, device=dev)
    own = col[None, :] < counts[:, None]  # [B, nblk]: the blocks each sequence holds
    if b and not bool(own.any()):
        own[0, 0] = True  # NOTE: all empty: one block, so the table's zeros point into the context
        if block_tables.shape[1] == 0:
            block_tables = torch.zeros(b, 1, dtype=block_tables.dtype, device=dev)  # block 0: any cache has it
    full = (col[None, :] + 1) * bs <= lens[:, None]
    seqs = None
    if tail_rows is not None and cache.k_tail is not None:
        rows = tail_rows.to(dev).long()
        seqs = ((rows >= 0) & (lens % bs > 0)).nonzero().flatten()
        full[seqs, lens[seqs] // bs] = True  # NOTE: their keys come from the rows: skip per-token codes
    kv = (dequantize or dequantize_blocks)(cache, block_tables[:, :nblk].long()[own], full[own])
    starts, table = context_table(counts)  # (all empty: its zeros point at the one block)
    if seqs is not None and seqs.numel():
        at = starts[seqs] + lens[seqs] // bs
        for i, tail in enumerate((cache.k_tail, cache.v_tail)):
            kv[i, at] = tail.view(-1, bs, *tail.shape[1:])[rows[seqs]].float()
    if not zero_past_end:
        return kv, table
    # NOTE: slots past a sequence's end may hold another encoding's bytes (a reused block, table
    # padding), which can decode to inf/nan; zero them so masked positions stay harmless.
    pos = (col[:, None] * bs + torch.arange(bs, device=dev)[None, :])[None]  # [1, nblk, bs]
    live = (pos < lens[:, None, None])[own].reshape(1, -1, bs, 1, 1)
    kv = torch.where(live, kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
    return kv, table


def cache_query(query: torch.Tensor, cache: "PagedKVCache") -> torch.Tensor:
    """The query as attention over ``cache`` meets it: rounded to int8 per row for a format whose
    kernels dot integers (INT4R: ``quant_reference.round_query``), else as it is."""
    return qr.round_query(query) if cache.fmt.rotates_keys else query


def paged_decode_attention_cache(query, cache: "PagedKVCache", block_tables, seq_lens, scale: float,
                                 tail_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_decode_attention`` over a cache of any format; ``tail_rows`` as in
    ``dequantized_context``."""
    if cache.fmt.name == "model":
        return paged_decode_attention(query, cache.data, block_tables, seq_lens, scale)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    kv, tables = dequantized_context(cache, block_tables, seq_lens, tail_rows=tail_rows)
    return paged_decode_attention(cache_query(query, cache), kv, tables, seq_lens, scale).to(query.dtype)


def paged_prefill_attention_cache(query, cache: "PagedKVCache", block_tables, seq_lens, query_start_loc, scale: float,
                                  tail_rows: torch.Tensor | None = None,
                                  chunk: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``paged_prefill_attention`` over a cache of any format; ``tail_rows`` as in
    ``dequantized_context``. ``chunk``: the chunks' own keys and values (``[T, Hkv, D]`` each, rows as
    ``query``'s), which their queries then attend to exactly (``exact_chunks``); without it a
    quantized cache's chunk is read back as the cache holds it."""
    if cache.fmt.name == "model":
        return paged_prefill_attention(query, cache.data, block_tables, seq_lens, query_start_loc, scale)
    if block_tables.shape[0] == 0:
        return torch.empty_like(query)
    kv, tables = dequantized_context(cache, block_tables, seq_lens, tail_rows=tail_rows)
    if chunk is not None:
        exact_chunks(kv, tables, *chunk, seq_lens, query_start_loc)
    return paged_prefill_attention(cache_query(query, cache), kv, tables, seq_lens, query_start_loc,
                                   scale).to(query.dtype)


def exact_chunks(kv: torch.Tensor, tables: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """Writes each prefill chunk's exact keys and values (``key``/``value`` ``[T, Hkv, D]``, the
    chunks' rows one after another as ``query_start_loc`` places them) over their positions, the
    last ``q_len`` of each sequence, in ``kv`` (a context and ``tables`` into it, as
    ``dequantized_context`` returns them). A chunk's queries then attend to the prefix as the cache
    holds it and to their own chunk as the model computed it, as KIVI's prefill does: quantizing
    what a prompt writes cannot then change a one-pass prefill (its first token, and the keys and
    values its later layers write; INT4R's queries are still rounded to int8)."""
    qsl = query_start_loc.to(kv.device).long()
    qsl = qsl - qsl[0]  # rows of key / value from the first chunk's
    lens = qsl[1:] - qsl[:-1]
    t = int(qsl[-1])
    if t == 0:
        return
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=kv.device), lens)  # each row's sequence
    pos = seq_lens.to(kv.device).long()[seq] - lens[seq] + torch.arange(t, device=kv.device) - qsl[seq]
    bs = kv.shape[2]
    blk, off = tables.to(kv.device).long()[seq, pos // bs], pos % bs
    kv[0, blk, off] = key[:t].to(kv.device, kv.dtype)
    kv[1, blk, off] = value[:t].to(kv.device, kv.dtype)


# --- a decoder layer's element-wise glue (llmbus.kernels.fused on CUDA) --------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back, then scale by the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` rotated: ``x * cos + rotate_half(x) * sin`` computed on the two halves
    (the same roundings as HF, since ``a + (-b) == a - b`` exactly)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2I]``, gate the first half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

"""Pure-torch references for every kernel. The CPU engine runs these; tests use them as oracles.

Cache layout is ``llmbus.kv.layout``: one tensor per layer shaped
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = keys, 1 = values).

Batches are variable-length: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` and, after this step's KV write, ``seq_lens[i]``
tokens of context; its query row ``j`` sits at position ``seq_lens[i] - q_len_i + j`` and attends
causally to every cached position up to and including its own.
"""

from __future__ import annotations

import torch


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cache: torch.Tensor,  # [2, N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Scatter new keys and values into the paged cache by slot."""
    _, n, bs, h, d = cache.shape
    flat = cache.view(2, n * bs, h, d)
    flat[0].index_copy_(0, slot_mapping, key.to(cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(cache.dtype))


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

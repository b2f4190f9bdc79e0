"""Test helpers: random small HF-format model dirs, and driving a model through a paged cache."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llmbus.engine.attention import TorchAttentionBackend
from llmbus.model.demo import write_random_model
from llmbus.engine.attention import build_attention_metadata

__all__ = ["write_random_model", "shard_checkpoint", "PagedDriver"]


def shard_checkpoint(model_dir: Path, num_shards: int) -> list[str]:
    """Split ``model.safetensors`` into ``num_shards`` files plus ``model.safetensors.index.json``."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {}
    for i, file in enumerate(files):
        part = names[i::num_shards]
        save_file({n: tensors[n] for n in part}, str(model_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


class PagedDriver:
    """Runs a model the way the engine does: one paged cache, shuffled non-contiguous block ids
    per sequence, steps given as ``[(seq_id, tokens)]`` (decodes first)."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 16, seed: int = 0, backend=None) -> None:
        """``backend``: what allocates the caches (default: model-dtype tensors)."""
        self.model = model
        dtype = str(model.embed_tokens.dtype).removeprefix("torch.")
        self.layout = model.config.kv_layout(block_size, dtype)
        self.caches = (backend or TorchAttentionBackend()).allocate_cache(self.layout, num_blocks, "cpu")
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over all chunks; return each chunk's logits ``[len, vocab]`` (fp32)."""
        entries = []
        ids: list[int] = []
        for seq_id, tokens in chunks:
            table = self.tables.setdefault(seq_id, [])
            start = self.computed.get(seq_id, 0)
            while len(table) * self.layout.block_size < start + len(tokens):
                table.append(self.free.pop())
            entries.append((table, start, len(tokens)))
            ids.extend(tokens)
        meta, positions = build_attention_metadata(entries, self.layout.block_size)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), positions, self.caches, meta)
            logits = self.model.compute_logits(hidden)
        out, row = [], 0
        for seq_id, tokens in chunks:
            self.computed[seq_id] = self.computed.get(seq_id, 0) + len(tokens)
            out.append(logits[row:row + len(tokens)])
            row += len(tokens)
        return out

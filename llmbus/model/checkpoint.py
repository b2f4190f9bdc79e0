"""Reading Hugging Face safetensors checkpoints: one file, or shards listed by an index."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SAMPLE_BYTES = 4096  # what ``fingerprint`` reads of each end of a tensor


class Checkpoint:
    """Tensor name -> the shard file holding it. Tensors are read one at a time, on demand."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.files: dict[str, Path] = {}
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            self._from_index(index)
        else:
            shards = sorted(self.model_dir.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"no *.safetensors weights in {self.model_dir}")
            for shard in shards:
                for name in self._keys(shard):
                    self.files[name] = shard

    def _from_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index (needs a 'weight_map' object): {exc}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard files")
        for shard_name in sorted(set(weight_map.values())):
            shard = self.model_dir / str(shard_name)
            if not shard.is_file():
                raise FileNotFoundError(f"{index.name} lists shard {shard_name!r}, which is missing from {self.model_dir}")
            present = set(self._keys(shard))
            for name, owner in weight_map.items():
                if owner == shard_name:
                    if name not in present:
                        raise ValueError(f"{index.name} places tensor {name!r} in {shard_name}, which does not hold it")
                    self.files[name] = shard

    @staticmethod
    def _keys(shard: Path) -> list[str]:
        try:
            with safe_open(str(shard), framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{shard}: not a readable safetensors file ({exc})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(str(self.files[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Load ``names`` (all present), opening each shard once."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for shard, shard_names in by_file.items():
            with safe_open(str(shard), framework="pt") as f:
                for name in shard_names:
                    out[name] = f.get_tensor(name)
        return out

    def fingerprint(self, names: list[str], context: bytes = b"") -> str:
        """A digest naming the weights ``names`` wherever they are copied or however they are
        sharded: each tensor's name, dtype and shape and the first and last ``SAMPLE_BYTES`` of its
        data, read from the files without loading them. Retraining a tensor changes its ends, so a
        fine-tune of the same shapes gets another digest (the prefix caches key on it: llmbus.kv.hashing).
        ``context`` joins the digest: what else decides the weights' outputs (the model config)."""
        digest = hashlib.blake2b(context, digest_size=8)
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        samples: dict[str, bytes] = {}
        for shard, shard_names in by_file.items():
            with open(shard, "rb") as f:
                header, base = _header(f, shard)
                for name in shard_names:
                    info = header[name]
                    begin, end = (base + int(x) for x in info["data_offsets"])
                    f.seek(begin)
                    head = f.read(min(SAMPLE_BYTES, end - begin))
                    f.seek(max(begin, end - SAMPLE_BYTES))
                    tail = f.read(min(SAMPLE_BYTES, end - begin))
                    meta = json.dumps([name, info["dtype"], info["shape"]]).encode()
                    samples[name] = meta + head + tail
        for name in sorted(samples):
            digest.update(samples[name])
        return digest.hexdigest()


def _header(f, shard: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where its data
    starts: an 8-byte little-endian length, then that many bytes of JSON."""
    try:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size
    except (struct.error, ValueError) as exc:
        raise ValueError(f"{shard}: not a readable safetensors header ({exc})") from None

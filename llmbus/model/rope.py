"""Rotary position embedding at arbitrary positions, in Hugging Face's rotate-half convention.

cos/sin are computed in fp32 from ``position * inv_freq`` (the same product HF forms) and cast to
the activation dtype before rotating, so results match transformers bit-closely in every dtype.
"""

from __future__ import annotations

import math

import torch

from llmbus.model.rope_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[head_dim // 2]`` fp32 inverse frequencies for the default, linear and llama3 schemes
    (dynamic starts from the default ones)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """Rotates q and k at given positions. Holds only the fp32 inverse frequencies."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, device: torch.device | str = "cpu") -> None:
        self.rope = rope
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.inv_freq = inverse_frequencies(rope, head_dim, device)

    def to(self, device: torch.device | str) -> "RotaryEmbedding":
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> cos, sin each ``[T, 1, head_dim // 2]`` in ``dtype``."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv_freq[None, :]
        if self.rope.rope_type == "dynamic":
            freqs = self._dynamic(positions, freqs)
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]

    def _dynamic(self, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        # NOTE: within max_position_embeddings dynamic NTK is the default rope (as in HF). Past it,
        # each token takes the base for a context ending at itself: HF's behaviour when decoding
        # token by token with a cache, and consistent across chunking (keys are never re-rotated).
        max_pos = self.max_position_embeddings
        long = positions >= max_pos
        if not bool(long.any()):
            return freqs
        dim, factor = self.head_dim, self.rope.factor
        seq_len = (positions[long] + 1).double()
        base = self.rope.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        inv_freq = 1.0 / (base.float()[:, None] ** exponents[None, :])
        freqs = freqs.clone()
        freqs[long] = positions[long][:, None].float() * inv_freq
        return freqs



"""RoPE settings, from either Hugging Face spelling (torch-free).

transformers 4.x writes ``rope_theta`` plus an optional ``rope_scaling`` dict; 5.x writes one
``rope_parameters`` dict holding ``rope_theta`` and the scaling keys. Both parse to one record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0  # linear, dynamic, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3; dynamic uses max_position_embeddings

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"config.json: unsupported rope type {self.rope_type!r}; supported: {list(ROPE_TYPES)}")
        if not self.theta > 0:
            raise ValueError(f"config.json: rope_theta must be > 0, got {self.theta!r}")
        if self.rope_type != "default" and not self.factor > 0:
            raise ValueError(f"config.json: rope factor must be > 0, got {self.factor!r}")
        if self.rope_type == "dynamic" and self.factor < 1:
            raise ValueError(f"config.json: dynamic rope factor must be >= 1, got {self.factor!r}")
        if self.rope_type == "llama3":
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ValueError(
                    "config.json: llama3 rope needs high_freq_factor > low_freq_factor > 0, got "
                    f"{self.high_freq_factor!r} and {self.low_freq_factor!r}"
                )
            if self.original_max_position_embeddings < 1:
                raise ValueError("config.json: llama3 rope needs original_max_position_embeddings >= 1")

    @classmethod
    def from_hf(cls, raw: dict[str, Any], max_position_embeddings: int) -> "RopeConfig":
        params = raw.get("rope_parameters")
        if params is None:
            params = raw.get("rope_scaling")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"config.json: rope_parameters / rope_scaling must be an object, got {params!r}")
        if params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError("config.json: per-layer-type rope_parameters are not supported by this model family")
        rope_type = params.get("rope_type", params.get("type", "default"))
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"config.json: partial_rotary_factor {partial!r} is not supported (only 1.0)")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        try:
            return cls(
                rope_type=str(rope_type),
                theta=float(theta),
                factor=float(params.get("factor", 1.0)),
                low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings", max_position_embeddings)
                ),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ValueError) and str(exc).startswith("config.json"):
                raise
            raise ValueError(f"config.json: malformed rope settings {params!r} ({exc})") from None

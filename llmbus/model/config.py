"""The model family's configuration, parsed and validated from a Hugging Face ``config.json``.

Covers Llama-architecture decoders: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and
``MistralForCausalLM``. Torch-free, so the gateway and router can read context lengths and
token ids without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmbus.kv.layout import DTYPE_BYTES, KVLayout
from llmbus.model.rope_config import RopeConfig

# HF architecture name -> (model_type, defaults for fields HF may leave out of config.json)
_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("llama", {"max_position_embeddings": 2048, "attention_bias": False}),
    "Qwen2ForCausalLM": ("qwen2", {"max_position_embeddings": 32768, "attention_bias": True}),
    "MistralForCausalLM": ("mistral", {"max_position_embeddings": 131072, "attention_bias": False}),
}
_BY_MODEL_TYPE = {model_type: arch for arch, (model_type, _) in _ARCHITECTURES.items()}
_DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
                  "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float": "float32"}


def normalize_dtype(name: object, what: str = "dtype") -> str:
    """``"bf16"``/``"torch.bfloat16"``/... -> one of ``float32``, ``float16``, ``bfloat16``."""
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"{what} must be one of float32, float16, bfloat16; got {name!r}")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    model_type: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama's attention_bias also biases o_proj; Qwen2's never does
    mlp_bias: bool
    tie_word_embeddings: bool
    dtype: str = "float32"  # the checkpoint's dtype, the default compute dtype
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"config.json: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"config.json: dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"config.json: sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def max_model_len(self) -> int:
        """Longest context this engine serves exactly like the reference model.

        NOTE: the paged backends attend the whole context; a Mistral-style sliding window changes
        nothing until the context outgrows it, so the window caps the servable length."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @property
    def num_params(self) -> int:
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        qkv = h * d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        per_layer = qkv + self.num_attention_heads * d * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h

    def kv_layout(self, block_size: int = 16, dtype: str | None = None) -> KVLayout:
        """The paged KV layout of this model (``dtype`` defaults to the checkpoint's)."""
        return KVLayout(self.num_hidden_layers, self.num_key_value_heads, self.head_dim, block_size,
                        normalize_dtype(dtype) if dtype else self.dtype)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a Hugging Face config dict; any problem -> ValueError naming the field."""
        if not isinstance(raw, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        arch = _architecture(raw)
        model_type, defaults = _ARCHITECTURES[arch]
        get = _Getter(raw)
        hidden = get.int("hidden_size")
        heads = get.int("num_attention_heads")
        head_dim = raw.get("head_dim")
        if heads < 1:  # NOTE: checked here too: head_dim below divides by it before __post_init__ runs
            raise ValueError(f"config.json: num_attention_heads must be a positive integer, got {heads}")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"config.json: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) and no head_dim is given")
            head_dim = hidden // heads
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"config.json: hidden_act must be 'silu' for {arch}, got {raw.get('hidden_act')!r}")
        attention_bias = bool(raw.get("attention_bias", defaults["attention_bias"]))
        sliding = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None
        max_pos = raw.get("max_position_embeddings", defaults["max_position_embeddings"])
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=get.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get.int("intermediate_size"),
            num_hidden_layers=get.int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=get.int("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=get.float("rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(raw, max_pos if isinstance(max_pos, int) else 1),
            max_position_embeddings=max_pos,
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type == "llama",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dtype=normalize_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32", "config.json: dtype"),
            sliding_window=sliding,
            bos_token_id=_token_id(raw.get("bos_token_id"), "bos_token_id"),
            eos_token_ids=token_ids(raw.get("eos_token_id"), "eos_token_id"),
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs:
            raise ValueError(f"config.json: architectures must be a non-empty list, got {archs!r}")
        arch = archs[0]
    elif raw.get("model_type") in _BY_MODEL_TYPE:
        arch = _BY_MODEL_TYPE[raw["model_type"]]
    else:
        raise ValueError(f"config.json names no architecture (architectures / model_type); supported: {sorted(_ARCHITECTURES)}")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")
    return arch


class _Getter:
    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw

    def int(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key)
        value = default if value is None else value
        if value is None:
            raise ValueError(f"config.json: missing required field {key!r}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config.json: {key} must be an integer, got {value!r}")
        return value

    def float(self, key: str, default: float) -> float:
        value = self.raw.get(key)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config.json: {key} must be a number, got {value!r}")
        return float(value)


def _token_id(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def token_ids(value: object, what: str) -> tuple[int, ...]:
    """An HF eos field (None, an int, or a list of ints) as a tuple of ids."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(_token_id(v, what) for v in values)

"""Load a Hugging Face model directory into our model family.

``load_model(dir)`` reads ``config.json``, the safetensors weights (sharded or not), the tokenizer
and ``generation_config.json``; checks every expected tensor's presence and shape (naming the
offenders), fuses q/k/v and gate/up, and converts to the requested dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmbus.engine.attention import AttentionBackend, torch_dtype
from llmbus.model.checkpoint import Checkpoint
from llmbus.model.config import ModelConfig, normalize_dtype, token_ids
from llmbus.model.llama import LlamaForCausalLM
from llmbus.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None  # None when the directory has no tokenizer.json
    generation_config: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    model_name: str = ""  # the directory's name
    # NOTE: what the prefix caches key on (``root_hash``), so two checkpoints never share a block:
    # "<model_type>-<Checkpoint.fingerprint>" of the weights, the config and the dtype they run in,
    # the same for every copy of the same weights run the same way
    model_id: str = ""


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name this config needs, with its shape."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        proj = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
        for name, shape in proj.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
        if cfg.qkv_bias:
            shapes.update({f"{p}self_attn.q_proj.bias": (q,), f"{p}self_attn.k_proj.bias": (kv,), f"{p}self_attn.v_proj.bias": (kv,)})
        if cfg.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (h,)
        for name, shape in {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}.items():
            shapes[f"{p}mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = shape[:1]
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    return shapes


def _fuse(cfg: ModelConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors -> our state dict (q;k;v and gate;up stacked along the output dim)."""
    out = {"embed_tokens": t["model.embed_tokens.weight"], "norm.weight": t["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = t["lm_head.weight"]
    for n in range(cfg.num_hidden_layers):
        p, o = f"model.layers.{n}.", f"layers.{n}."
        a, m = f"{p}self_attn.", f"{p}mlp."
        out[f"{o}self_attn.qkv_weight"] = torch.cat([t[f"{a}{x}_proj.weight"] for x in "qkv"])
        if cfg.qkv_bias:
            out[f"{o}self_attn.qkv_bias"] = torch.cat([t[f"{a}{x}_proj.bias"] for x in "qkv"])
        out[f"{o}self_attn.o_weight"] = t[f"{a}o_proj.weight"]
        if cfg.o_bias:
            out[f"{o}self_attn.o_bias"] = t[f"{a}o_proj.bias"]
        out[f"{o}mlp.gate_up_weight"] = torch.cat([t[f"{m}gate_proj.weight"], t[f"{m}up_proj.weight"]])
        out[f"{o}mlp.down_weight"] = t[f"{m}down_proj.weight"]
        if cfg.mlp_bias:
            out[f"{o}mlp.gate_up_bias"] = torch.cat([t[f"{m}gate_proj.bias"], t[f"{m}up_proj.bias"]])
            out[f"{o}mlp.down_bias"] = t[f"{m}down_proj.bias"]
        out[f"{o}input_layernorm.weight"] = t[f"{p}input_layernorm.weight"]
        out[f"{o}post_attention_layernorm.weight"] = t[f"{p}post_attention_layernorm.weight"]
    return out


def _check(ckpt: Checkpoint, shapes: dict[str, tuple[int, ...]]) -> None:
    missing = [name for name in shapes if name not in ckpt]
    if missing:
        shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"{ckpt.model_dir}: checkpoint is missing {len(missing)} tensor(s): {shown}")
    wrong = [f"{name}: expected {list(s)}, got {list(ckpt.shape(name))}" for name, s in shapes.items() if ckpt.shape(name) != s]
    if wrong:
        raise ValueError(f"{ckpt.model_dir}: tensor shape mismatch: " + "; ".join(wrong[:8]))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return data


def load_model(model_dir: str | Path, *, dtype: str | None = None, device: str | torch.device = "cpu",
               backend: AttentionBackend | None = None) -> LoadedModel:
    """Load ``model_dir`` (a Hugging Face directory) onto ``device`` in ``dtype`` (default: the
    checkpoint's). ``backend`` defaults to the pure-torch paged attention."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory not found: {root}")
    cfg = ModelConfig.from_file(root / "config.json")
    dt = torch_dtype(normalize_dtype(dtype) if dtype else cfg.dtype)
    ckpt = Checkpoint(root)
    shapes = expected_tensors(cfg)
    _check(ckpt, shapes)
    state = {k: v.to(device=device, dtype=dt) for k, v in _fuse(cfg, ckpt.tensors(list(shapes))).items()}
    model = LlamaForCausalLM(cfg, dtype=dt, device="meta", backend=backend)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary.to(device)
    model.requires_grad_(False).eval()
    gen_path = root / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
    eos = token_ids(generation.get("eos_token_id"), "generation_config.json: eos_token_id") or cfg.eos_token_ids
    tokenizer = Tokenizer.from_dir(root) if (root / "tokenizer.json").is_file() else None
    # (the dtype the weights run in joins the config: bf16 and fp16 runs of one checkpoint make other KV)
    model_id = f"{cfg.model_type}-{ckpt.fingerprint(list(shapes), f'{cfg!r} {dt}'.encode())}"
    return LoadedModel(cfg, model, tokenizer, generation, eos, root.resolve().name, model_id)

"""Deterministic random models in Hugging Face format, generated locally.

``write_random_model`` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (ChatML template) and generation_config.json, and with the
``sentencepiece`` tokenizer also tokenizer.model (so llama.cpp's converter accepts the model); the
same arguments give the same bytes. The tokenizer never changes the weights: both variants of a
size share model.safetensors. ``make_demo_model`` picks the two demo sizes; ``ensure_demo_model``
caches them under ``default_demo_dir``.

The demo models are conditioned like trained ones (``DEMO_GAINS``): i.i.d. N(0, 0.08) weights
make a 12-layer model amplify any perturbation of its KV cache several-fold (its attention logits
have a standard deviation near 5, so attention is nearly one-hot, and each layer rewrites the whole
residual stream), so a KV format's accuracy measured on it says little. The demo models scale the
residual output projections (o_proj, down_proj) by ``1/sqrt(2 * num_layers)`` as GPT-2 does, the
query and key projections down so attention logits are moderate, and the embeddings up so the
token's identity persists in the residual stream. Its lm_head leans each token towards one
successor ("bigram"). That lean is too weak to matter: on random token sequences the large model's
mean top-1 probability is 0.045 (measured by scripts/eval_kv_quant.py, "unscaled"), and raising the
lean 85-fold moved it only to 0.13 without changing how often a perturbation flips the top token,
because after 12 layers the current token is a small part of the residual stream. Accuracy
measurements therefore use the large architecture trained on real text
(``scripts/train_demo_model.py``; docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmbus.model.config import ModelConfig, normalize_dtype
from llmbus.model.demo_tokenizer import (BOS, ENDOFTEXT, EOS, IM_END, SP_SPECIAL_TOKENS, SPECIAL_TOKENS,
                                         TOKENIZER_KINDS, sentencepiece_tokenizer_json, tokenizer_config,
                                         train_sentencepiece, train_tokenizer_json)

if TYPE_CHECKING:
    import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
_END_ID, _IM_END_ID = SPECIAL_TOKENS.index(ENDOFTEXT), SPECIAL_TOKENS.index(IM_END)
# the sentencepiece variant: (bos, eos, chat end) ids; generation stops at </s> or <|im_end|>
_SP_BOS_ID, _SP_EOS_ID, _SP_IM_END_ID = (SP_SPECIAL_TOKENS.index(t) for t in (BOS, EOS, IM_END))

DEMO_SIZES: dict[str, dict[str, Any]] = {
    # about 1.3M parameters: fast tests
    "small": {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096},
    # about 100M parameters: a CPU decode step is compute-bound. bf16 (faster than fp32 on
    # AVX512-BF16 CPUs, half the disk); load with dtype="float32" where bf16 is slow.
    "large": {"vocab_size": 16384, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 4096,
              "dtype": "bfloat16"},
}


def _base_config(architecture: str) -> dict[str, Any]:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {architecture!r}")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.08,
        "tie_word_embeddings": False,
        "bos_token_id": _END_ID,
        "eos_token_id": _IM_END_ID,
        "dtype": "float32",
        "use_cache": True,
    }
    if architecture == "qwen2":
        cfg.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": 0})
    elif architecture == "mistral":
        cfg["sliding_window"] = None
    else:
        cfg.update({"attention_bias": False, "mlp_bias": False})
    return cfg


# demo-model conditioning (see the module docstring); a new value must bump DEMO_INIT_VERSION
DEMO_GAINS = {"qk": 0.35, "embed": 10.0, "residual": True, "bigram": 0.028}
# NOTE: stored in config.json (safetensors metadata of two keys serializes in a random order);
# ensure_demo_model regenerates a cached demo model written by another version, so a stale cache
# never hides an initialization change.
DEMO_INIT_VERSION = "2"


def _gain(name: str, gains: dict[str, Any], num_layers: int) -> float:
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return gains.get("qk", 1.0)
    if name.endswith(("o_proj.weight", "down_proj.weight")) and gains.get("residual"):
        return (2 * num_layers) ** -0.5
    if name.endswith("embed_tokens.weight"):
        return gains.get("embed", 1.0)
    return 1.0


def _random_weights(cfg: ModelConfig, std: float, seed: int, gains: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    # NOTE: torch here, not at the top: `llmbus up` finds an existing demo model through this module
    # and never imports torch
    import torch

    from llmbus.engine.attention import torch_dtype
    from llmbus.model.loader import expected_tensors

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_tensors(cfg).items():
        if name.endswith("norm.weight"):  # near 1, not exactly: the test sees a wrong norm weight
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = std * _gain(name, gains or {}, cfg.num_hidden_layers) * torch.randn(shape, generator=gen)
    if (gains or {}).get("bigram") and "lm_head.weight" in out:
        # each token favours one successor: lm_head row v leans towards embedding row perm[v]
        perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed + 1))
        scale = gains["bigram"] / cfg.hidden_size**0.5
        out["lm_head.weight"] += scale * out["model.embed_tokens.weight"][perm]
    return {name: t.to(torch_dtype(cfg.dtype)).contiguous() for name, t in out.items()}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_tokenizer(tokenizer: str) -> None:
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"demo tokenizer must be one of {list(TOKENIZER_KINDS)}, got {tokenizer!r}")


def write_random_model(out_dir: str | Path, config_overrides: dict[str, Any] | None = None, seed: int = 0,
                       architecture: str = "llama", gains: dict[str, Any] | None = None,
                       tokenizer: str = "bpe") -> Path:
    """Write a random HF-format model (weights ~ N(0, initializer_range)) to ``out_dir``.

    ``config_overrides`` are config.json fields (``dtype`` picks the stored weight dtype). The
    ``bpe`` tokenizer has at most ``vocab_size`` entries (embedding rows past it are never produced
    by it); the ``sentencepiece`` one exactly ``vocab_size``. ``gains`` (as ``DEMO_GAINS``) scales
    groups of weights; None leaves them i.i.d."""
    _check_tokenizer(tokenizer)
    sp = tokenizer == "sentencepiece"
    raw = _base_config(architecture) | ({"bos_token_id": _SP_BOS_ID, "eos_token_id": _SP_EOS_ID} if sp else {})
    raw |= dict(config_overrides or {})
    if gains:
        raw["llmbus_demo_init"] = DEMO_INIT_VERSION
    if "torch_dtype" in raw:
        raw["dtype"] = raw.pop("torch_dtype")
    raw["dtype"] = normalize_dtype(raw.get("dtype", "float32"))
    cfg = ModelConfig.from_dict(raw)
    sp_model = train_sentencepiece(cfg.vocab_size) if sp else None
    if sp_model:
        tokenizer_json = sentencepiece_tokenizer_json(sp_model)
    else:
        tokenizer_json = train_tokenizer_json(min(cfg.vocab_size, 16384))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", raw)
    std = float(raw.get("initializer_range", 0.08))
    from safetensors.torch import save_file

    save_file(_random_weights(cfg, std, seed, gains), str(out / "model.safetensors"), metadata={"format": "pt"})
    if sp_model:
        (out / "tokenizer.model").write_bytes(sp_model)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(cfg.max_position_embeddings, tokenizer))
    bos, eos = (_SP_BOS_ID, [_SP_IM_END_ID, _SP_EOS_ID]) if sp else (_END_ID, [_IM_END_ID, _END_ID])
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False})
    return out


def make_demo_model(out_dir: str | Path, size: str = "small", seed: int = 0, tokenizer: str = "bpe") -> Path:
    """Write the ``small`` (~1.3M params, fp32) or ``large`` (~100M params, bf16) demo model with
    the ``bpe`` or ``sentencepiece`` tokenizer (same weights either way)."""
    if size not in DEMO_SIZES:
        raise ValueError(f"demo model size must be one of {sorted(DEMO_SIZES)}, got {size!r}")
    return write_random_model(out_dir, DEMO_SIZES[size], seed=seed, architecture="llama", gains=DEMO_GAINS,
                              tokenizer=tokenizer)


def default_demo_dir(size: str = "small", tokenizer: str = "bpe") -> Path:
    """Where ``ensure_demo_model`` keeps a demo model: ``$LLMBUS_DATA_DIR/models/demo-<size>``,
    else ``~/.cache/llmbus/models/demo-<size>`` (``demo-<size>-sp`` for the sentencepiece variant)."""
    if size not in DEMO_SIZES:
        raise ValueError(f"demo model size must be one of {sorted(DEMO_SIZES)}, got {size!r}")
    _check_tokenizer(tokenizer)
    data = os.environ.get("LLMBUS_DATA_DIR")
    root = Path(data) / "models" if data else Path.home() / ".cache" / "llmbus" / "models"
    return root / (f"demo-{size}-sp" if tokenizer == "sentencepiece" else f"demo-{size}")


def _init_version(config: Path) -> str | None:
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("llmbus_demo_init")
    except (OSError, ValueError, AttributeError):  # missing or unreadable: regenerate
        return None


def ensure_demo_model(size: str = "small", tokenizer: str = "bpe") -> Path:
    """The demo model's directory, generated on first use (written aside, then renamed into place)."""
    target = default_demo_dir(size, tokenizer)
    if (target / "model.safetensors").is_file() and _init_version(target / "config.json") == DEMO_INIT_VERSION:
        return target
    if target.exists():  # an older demo model: set aside, then replaced
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    make_demo_model(tmp, size, tokenizer=tokenizer)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; its copy is byte-identical
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return target

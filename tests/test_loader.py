"""The Hugging Face loader and ModelConfig: sharding, dtypes, eos ids, and every bad input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmbus.kv import KVLayout
from llmbus.model.config import ModelConfig
from llmbus.model.loader import load_model
from tests.model_factory import PagedDriver, shard_checkpoint, write_random_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("base"), {}, seed=3)


@pytest.fixture
def scratch(model_dir, tmp_path):
    return shutil.copytree(model_dir, tmp_path / "m")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def _logits(loaded, ids):
    return PagedDriver(loaded.model).step([("a", ids)])[0]


def test_sharded_checkpoint_with_index_loads_the_same_weights(model_dir, scratch):
    files = shard_checkpoint(scratch, 3)
    assert not (scratch / "model.safetensors").exists() and all((scratch / f).is_file() for f in files)
    ids = list(range(5, 60))
    whole, sharded = load_model(model_dir), load_model(scratch)
    assert torch.equal(_logits(whole, ids), _logits(sharded, ids))


def test_model_id_names_the_weights_not_the_directory(model_dir, scratch, tmp_path):
    """The prefix caches key on ``model_id``: every copy of a checkpoint (moved, re-sharded) has
    the same one; the same shapes with other weights, or another config, never do."""
    base = load_model(model_dir).model_id
    assert base.startswith("llama-")
    assert load_model(scratch).model_id == base
    shard_checkpoint(scratch, 3)
    assert load_model(scratch).model_id == base
    other = write_random_model(tmp_path / "other" / model_dir.name, {}, seed=4)  # the same name and shapes
    assert load_model(other).model_id != base

    tuned = shutil.copytree(model_dir, tmp_path / "tuned")
    weights = load_file(tuned / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj.weight"
    weights[name] = weights[name] + 1e-3 * torch.randn_like(weights[name])  # one tensor retrained
    save_file(weights, tuned / "model.safetensors")
    assert load_model(tuned).model_id != base

    rope = shutil.copytree(model_dir, tmp_path / "rope")
    _edit_config(rope, rope_theta=20000.0)
    assert load_model(rope).model_id != base
    # run in another dtype, the same weights make other KV: another identity
    ids = {load_model(model_dir, dtype=d).model_id for d in ("float32", "bfloat16", "float16")}
    assert len(ids) == 3


def test_loaded_metadata(model_dir):
    loaded = load_model(model_dir)
    assert loaded.model_name == model_dir.name
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert loaded.eos_token_ids == tuple(gen["eos_token_id"])
    assert loaded.generation_config == gen
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size <= loaded.config.vocab_size
    assert loaded.model.lm_head is not None


def test_eos_from_int_generation_config_or_config(scratch):
    (scratch / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_model(scratch).eos_token_ids == (7,)
    (scratch / "generation_config.json").unlink()
    _edit_config(scratch, eos_token_id=[4, 9])
    assert load_model(scratch).eos_token_ids == (4, 9)


def test_tied_embeddings_without_lm_head(tmp_path):
    d = write_random_model(tmp_path, {"tie_word_embeddings": True}, seed=1)
    assert "lm_head.weight" not in load_file(str(d / "model.safetensors"))
    model = load_model(d).model
    assert model.lm_head is None and model.lm_head_weight is model.embed_tokens


@pytest.mark.parametrize("stored", ["float16", "bfloat16"])
def test_dtype_conversion(tmp_path, stored):
    d = write_random_model(tmp_path, {"dtype": stored}, seed=2)
    raw = load_file(str(d / "model.safetensors"))
    assert raw["model.norm.weight"].dtype == getattr(torch, stored)
    native = load_model(d).model
    assert native.embed_tokens.dtype == getattr(torch, stored)
    up = load_model(d, dtype="fp32").model
    assert up.embed_tokens.dtype == torch.float32
    assert torch.equal(up.embed_tokens, raw["model.embed_tokens.weight"].float())
    q, k = raw["model.layers.1.self_attn.q_proj.weight"], raw["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(up.layers[1].self_attn.qkv_weight[: q.shape[0]], q.float())
    assert torch.equal(up.layers[1].self_attn.qkv_weight[q.shape[0]: q.shape[0] + k.shape[0]], k.float())


def test_config_parsing_both_rope_spellings_and_layout():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
    legacy = ModelConfig.from_dict(base | {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    modern = ModelConfig.from_dict(base | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert legacy.rope == modern.rope and legacy.rope.theta == 5e5
    assert legacy.head_dim == 8 and legacy.dtype == "bfloat16"
    assert legacy.kv_layout(16) == KVLayout(3, 2, 8, 16, "bfloat16")
    assert legacy.kv_layout(32, "float32").dtype == "float32"
    nulls = ModelConfig.from_dict(base | {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": None})
    assert (nulls.num_key_value_heads, nulls.head_dim, nulls.rms_norm_eps) == (8, 8, 1e-6)
    qwen = ModelConfig.from_dict(base | {"architectures": ["Qwen2ForCausalLM"]})
    assert qwen.qkv_bias and not qwen.o_bias
    mistral = ModelConfig.from_dict(base | {"architectures": ["MistralForCausalLM"], "sliding_window": 4096,
                                           "max_position_embeddings": 32768})
    assert mistral.max_model_len == 4096


BAD_CONFIGS = [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"architectures": None, "model_type": "bert"}, "names no architecture"),
    ({"hidden_size": None}, "missing required field 'hidden_size'"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers must be an integer"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": 66}, "not divisible by num_attention_heads"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}}, "high_freq_factor"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"num_attention_heads": 0, "head_dim": 8}, "num_attention_heads must be a positive integer"),
]


@pytest.mark.parametrize("changes,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_is_a_clear_value_error(scratch, changes, message):
    _edit_config(scratch, **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(scratch)


def test_missing_paths(tmp_path, scratch):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nope")
    (scratch / "config.json").rename(scratch / "config.bak")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(scratch)
    (scratch / "config.bak").rename(scratch / "config.json")
    (scratch / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(scratch)


def test_malformed_files(scratch):
    (scratch / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="generation_config.json: not valid JSON"):
        load_model(scratch)
    (scratch / "generation_config.json").unlink()
    (scratch / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_model(scratch)
    (scratch / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_model(scratch)


def test_missing_and_misshapen_tensors_are_named(scratch):
    path = str(scratch / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load_model(scratch)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model.norm.weight: expected \[64\], got \[3\]"):
        load_model(scratch)


def test_index_naming_a_missing_shard(scratch):
    files = shard_checkpoint(scratch, 2)
    (scratch / files[1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard '{files[1]}'"):
        load_model(scratch)


def test_bad_requested_dtype(model_dir):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(model_dir, dtype="int4")

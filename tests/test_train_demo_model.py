"""scripts/train_demo_model.py: the corpus split, and a checkpoint our loader reads like any other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmbus.model.config import ModelConfig
from llmbus.model.loader import load_model
from scripts.eval_kv_quant import eval_tokens
from scripts.train_demo_model import corpus_files, corpus_tokens, is_held_out, lr_at, main, stdlib_root
from tests.model_factory import PagedDriver, write_random_model

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("base"), TINY, seed=3)


def test_corpus_is_the_stdlib_without_its_tests_and_codec_tables():
    root = stdlib_root()
    files = [p.relative_to(root) for p in corpus_files()]
    assert len(files) > 100 and Path("unittest/case.py") in files
    skipped = {"test", "tests", "idle_test", "site-packages", "encodings"}
    assert not any(skipped & set(p.parts[:-1]) for p in files)


def test_held_out_split_is_by_path_and_tokens_are_each_side_s_files(base):
    eos = ModelConfig.from_dict(json.loads((base / "config.json").read_text())).eos_token_ids[0]
    files = corpus_files()
    held_files = [p for p in files if is_held_out(p)]
    train_files = [p for p in files if not is_held_out(p)]
    assert 0 < len(held_files) < len(files) / 10
    # a file's side depends on its path alone (crc32 % 20), not on which other files exist
    root = stdlib_root()
    assert is_held_out(root / "copy.py") and is_held_out(root / "shutil.py") and not is_held_out(root / "os.py")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    for held_out, first in ((True, held_files[0]), (False, train_files[0])):
        want = tok.encode(first.read_text(encoding="utf-8"), add_special_tokens=False).ids + [eos]
        got = corpus_tokens(base / "tokenizer.json", held_out, len(want) + 5, eos)
        assert got[:len(want)].tolist() == want and len(got) == len(want) + 5


def test_eval_windows_are_disjoint_slices_of_the_held_out_text(base):
    cfg = ModelConfig.from_dict(json.loads((base / "config.json").read_text()))
    held = corpus_tokens(base / "tokenizer.json", True, 1 << 40, cfg.eos_token_ids[0]).tolist()
    got = eval_tokens("stdlib", base, cfg, 4, 50, seed=2)
    starts = []
    for row in got.tolist():
        starts.append(next(i for i in range(len(held) - 49) if held[i:i + 50] == row))
    assert all(b - a >= 50 for a, b in zip(starts, starts[1:]))
    assert not torch.equal(got, eval_tokens("stdlib", base, cfg, 4, 50, seed=3))
    with pytest.raises(ValueError, match="too few"):
        eval_tokens("stdlib", base, cfg, len(held) // 100, 100, seed=0)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    lrs = [lr_at(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10:] == sorted(lrs[10:], reverse=True) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_trained_checkpoint_loads_through_our_loader_and_matches_transformers(base, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "trained"
    assert main(["--base", str(base), "--out", str(out), "--steps", "4", "--batch", "2", "--seq", "32",
                 "--warmup", "2", "--max-tokens", "4000", "--held-out-tokens", "2000", "--save-every", "4"]) == 0
    written = json.loads((out / "config.json").read_text())
    info = written["llmbus_demo_trained"]
    assert "llmbus_demo_init" not in written and written["dtype"] == "bfloat16"
    assert info["steps"] == 4 and info["tokens"] == 4 * 2 * 32 and info["held_out_loss"] > 0
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    ours = load_model(out, dtype="float32")
    tokens = eval_tokens("stdlib", out, ours.config, 2, 24, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.inference_mode():
        want = hf(input_ids=tokens[:1]).logits[0]
    (got,) = PagedDriver(ours.model).step([("a", tokens[0].tolist())])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_eval_paths_teacher_force_the_same_logits(base):
    """scripts/eval_kv_quant.py: one prefill pass gives the decode steps' logits on a model-dtype
    cache; on INT4 the decode path stays near them, at 16- and 32-token blocks, and the prefill pass
    gives them (it attends to its own keys and values as computed); so does the mixed path's prompt
    (a prompt's prefill, then decode steps over what it cached, near them)."""
    from scripts.eval_kv_quant import compare, run_logits

    loaded = load_model(base, dtype="float32")
    tokens = eval_tokens("stdlib", base, loaded.config, 2, 40, seed=1)
    run = {(fmt, path): run_logits(loaded.model, loaded.config, fmt, tokens, "cpu", path=path)
           for fmt in ("model", "int4") for path in ("decode", "prefill")}
    torch.testing.assert_close(run["model", "prefill"], run["model", "decode"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(run["int4", "prefill"], run["model", "prefill"], atol=1e-4, rtol=1e-4)
    got = compare(run["model", "decode"], run["int4", "decode"], alpha=1.0)
    assert got["mean_kl"] < 0.05 and (run["int4", "decode"] - run["model", "decode"]).abs().max() > 1e-2
    # 32-token blocks (--block-size): other key ranges, as near
    wide = run_logits(loaded.model, loaded.config, "int4", tokens, "cpu", 32)
    assert compare(run["model", "decode"], wide, alpha=1.0)["mean_kl"] < 0.05 and not torch.equal(wide, run["int4", "decode"])
    # mixed (a prompt's prefill pass, then decode steps): the model-dtype cache gives the same logits;
    # on INT4 the prompt's positions are the model dtype's, and the decode steps after it read the
    # prompt's blocks quantized (from keys its pass computed exactly): near, not the same
    mixed = {fmt: run_logits(loaded.model, loaded.config, fmt, tokens, "cpu", path="mixed", prompt_tokens=23)
             for fmt in ("model", "int4")}
    torch.testing.assert_close(mixed["model"], run["model", "decode"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed["int4"][:, :23], run["model", "decode"][:, :23], atol=1e-4, rtol=1e-4)
    assert (mixed["int4"][:, 23:] - mixed["model"][:, 23:]).abs().max() > 1e-2
    assert not torch.equal(mixed["int4"][:, 23:], run["int4", "decode"][:, 23:])
    assert compare(mixed["model"][:, 23:], mixed["int4"][:, 23:], alpha=1.0)["mean_kl"] < 0.05
    with pytest.raises(ValueError, match="0 < prompt_tokens < 40"):
        run_logits(loaded.model, loaded.config, "int4", tokens, "cpu", path="mixed", prompt_tokens=40)


def test_eval_candidate_rotated_int4_keys_round_trip_as_described(base):
    """scripts/eval_kv_quant.py's simulated candidate format: keys rotated by an orthonormal
    Hadamard matrix, quantized per token in groups, rotated back; values as INT4's. Its logits stay
    near the model-dtype cache's, and differ from them."""
    from llmbus.kernels import quant_reference as qr
    from scripts.eval_kv_quant import candidate_backend, compare, run_logits

    h = qr.hadamard(32)
    torch.testing.assert_close(h @ h.T, torch.eye(32), atol=1e-6, rtol=0)
    # the round trip of one key row is what the backend stores: rotate, quantize per group, back
    k = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(0))
    back = qr.int4_group_dequantize(*qr.int4_group_quantize(k @ h, 16), 16) @ h.T
    assert 0 < (back - k).abs().max() < 0.5
    loaded = load_model(base, dtype="float32")
    tokens = eval_tokens("stdlib", base, loaded.config, 2, 40, seed=1)
    want = run_logits(loaded.model, loaded.config, "model", tokens, "cpu")
    got = run_logits(loaded.model, loaded.config, "model", tokens, "cpu", backend=candidate_backend("cpu", 16))
    assert compare(want, got, alpha=1.0)["mean_kl"] < 0.05 and not torch.equal(want, got)
    # values rotated too, one group a head: near the model-dtype cache's, and not the keys-only candidate
    both = run_logits(loaded.model, loaded.config, "model", tokens, "cpu",
                      backend=candidate_backend("cpu", 16, value_group=16, rotate_values=True))
    assert compare(want, both, alpha=1.0)["mean_kl"] < 0.05 and not torch.equal(both, got)


def test_saving_a_checkpoint_leaves_the_training_weights_in_fp32(base, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from scripts.train_demo_model import save

    model = LlamaForCausalLM(LlamaConfig.from_pretrained(base)).float()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    save(model, base, tmp_path / "ckpt", {"steps": 0})
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}

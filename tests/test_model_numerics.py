"""Our model through the paged cache vs Hugging Face transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch
import transformers  # the independent reference

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

from llmbus.model.loader import load_model  # noqa: E402
from tests.model_factory import PagedDriver, write_random_model  # noqa: E402

HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}

CASES = {
    # MHA (GQA ratio 1), tied embeddings, a large theta
    "llama_mha_tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True, "rope_theta": 500000.0}),
    # GQA 2, linear scaling in the transformers 4.x spelling
    "llama_gqa2_linear": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    # GQA 4, explicit head_dim != hidden/heads, llama3 scaling in the 5.x spelling
    "llama_gqa4_llama3": ("llama", {
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    # biases everywhere Llama allows them
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True, "num_hidden_layers": 3}),
    # dynamic NTK (equals default rope within max_position_embeddings, as in HF)
    "llama_dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 128}),
    "qwen2_bias_tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral_gqa4": ("mistral", {"num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 1e6}),
}
PROMPT_LEN = 100  # 7 blocks of 16


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    model_dir = write_random_model(tmp_path_factory.mktemp(request.param), overrides, seed=len(request.param), architecture=arch)
    ours = load_model(model_dir, dtype="float32").model
    hf = getattr(transformers, HF_CLASSES[arch]).from_pretrained(model_dir, dtype=torch.float32).eval()
    return ours, hf


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < tol, f"max abs logit diff {diff:.3g} >= {tol}"


def test_whole_prompt_prefill(case):
    ours, hf = case
    ids = _prompt(PROMPT_LEN, ours.config.vocab_size, 1)
    (logits,) = PagedDriver(ours).step([("a", ids)])
    _close(logits, _hf_logits(hf, ids))


def test_chunked_prefill_uneven_chunks(case):
    ours, hf = case
    ids = _prompt(PROMPT_LEN, ours.config.vocab_size, 2)
    driver, got, pos = PagedDriver(ours, seed=3), [], 0
    for size in (7, 13, 16, 1, 30, PROMPT_LEN):
        chunk = ids[pos:pos + size]
        if chunk:
            got += driver.step([("a", chunk)])
            pos += len(chunk)
    _close(torch.cat(got), _hf_logits(hf, ids))


def test_prefill_then_decode(case):
    ours, hf = case
    ids = _prompt(PROMPT_LEN, ours.config.vocab_size, 4)
    driver = PagedDriver(ours, seed=5)
    got = driver.step([("a", ids[:37])])
    for tok in ids[37:]:
        got += driver.step([("a", [tok])])
    _close(torch.cat(got), _hf_logits(hf, ids))


def test_mixed_batch_decodes_then_prefill_chunks(case):
    ours, hf = case
    vocab = ours.config.vocab_size
    lengths = {"p": 75, "q": 40, "r": 93, "s": 20}
    first_step = {"p": 0, "q": 0, "r": 1, "s": 3}
    tokens = {k: _prompt(n, vocab, 10 + i) for i, (k, n) in enumerate(lengths.items())}
    done = dict.fromkeys(lengths, 0)
    got: dict[str, list[torch.Tensor]] = {k: [] for k in lengths}
    driver = PagedDriver(ours, num_blocks=48, seed=7)
    step = 0
    while any(done[k] < n for k, n in lengths.items()):
        live = [k for k in lengths if first_step[k] <= step and done[k] < lengths[k]]
        decodes = [k for k in live if done[k] >= lengths[k] - 6]  # the last 6 tokens one at a time
        prefills = [k for k in live if k not in decodes]
        chunks = [(k, tokens[k][done[k]:done[k] + 1]) for k in decodes]
        chunks += [(k, tokens[k][done[k]:min(done[k] + 23, lengths[k] - 6)]) for k in prefills]
        for (k, chunk), logits in zip(chunks, driver.step(chunks) if chunks else []):
            got[k].append(logits)
            done[k] += len(chunk)
        step += 1
    assert step > 6  # the schedule really interleaved several steps
    for k in lengths:
        _close(torch.cat(got[k]), _hf_logits(hf, tokens[k]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_fp32_like_transformers(tmp_path, dtype):
    """Our half-precision logits are about as far from fp32 as transformers' own."""
    model_dir = write_random_model(tmp_path, {"num_hidden_layers": 3}, seed=11, architecture="llama")
    ids = _prompt(PROMPT_LEN, 512, 12)
    hf_cls = transformers.LlamaForCausalLM
    ref32 = _hf_logits(hf_cls.from_pretrained(model_dir, dtype=torch.float32).eval(), ids)
    ref_half = _hf_logits(hf_cls.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval(), ids)
    ours = load_model(model_dir, dtype=dtype).model
    assert ours.embed_tokens.dtype == getattr(torch, dtype)
    driver = PagedDriver(ours)
    got = torch.cat(driver.step([("a", ids[:50])]) + [driver.step([("a", [t])])[0] for t in ids[50:]])
    ours_err = (got - ref32).abs().max().item()
    hf_err = (ref_half - ref32).abs().max().item()
    assert ours_err < max(2 * hf_err, 0.02), (ours_err, hf_err)
    assert (got - ref_half).abs().max().item() < 0.1
    assert torch.equal(got.argmax(-1)[ref32.max(-1).values - ref32.topk(2).values[:, 1] > 0.1],
                       ref32.argmax(-1)[ref32.max(-1).values - ref32.topk(2).values[:, 1] > 0.1])


def test_forward_rejects_mismatched_inputs(case):
    ours, _ = case
    driver = PagedDriver(ours)
    from llmbus.engine.attention import build_attention_metadata

    meta, pos = build_attention_metadata([([0], 0, 3)], 16)
    with pytest.raises(ValueError, match="same length"):
        ours(torch.tensor([1, 2]), pos, driver.caches, meta)
    with pytest.raises(ValueError, match="per-layer KV caches"):
        ours(torch.tensor([1, 2, 3]), pos, driver.caches[:-1], meta)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values
def test_dynamic_rope_past_max_positions_matches_cached_decoding(tmp_path):
    """Past max_position_embeddings each token takes the base for a context ending at itself:
    what transformers computes when it decodes token by token with a KV cache."""
    overrides = {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}, "max_position_embeddings": 32}
    model_dir = write_random_model(tmp_path, overrides, seed=21, architecture="llama")
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = _prompt(80, 512, 22)
    with torch.no_grad():
        out = hf(torch.tensor([ids[:30]]), use_cache=True)
        ref, past = [out.logits[0]], out.past_key_values
        for tok in ids[30:]:
            out = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            ref.append(out.logits[0])
            past = out.past_key_values
    driver = PagedDriver(load_model(model_dir).model)
    got = driver.step([("a", ids[:30])]) + [driver.step([("a", [t])])[0] for t in ids[30:]]
    _close(torch.cat(got), torch.cat(ref).float())
    # and chunking does not change it (keys are rotated once, at their own position)
    chunked = PagedDriver(load_model(model_dir).model)
    again = chunked.step([("a", ids[:30])]) + chunked.step([("a", ids[30:57])]) + chunked.step([("a", ids[57:])])
    _close(torch.cat(again), torch.cat(got), tol=1e-5)

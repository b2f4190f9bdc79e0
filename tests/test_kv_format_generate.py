"""`llmbus generate --kv-format int8|int4`: the engine runs on quantized KV end to end, and greedy
output agrees with the model-dtype cache for the first tokens on the demo model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmbus.engine.llm import LLM
from llmbus.engine.sampling_params import SamplingParams
from llmbus.model.demo import make_demo_model

PROMPTS = ["The history of the city", "In a small village by the sea", "Numbers: 1, 2, 3,"]
FIRST = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvfmt") / "demo-small"
    make_demo_model(path, "small")
    return path


@pytest.fixture(scope="module")
def baseline(model_dir):
    outs = LLM(model_dir, device="cpu").generate(PROMPTS, SamplingParams(max_tokens=FIRST, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("kv_format", ["int8", "int4", "int4r"])
def test_quantized_kv_greedy_matches_first_tokens(model_dir, baseline, kv_format):
    llm = LLM(model_dir, device="cpu", kv_format=kv_format)
    assert llm.engine.backend.kv_format.name == kv_format
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=FIRST, temperature=0, ignore_eos=True))
    # the first tokens agree exactly; a flip late in a sequence is what quantization may cost
    for out, ref in zip(outs, baseline):
        assert out.token_ids[:4] == ref[:4]
    agree = sum(a == b for out, ref in zip(outs, baseline) for a, b in zip(out.token_ids, ref))
    assert agree >= 0.9 * FIRST * len(PROMPTS)
    leaks = llm.engine.leak_check()
    assert leaks["free_blocks"] == leaks["total_blocks"]


@pytest.mark.parametrize("kv_format", ["int8", "int4", "int4r"])
def test_head_major_caches_serve_the_same_tokens(model_dir, kv_format, monkeypatch):
    """LLMBUS_KV_HEAD_MAJOR stores the engine's caches head-major (llmbus.kernels.backends.HEAD_MAJOR): the
    same greedy tokens as token-major caches of the format, through prefill, decode and tail rows."""
    from llmbus.kernels import backends

    params = SamplingParams(max_tokens=FIRST, temperature=0, ignore_eos=True)
    token_major = [o.token_ids for o in LLM(model_dir, device="cpu", kv_format=kv_format).generate(PROMPTS, params)]
    monkeypatch.setattr(backends, "HEAD_MAJOR", True)
    llm = LLM(model_dir, device="cpu", kv_format=kv_format)
    data = llm.engine.runner.kv_caches[0].data
    assert data.stride(3) > data.stride(2)  # heads outside tokens
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == token_major
    leaks = llm.engine.leak_check()
    assert leaks["free_blocks"] == leaks["total_blocks"]


LONG = ("The history of the city begins with a small village by the sea, where fishermen and traders met every "
        "morning to sell what the night had brought them, ") * 2  # 132 tokens: eight blocks sealed in one pass


def _first_logprobs(model_dir, kv_format):
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5, ignore_eos=True)
    llm = LLM(model_dir, device="cpu", kv_format=kv_format)
    (out,) = llm.generate([LONG], params)
    leaks = llm.engine.leak_check()
    assert leaks["free_blocks"] == leaks["total_blocks"]
    return dict(out.logprobs[0].top)


def _gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(abs(a[t] - b[t]) for t in a)


@pytest.fixture(scope="module")
def model_dtype_first_logprobs(model_dir):
    return _first_logprobs(model_dir, "model")


@pytest.mark.parametrize("kv_format", ["int8", "int4", "int4r"])
def test_a_prompts_pass_attends_to_its_own_kv_exactly(model_dir, model_dtype_first_logprobs, kv_format, monkeypatch):
    """A prompt prefilled in one pass over a quantized cache attends to its own keys and values as
    computed (llmbus.kernels.reference.exact_chunks, as KIVI's prefill does): its first token's logprobs
    are the model-dtype cache's (INT4R's within its int8 query rounding), where reading the
    prompt back from its codes moved them (INT4's by ~8e-3, INT8's by ~6e-4 on this prompt)."""
    from llmbus.kernels import backends, reference

    want = model_dtype_first_logprobs
    exact = _gap(_first_logprobs(model_dir, kv_format), want)
    monkeypatch.setattr(reference, "exact_chunks", lambda *args: None)  # the chunk read back from its codes
    monkeypatch.setattr(backends, "FRESH_FROM_CHUNKS", False)  # (which a fresh prompt's pass skips on CPU)
    read_back = _gap(_first_logprobs(model_dir, kv_format), want)
    assert exact < 1e-3 and exact < 0.25 * read_back, (exact, read_back)


def test_cli_accepts_kv_format(model_dir, baseline):
    proc = subprocess.run(
        [sys.executable, "-m", "llmbus.cli", "generate", "--model", str(model_dir), "--prompt", PROMPTS[0],
         "--max-tokens", str(FIRST), "--ignore-eos", "--kv-format", "int8", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["token_ids"][:4] == baseline[0][:4]


def test_service_workers_take_the_same_option():
    import argparse

    from llmbus.engine.config import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-format", "int4"])).kv_format == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-format", "fp8"])
    proc = subprocess.run([sys.executable, "-m", "services.decode", "--model", "m=/x", "--kv-format", "fp8"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "--kv-format" in proc.stderr

"""Decode steps over ``llmbus.engine.graphs.DecodeGraphs``' static buffers (``--cuda-graphs``).

On CPU the recorded path runs eagerly on the Triton kernels (under ``TRITON_INTERPRET=1``) and must
give the dynamic path's tokens and cache bytes: padding rows only ever touch the sink block. On
CUDA the same comparison runs with the graphs recorded and replayed."""

import contextlib

import pytest
import torch

from llmbus.kernels.backends import TritonAttentionBackend
from llmbus.engine import engine as engine_module
from llmbus.engine.attention import build_attention_metadata
from llmbus.engine.graphs import DecodeGraphs, batch_sizes
from llmbus.engine.llm import LLM
from llmbus.engine.sampling_params import SamplingParams
from tests.model_factory import write_random_model

CUDA = torch.cuda.is_available()


def test_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(3) == [1, 2, 3]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("graphs"), {"num_hidden_layers": 2}, seed=7)


# decodes 3 wide (padded to 4), then 2, then 1; the second prompt's first block fills in a decode step
PROMPTS = ([list(range(3, 20)), list(range(40, 51)), list(range(7, 12))], (5, 7, 3))


def _run(model_dir, fmt, graphs, monkeypatch, device="cpu", max_num_seqs=4, prompts=PROMPTS, **options):
    """Greedy tokens (and logprobs) of ``prompts`` (token lists, max_tokens), plus the LLM (whose
    cache the caller compares) and the batch size of each step that took the recorded path."""
    if device == "cpu":  # NOTE: the Triton kernels on CPU tensors (the interpreter), as on CUDA
        monkeypatch.setattr(engine_module, "make_backend", lambda dev, kv_format: TritonAttentionBackend(kv_format))
    llm = LLM(model_dir, device=device, kv_format=fmt, cuda_graphs=graphs, max_num_seqs=max_num_seqs,
              num_blocks=24, pack_cpu_weights=False, **options)
    runs = []
    if graphs:
        real_run = DecodeGraphs.run

        def counted(self, *args):
            runs.append(args[0].shape[0])
            return real_run(self, *args)

        monkeypatch.setattr(DecodeGraphs, "run", counted)
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=1) for n in prompts[1]]
    outs = llm.generate(prompts[0], params)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], llm, runs


@pytest.mark.parametrize("fmt", ["model", "int8", "int4", "int4r"])
def test_recorded_decode_path_matches_the_dynamic_one(model_dir, fmt, monkeypatch):
    tokens, logprobs, llm, _ = _run(model_dir, fmt, False, monkeypatch)
    g_tokens, g_logprobs, g_llm, runs = _run(model_dir, fmt, True, monkeypatch)
    assert g_llm.engine.runner.graphs is not None and not g_llm.engine.runner.graphs._graphs  # eager here
    assert 3 in runs and 2 in runs  # batches padded to 4 and 2 took the path
    assert g_tokens == tokens
    for a, b in zip(g_logprobs, logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    # the same slots written (padding wrote only to the sink block, the last), the same values up
    # to the projections' roundings (a GEMM of 4 rows may sum in another order than one of 3)
    n = llm.engine.runner.num_blocks
    for a, b in zip(llm.engine.runner.kv_caches, g_llm.engine.runner.kv_caches):
        assert a.data.shape[1] == n and b.data.shape[1] == n + 1
        assert torch.equal(a.data.flatten(3).ne(0).any(-1), b.data[:, :n].flatten(3).ne(0).any(-1))
        assert b.data[:, n].ne(0).any()
        if fmt == "model":
            torch.testing.assert_close(a.data, b.data[:, :n], atol=1e-5, rtol=0)
    if fmt == "int4":  # the tail rows the engine keeps for int4 went through the buffers too
        assert g_llm.engine.runner.graphs.tail_rows is not None


def test_recorded_path_refuses_what_it_was_not_recorded_for(model_dir, monkeypatch):
    _, _, llm, runs = _run(model_dir, "model", True, monkeypatch)
    assert runs == [3] * 2 + [2] * 2 + [1] * 2  # every decode step, no prefill step
    graphs = llm.engine.runner.graphs
    assert graphs.size_for(3) == 4 and graphs.size_for(5) is None
    assert not graphs.fits(5, 1) and not graphs.fits(2, graphs.width + 1)
    mixed, pos = build_attention_metadata([([1], 3, 1), ([2], 0, 4)], 16)
    with pytest.raises(ValueError, match="recorded decode step"):
        graphs.run(torch.zeros(5, dtype=torch.int64), pos, mixed)
    five, pos = build_attention_metadata([([i], 3, 1) for i in range(5)], 16)
    with pytest.raises(ValueError, match="up to 4 decodes"):
        graphs.run(torch.zeros(5, dtype=torch.int64), pos, five)


def test_one_token_prompt_chunks_that_sample_nothing_run_recorded(model_dir, monkeypatch):
    """With one-token prefill chunks every step is decode-shaped, and most sample nothing. INT4:
    the first prompt's first block fills (and is sealed) a token at a time."""
    prompts = ([list(range(3, 20)), list(range(40, 45))], (3, 4))
    tokens, _, _, _ = _run(model_dir, "int4", False, monkeypatch, prompts=prompts, long_prefill_token_threshold=1)
    g_tokens, _, _, runs = _run(model_dir, "int4", True, monkeypatch, prompts=prompts, long_prefill_token_threshold=1)
    assert g_tokens == tokens
    assert len(runs) >= 17 + 2  # the prompts' tokens went through it too, one a sequence a step


def test_cuda_graphs_are_ignored_without_the_triton_backend(model_dir, caplog):
    llm = LLM(model_dir, device="cpu", cuda_graphs=True, num_blocks=8)
    assert llm.engine.runner.graphs is None
    assert "--cuda-graphs needs CUDA" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].token_ids) == 3


def test_graphs_are_the_default_on_cuda_only_and_the_flags_choose(model_dir, monkeypatch, caplog):
    import argparse

    from llmbus.engine.config import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).cuda_graphs is None
    assert engine_config_from_args(parser.parse_args(["--cuda-graphs"])).cuda_graphs is True
    assert engine_config_from_args(parser.parse_args(["--no-cuda-graphs"])).cuda_graphs is False
    # a prefill worker that hands off never decodes: none to record unless asked for
    from services.prefill.__main__ import adjust

    default = engine_config_from_args(parser.parse_args([]))
    assert adjust(default, argparse.Namespace(colocated=False)).cuda_graphs is False
    assert adjust(default, argparse.Namespace(colocated=True)).cuda_graphs is None
    asked = engine_config_from_args(parser.parse_args(["--cuda-graphs"]))
    assert adjust(asked, argparse.Namespace(colocated=False)).cuda_graphs is True
    # the default off CUDA: nothing recorded and nothing said, even on the Triton backend
    monkeypatch.setattr(engine_module, "make_backend", lambda dev, kv_format: TritonAttentionBackend(kv_format))
    llm = LLM(model_dir, device="cpu", num_blocks=8, pack_cpu_weights=False)
    assert llm.engine.runner.graphs is None and "graphs" not in caplog.text


def test_a_recording_that_fails_leaves_decode_on_the_dynamic_path(model_dir, monkeypatch, caplog):
    """Recording can fail on a GPU (out of memory, an op that may not be captured): the engine
    logs it and serves without the recorded path instead of failing to start."""
    # the model-dtype cache: the fallback is the same for every format, and the interpreter runs its kernels fastest
    tokens, logprobs, _, _ = _run(model_dir, "model", False, monkeypatch)

    def fails(self):  # as torch raises from inside ``torch.cuda.graph`` after a size or two
        self._graphs[8] = self._graphs[4] = "recorded"
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    init = DecodeGraphs.__init__
    monkeypatch.setattr(DecodeGraphs, "__init__", lambda self, *a, **kw: init(self, *a, **{**kw, "record": True}))
    monkeypatch.setattr(DecodeGraphs, "_capture", fails)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # a CPU device here
    g_tokens, g_logprobs, llm, runs = _run(model_dir, "model", True, monkeypatch)
    assert "recording decode steps as CUDA graphs failed" in caplog.text
    assert "dynamic path" in caplog.text and "out of memory" in caplog.text
    assert llm.engine.runner.graphs is None and runs == []
    assert (g_tokens, g_logprobs) == (tokens, logprobs)
    assert llm.engine.leak_check()["free_blocks"] == llm.engine.runner.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["model", "int8", "int4", "int4r"])
def test_replayed_graphs_match_eager_steps_on_cuda(model_dir, fmt, monkeypatch):
    tokens, logprobs, _, _ = _run(model_dir, fmt, False, monkeypatch, device="cuda")
    g_tokens, g_logprobs, llm, runs = _run(model_dir, fmt, True, monkeypatch, device="cuda")
    assert set(llm.engine.runner.graphs._graphs) == {1, 2, 4}  # recorded at start
    assert 3 in runs and 2 in runs
    assert g_tokens == tokens
    for a, b in zip(g_logprobs, logprobs):  # decode splits differ (the recorded bound is max_model_len)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


def test_the_gpu_benchmark_compares_replayed_tokens_with_eager_ones(model_dir):
    """scripts/bench_gpu_engine.py runs every row both ways and reports how far the outputs agree;
    here on CPU, where the option is ignored, so they agree entirely."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu_engine.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_engine", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == {"identical": 0.5, "mean_common_prefix": 2.0}
    eager = bench.measure(str(model_dir), "int8", 2, 8, 4, "cpu", False)
    replayed = bench.measure(str(model_dir), "int8", 2, 8, 4, "cpu", True)
    assert [len(t) for t in eager["tokens"]] == [4, 4]
    # each row is timed three times over, on prompts of its own each time (a run is ~0.1 s on a
    # GPU): the median run is reported, each run's rate beside it, and each run's prefill apart
    assert len(eager["tok_per_s_runs"]) == 3 and eager["spread"] >= 1.0 and eager["decode_tokens"] == 2 * 3
    assert len(eager["prefill_ms_runs"]) == 3 and round(eager["prefill_ms"], 2) in eager["prefill_ms_runs"]
    assert min(eager["prefill_ms_runs"]) > 0
    assert bench.agreement(replayed["tokens"], eager["tokens"])["identical"] == 1.0
    # the option is ignored on CPU: the benchmark says no step was replayed, not that graphs ran
    assert replayed["graphs"] and not replayed["recorded"] and not eager["recorded"]

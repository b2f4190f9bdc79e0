"""`bench offline`: HF static batches (and the engine, once it exists) write the serve report shape."""

import json
import os

import pytest

from llmbus.bench.arrivals import ArrivalProcess
from llmbus.bench.datasets import DatasetConfig, build_dataset
from llmbus.bench.offline import run_hf
from llmbus.bench.tinymodel import write_tiny_llama
from llmbus.bench.tokens import BenchTokenizer
from llmbus.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny")), hidden=64, layers=2, heads=2, kv_heads=1, vocab_size=300)


def test_hf_static_batches(model_dir):
    tok = BenchTokenizer(model_dir)
    items = build_dataset(DatasetConfig(num_prompts=5, input_len=12, output_len=6, range_ratio=0.5, seed=3), tok)
    records, duration, cpu = run_hf(model_dir, items, ArrivalProcess(), 0, batch_size=2, ignore_eos=True,
                                    temperature=0.0, progress=False)
    assert cpu > 0 and duration > 0
    assert [r.output_tokens for r in records] == [it.output_len for it in items]
    for r in records:
        assert r.success and len(r.itl_s) == r.output_tokens - 1
        assert 0 < r.ttft_s <= r.e2e_s
    # static batching: batch k+1 starts only after every request of batch k has finished
    batches = [records[0:2], records[2:4], records[4:5]]
    for prev, nxt in zip(batches, batches[1:]):
        assert min(r.start_s for r in nxt) >= max(r.arrival_s + r.e2e_s for r in prev) - 1e-6
        assert len({r.start_s for r in nxt}) == 1


def test_offline_cli_writes_the_report(model_dir, tmp_path, capsys):
    out = tmp_path / "hf.json"
    rc = main(["bench", "offline", "--model", model_dir, "--backend", "hf", "--batch-size", "4", "--num-prompts", "4",
               "--input-len", "8", "--output-len", "4", "--ignore-eos", "--warmup", "2", "--slo", "ttft:60000", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    assert capsys.readouterr().err == ""  # --no-progress: no bar, not even transformers' while it loads
    rep = json.loads(out.read_text())
    assert rep["kind"] == "offline" and rep["label"] == "offline-hf"
    s = rep["summary"]
    assert s["completed"] == 4 and s["total_output_tokens"] == 16 and s["good_requests"] == 4
    assert s["cpu_s_per_output_token"] > 0 and len(rep["requests"]) == 4


def test_engine_backend(model_dir, tmp_path):
    out = tmp_path / "engine.json"
    rc = main(["bench", "offline", "--model", model_dir, "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
               "--ignore-eos", "--out", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 4 and s["total_output_tokens"] == 16


@pytest.mark.parametrize("value", ["4", "0"])
def test_max_concurrency_is_for_serve_only(capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "offline", "--model", "m", "--max-concurrency", value])
    assert exc.value.code == 2
    assert "--max-concurrency applies to `bench serve` only" in capsys.readouterr().err


def test_backend_help_names_only_real_choices(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "offline", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    backend = text.split("--backend {llmbus,hf} ", 1)[1].split(" --batch-size", 1)[0]
    assert "llmbus:" in backend and "hf:" in backend and "vllm:" not in backend
    script = backend.split("run ", 1)[1].split()[0]
    assert os.path.isfile(os.path.join(os.path.dirname(__file__), "..", script))


def test_threads_below_one_is_a_clear_error(capsys, model_dir):
    assert main(["bench", "offline", "--model", str(model_dir), "--threads", "-1"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err

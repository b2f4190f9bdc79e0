"""`llmbus generate` as a user runs it: a real process, real model files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.model_factory import write_random_model
from tests.test_engine import CONFIG


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-model")
    write_random_model(path, CONFIG, seed=1, architecture="llama")
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmbus.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_json_matches_python_api(model_dir):
    from llmbus.engine.llm import LLM
    from llmbus.engine.sampling_params import SamplingParams

    proc = run_cli("generate", "--model", str(model_dir), "--prompt-ids", "5,6,7,8,9", "--prompt-ids", "10,11",
                   "--max-tokens", "6", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [set(r) for r in records] == [{"token_ids", "text", "finish_reason"}] * 2
    expected = LLM(model_dir, dtype="float32").generate([[5, 6, 7, 8, 9], [10, 11]],
                                                         SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [r["token_ids"] for r in records] == [o.token_ids for o in expected]
    assert all(r["finish_reason"] == "length" for r in records)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model", "--prompt", "hi"], "/nonexistent/model"),
        (["--prompt-ids", "1,x"], "--prompt-ids"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", ""], "empty"),
    ],
)
def test_generate_bad_input_is_a_clear_error(model_dir, args, message):
    if args[0] != "--model":
        args = ["--model", str(model_dir), *args]
    proc = run_cli("generate", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr

"""`llmbus generate` as a user runs it: a real process, real model files."""

from __future__ import annotations

import json
import socket
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


def test_generate_json_schema_output_parses(model_dir, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "word": {"enum": ["yes", "no"]}},
              "required": ["ok", "word"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    proc = run_cli("generate", "--model", str(model_dir), "--prompt", "Answer:", "--max-tokens", "200",
                   f"--json-schema=@{path}", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["finish_reason"] == "stop"
    value = json.loads(record["text"])
    assert set(value) == {"ok", "word"} and isinstance(value["ok"], bool) and value["word"] in ("yes", "no")


def test_generate_reads_a_prompt_from_standard_input(model_dir):
    """`--prompt -` is the text on standard input (newlines and all), beside any other prompts."""
    from llmbus.engine.llm import LLM
    from llmbus.engine.sampling_params import SamplingParams

    text = "a b\nc d\n"
    proc = subprocess.run([sys.executable, "-m", "llmbus.cli", "generate", "--model", str(model_dir), "--prompt", "x y",
                           "--prompt", "-", "--max-tokens", "3", "--ignore-eos", "--json"],
                          input=text, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    expected = LLM(model_dir, dtype="float32").generate(["x y", text, "-"],
                                                         SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [r["token_ids"] for r in records] == [o.token_ids for o in expected[:2]]
    assert expected[1].token_ids != expected[2].token_ids  # so a literal "-" would have been caught


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model", "--prompt", "hi"], "/nonexistent/model"),
        (["--prompt-ids", "1,x"], "--prompt-ids"),
        (["--prompt-ids", "1,,2"], "--prompt-ids must be comma-separated integers"),
        (["--prompt", "hi", "--temperature", "-1"], "--temperature must be"),
        (["--prompt", "hi", "--top-p", "0"], "--top-p must be"),
        (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be"),
        (["--prompt", ""], "empty"),
        (["--prompt", "-", "--prompt", "-"], "standard input"),
        (["--prompt-ids", "5,6", "--temperature", "nan"], "temperature must be a finite number"),
        (["--prompt-ids", "5,6", "--temperature", "inf"], "temperature must be a finite number"),
        (["--prompt-ids", "5,6", "--threads", "-2"], "--threads must be >= 1"),
        (["--prompt-ids", "5,6", "--threads", "0"], "--threads must be >= 1"),
        (["--prompt-ids", "5,6", "--long-prefill-threshold", "-1"], "--long-prefill-threshold must be >= 0"),
        (["--prompt-ids", "5,6", "--block-size", "12"], "--block-size must be 8, 16, 32 or 64"),
        (["--prompt-ids", "5,6", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--prompt-ids", "5,6", "--device", "tpu"], "device must be cpu, cuda or cuda:N"),
        (["--prompt-ids", "5,6", "--device", "cuda:64"], "CUDA device(s)"),
        (["--prompt-ids", "5,6", "--json-schema", "{not json"], "--json-schema must be a JSON Schema"),
        (["--prompt-ids", "5,6", "--json-schema", "@/nonexistent/s.json"], "No such file"),
        (["--prompt-ids", "5,6", "--json-schema", '{"type": "array", "uniqueItems": true}'], "--json-schema: schema: 'uniqueItems'"),
        (["--prompt-ids", "5,6", "--json-object", "--ignore-eos"], "--ignore-eos cannot be combined with a guide"),
    ],
)
def test_generate_bad_input_is_a_clear_error(model_dir, args, message):
    if args[0] != "--model":
        args = ["--model", str(model_dir), *args]
    proc = run_cli("generate", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_without_a_tokenizer_takes_token_ids_and_says_so_for_text(model_dir, tmp_path):
    """A model directory without tokenizer.json (or with a directory of that name): token ids work,
    text prompts are a clear error, not a traceback."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model_dir.iterdir():
        if f.name != "tokenizer.json":
            (bare / f.name).symlink_to(f)
    (bare / "tokenizer.json").mkdir()
    proc = run_cli("generate", "--model", str(bare), "--prompt", "hi")
    assert proc.returncode == 2 and "no tokenizer.json" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = run_cli("generate", "--model", str(bare), "--prompt-ids", "5,6", "--max-tokens", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    ids = json.loads(proc.stdout)["token_ids"]
    assert len(ids) == 2
    # without --json the output is the ids (there is no text to show), not an empty line
    proc = run_cli("generate", "--model", str(bare), "--prompt-ids", "5,6", "--max-tokens", "2")
    assert proc.returncode == 0 and proc.stdout == ",".join(map(str, ids)) + "\n", (proc.stdout, proc.stderr)


def test_up_and_demo_model_bad_paths_are_clear_errors(model_dir, tmp_path):
    """`llmbus up` checks its models' configs before it starts NATS (a bad one left the server
    running); paths that cannot be used are one-line errors, not tracebacks."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (broken / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"hidden_size": "wide"}))
    data = tmp_path / "data"
    proc = run_cli("up", "--model", f"m={broken}", "--data-dir", str(data))
    assert proc.returncode == 2 and "hidden_size" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (data / "nats").exists()  # the server never started
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = run_cli("up", "--data-dir", str(a_file / "sub"))
    assert proc.returncode == 2 and str(a_file) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = run_cli("demo-model", "--out", str(a_file))
    assert proc.returncode == 2 and str(a_file) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = run_cli("demo-model", "--seed", "7")  # would have replaced the cached model `llmbus up` serves
    assert proc.returncode == 2 and "--seed other than 0 needs --out" in proc.stderr, proc.stderr
    # what the gateway would refuse is refused before NATS starts: a port in use, a bad API keys
    # file (and --colocated needs no decode workers)
    keys = tmp_path / "keys.json"
    keys.write_text('{"short": "t"}')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for extra, message in ((["--port", port, "--colocated", "--decode", "0"], f"cannot listen on 127.0.0.1:{port}"),
                               (["--api-keys-file", str(keys)], "8 or more printable characters")):
            proc = run_cli("up", "--model", f"m={model_dir}", "--data-dir", str(data), "--host", "127.0.0.1", *extra)
            assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
            assert not (data / "nats").exists()


@pytest.mark.parametrize("command", [["generate", "--model", "m", "--prompt", "hi"],
                                     ["bench", "serve", "--model", "m", "--tokenizer", "t"], ["up"]])
def test_an_unknown_option_shows_its_subcommands_usage(command, capsys):
    """Not the top-level usage (argparse's own for unknown arguments after a subcommand)."""
    from llmbus.cli import main

    with pytest.raises(SystemExit) as exc:
        main([*command, "--bogus"])
    err = capsys.readouterr().err
    name = " ".join(c for c in command[:2] if not c.startswith("-"))
    assert exc.value.code == 2 and err.startswith(f"usage: llmbus {name} ") and "unrecognized arguments: --bogus" in err


def test_model_names_that_would_share_a_work_queue_are_refused(model_dir, tmp_path):
    """Names map to subject tokens ("." -> "_"): "a.b" and "a_b" would share one work queue, so
    either model's workers could answer the other's requests. `llmbus up`, the gateway and a
    worker refuse such names (and names with spaces) before anything starts."""
    from services.gateway.config import GatewayConfig, ModelSpec

    data = tmp_path / "data"
    proc = run_cli("up", "--model", f"a.b={model_dir}", "--model", f"a_b={model_dir}", "--data-dir", str(data))
    assert proc.returncode == 2 and "share the subject token 'a_b'" in proc.stderr, proc.stderr
    assert not (data / "nats").exists()
    with pytest.raises(ValueError, match="share the subject token"):
        GatewayConfig("nats://x", (ModelSpec("q/w", "d"), ModelSpec("q_w", "d")))
    with pytest.raises(ValueError, match="unique"):
        GatewayConfig("nats://x", (ModelSpec("m", "d"), ModelSpec("m", "e")))
    proc = subprocess.run([sys.executable, "-m", "services.decode", "--model", f"my model={model_dir}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "without spaces" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "services.prefill", "--model", f"m={model_dir}", "--drain-timeout", "-1"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == "prefill: error: --drain-timeout must be >= 0 seconds, got -1.0"


@pytest.mark.parametrize("worker_args", [["--worker-arg=--max-model-len=24"], ["--worker-arg=--max-model-len", "--worker-arg=24"]])
def test_up_tells_the_gateway_the_context_its_workers_serve(model_dir, worker_args):
    """`llmbus up --worker-arg=--max-model-len=N` shortens the workers' context; the gateway must
    check prompts against the same N, so a prompt too long for it is a 400 context_length_exceeded
    there, not a worker's error (a 500) after queueing. An override never lengthens a context."""
    import argparse

    from llmbus.launch import _plan, register
    from services.gateway.config import ModelSpec
    from services.gateway.models import ServedModel

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["up", "--model", f"m={model_dir}", *worker_args])
    gateway = next(c for c in _plan(args, "nats://127.0.0.1:4222", [("m", str(model_dir))]) if c.name == "gateway")
    assert gateway.argv[gateway.argv.index("--max-model-len") + 1] == "24"
    assert ServedModel.load(ModelSpec("m", str(model_dir), 24)).max_model_len == 24
    full = ServedModel.load(ModelSpec("m", str(model_dir))).max_model_len
    assert ServedModel.load(ModelSpec("m", str(model_dir), full + 100)).max_model_len == full

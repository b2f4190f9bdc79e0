"""Shared fixtures for the gateway tests (no tests here): a real nats-server, the real gateway
process on a free port, and a scripted worker: a peer on the bus that pulls GenerateRequests from
JetStream and publishes known TokenEvents, recording every Abort it hears.

NOTE: the server, worker and gateway are per module: fixtures imported into two modules would
otherwise give two workers sharing one durable consumer, each taking the other's requests."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from llmbus.bus import subjects
from llmbus.bus.server import EmbeddedNats
from llmbus.bus.streams import ensure_streams
from llmbus.bus.tokens import TokenPublisher
from llmbus.model.demo import make_demo_model
from llmbus.model.tokenizer import Tokenizer
from llmbus.protocol import Abort, GenerateRequest, TokenEvent, decode

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 128
TOKEN_TIMEOUT_S = 1.5
MAX_BODY_BYTES = 16384


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    """Poll until ``predicate()`` is truthy (bounded, so a broken gateway fails instead of hanging)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class ScriptedWorker:
    """Runs on its own event loop in a thread. ``script(request, emit)`` is an async function the
    test sets; ``emit(event)`` publishes a TokenEvent on the request's token subject."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.script = None
        self.requests: list[tuple[GenerateRequest, dict]] = []
        self.aborts: list[Abort] = []
        self.crash: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("scripted worker did not start")

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # surfaced by close(): a dead worker must fail the tests loudly
            self.crash = exc

    async def _main(self) -> None:
        import nats

        nc = await nats.connect(self.url)
        js = nc.jetstream()
        await ensure_streams(js)
        psub = await js.pull_subscribe(subjects.REQUESTS_SUBJECTS, durable=subjects.ROUTER_CONSUMER,
                                       stream=subjects.REQUESTS_STREAM)

        async def on_abort(msg) -> None:
            self.aborts.append(decode(Abort, msg.data))

        await nc.subscribe(subjects.ABORTS_WILDCARD, cb=on_abort)
        tokens = TokenPublisher(nc)
        self._ready.set()
        tasks = set()
        while not self._stop.is_set():
            try:
                msgs = await psub.fetch(1, timeout=0.2)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                await msg.ack()
                req = decode(GenerateRequest, msg.data)
                self.requests.append((req, dict(msg.headers or {})))

                async def emit(event: TokenEvent, subject=req.token_subject) -> None:
                    await tokens.publish(subject, event)  # as the workers send them (batched)

                if self.script is not None:
                    task = asyncio.ensure_future(self.script(req, emit))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()
        await tokens.drain()
        await nc.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "scripted worker did not stop"
        assert self.crash is None, f"scripted worker crashed: {self.crash!r}"

    def aborts_for(self, request_id: str) -> list[Abort]:
        return [a for a in self.aborts if a.request_id == request_id]


def reply_script(ids: list[int], *, per_event: int = 1, finish: str = "stop", cached: int = 0,
                 logprobs=None, gap_after: int | None = None, silent_after: int | None = None,
                 delay: float = 0.0, error: str | None = None):
    """A script sending ``ids`` ``per_event`` at a time with exact cumulative usage, then a finish.
    ``gap_after=k`` skips seq k+1; ``silent_after=k`` stops after k events; ``error`` fails at the end
    (or is the message of another ``finish``, such as a worker's ``abort``)."""

    async def script(req: GenerateRequest, emit) -> None:
        seq, sent = 0, 0
        chunks = [ids[i:i + per_event] for i in range(0, len(ids), per_event)] or [[]]
        for i, chunk in enumerate(chunks):
            if silent_after is not None and seq >= silent_after:
                return
            sent += len(chunk)
            last = i == len(chunks) - 1
            lps = logprobs(chunk) if logprobs else None
            reason = ("error" if error and finish == "stop" else finish) if last else None
            await emit(TokenEvent(req.request_id, seq, chunk, lps, reason, error if last else None,
                                  len(req.prompt_token_ids), cached, sent, "scripted"))
            seq += 2 if gap_after is not None and seq == gap_after else 1
            if delay:
                await asyncio.sleep(delay)

    return script


class GatewayProcess:
    def __init__(self, nats_url: str, model_dir: Path, log_path: Path, extra: tuple[str, ...] = ()) -> None:
        self.log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "services.gateway", "--nats-url", nats_url, "--model", f"demo={model_dir}",
               "--host", "127.0.0.1", "--port", "0", "--max-model-len", str(MAX_MODEL_LEN),
               "--token-timeout", str(TOKEN_TIMEOUT_S), "--max-body-bytes", str(MAX_BODY_BYTES), *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = ""
        for line in iter(self.proc.stdout.readline, b""):  # until the ready line, or EOF if it failed
            text = line.decode()
            if text.startswith("llmbus gateway listening "):
                self.url = text.split()[-1]
            if text.startswith("llmbus-ready gateway "):
                break
        if not self.url or self.proc.poll() is not None:
            self.proc.kill()
            raise RuntimeError(f"gateway did not start; log: {log_path.read_text()[-2000:]}")

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(20)
        finally:
            self.log.close()


@pytest.fixture(scope="session")
def scratch():
    """A private temporary directory. NOTE: not tmp_path_factory: pytest sessions running side by
    side on this machine prune each other's basetemp, which would delete a live JetStream store."""
    path = Path(tempfile.mkdtemp(prefix="llmbus-gateway-tests-"))
    yield path
    if os.environ.get("LLMBUS_KEEP_TEST_DIRS") != "1":
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir(scratch) -> Path:
    return make_demo_model(scratch / "model", "small")


@pytest.fixture(scope="session")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def gw_nats(scratch, request):
    with EmbeddedNats(scratch / f"nats-{request.module.__name__}") as server:
        yield server.url


@pytest.fixture(scope="module")
def worker(gw_nats):
    w = ScriptedWorker(gw_nats)
    yield w
    w.close()


@pytest.fixture(scope="module")
def gateway(gw_nats, model_dir, worker, scratch, request):
    proc = GatewayProcess(gw_nats, model_dir, scratch / f"gateway-{request.module.__name__}.log")
    yield proc.url
    assert proc.stop() == 0


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE response, JSON-decoded except the final ``[DONE]``."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out

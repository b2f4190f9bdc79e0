"""Start the real stack (`llmbus up`: nats-server, kvpool, router, prefill, decode, gateway as
separate processes) for end-to-end tests, and read its state back from the bus."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from llmbus.bench.cputime import children_map
from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.kvclient import KVPoolClient
from llmbus.bus.streams import read_registry
from llmbus.protocol import InstanceInfo


class Stack:
    def __init__(self, model_name: str, model_dir: Path, data_dir: Path, *extra: str, env: dict | None = None) -> None:
        self.model_name = model_name
        self.lines: list[str] = []
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmbus.cli", "up", "--data-dir", str(data_dir), "--port", "0",
             "--model", f"{model_name}={model_dir}", "--threads", "1", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        self._ready = threading.Event()
        self.base_url = ""
        self.nats_url = ""
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(240) or not self.base_url:
            self.stop()
            raise RuntimeError("llmbus up did not become ready:\n" + "".join(self.lines[-40:]))

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := re.search(r"nats-server at (\S+)", line):
                self.nats_url = m.group(1)
            if m := re.search(r"ready — OpenAI API at (\S+)", line):
                self.base_url = m.group(1)
                self._ready.set()
        self._ready.set()

    def stop(self, timeout: float = 150) -> int:
        """SIGINT `llmbus up`, as Ctrl-C does; its exit code. ``timeout`` covers up's own bounds (each
        of four service groups gets 30 s before SIGKILL, then NATS 10 s); past it ``up`` and its
        services are killed. Unless it exits 0, its log's end goes to stderr (shown with a failure)."""
        if self.proc.poll() is None:
            services = children_map().get(self.proc.pid, [])
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                for pid in services:  # each in a process group of its own, which `up` no longer stops
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
        if self.proc.returncode != 0:
            print(f"llmbus up exited {self.proc.returncode}; its log's end:\n" + "".join(self.lines[-60:]), file=sys.stderr)
        return self.proc.returncode

    def log(self) -> str:
        return "".join(self.lines)

    # --- state read back over the bus -----------------------------------------------------------

    def instances(self) -> list[InstanceInfo]:
        async def read():
            nc = await connect(self.nats_url)
            try:
                return await read_registry(await nc.jetstream().key_value(subjects.REGISTRY_BUCKET))
            finally:
                await nc.close()

        return asyncio.run(read())

    def delivered(self, stream: str, consumer: str) -> int:
        """Messages ``consumer`` of ``stream`` has delivered so far (0 when it does not exist)."""
        async def read():
            nc = await connect(self.nats_url)
            try:
                return (await nc.jetstream().consumer_info(stream, consumer)).delivered.consumer_seq
            except Exception:  # NotFoundError
                return 0
            finally:
                await nc.close()

        return asyncio.run(read())

    def kvpool_stats(self):
        """kvpool's ``PoolStats``."""
        async def read():
            nc = await connect(self.nats_url)
            try:
                return await KVPoolClient(nc).stats()
            finally:
                await nc.close()

        return asyncio.run(read())

    def kvpool_leased_blocks(self) -> int:
        return self.kvpool_stats().leased_blocks

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Wait until kvpool leases nothing and every worker holds no request and no KV block."""
        deadline = time.monotonic() + timeout
        while True:
            workers = [i for i in self.instances() if i.role in ("prefill", "decode")]
            state = {
                "kvpool_leased_blocks": self.kvpool_leased_blocks(),
                "workers": {i.instance_id: (i.queue_depth, i.total_blocks - i.free_blocks) for i in workers},
            }
            idle = state["kvpool_leased_blocks"] == 0 and workers and all(
                v == (0, 0) for v in state["workers"].values()
            )
            if idle or time.monotonic() > deadline:
                return state
            time.sleep(0.5)

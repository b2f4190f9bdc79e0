"""TTFT of a shared prefix through the service, per tier: miss, tier-0 hit (the prefill worker's own
cache), CPU-tier hit and SSD-tier hit (kvpool), for several prefix lengths on the large demo model.

    .venv/bin/python scripts/bench_prefix_tiers.py [--model bench-results/models/large-sp] [--lengths 256,1024,4064]

Per length, two stacks: (1) workers sized to hold one prefix, so a second long prompt pushes the
first out of tier 0 while kvpool's CPU tier keeps both -> CPU hit; (2) the same with a CPU tier that
holds one prefix and an SSD tier behind it, so the second prompt demotes the first to SSD -> SSD hit.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import tempfile
import time

import httpx

BLOCK = 16


def prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(300, 8000) for _ in range(n)]


class Stack:
    def __init__(self, model: str, port: int, extra: list[str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="llmbus-tiers-")
        self.port = port
        self.proc = subprocess.Popen([".venv/bin/llmbus", "up", "--model", f"large={model}", "--port", str(port),
                                      "--data-dir", self.dir, *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for line in self.proc.stdout:
            if "ready — OpenAI API" in line:
                return
        raise RuntimeError("llmbus up did not start")

    def ttft(self, ids: list[int]) -> tuple[float, int]:
        body = {"model": "large", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t = time.perf_counter()
        first, cached = None, 0
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    d = json.loads(line[6:])
                    if first is None and d.get("choices"):
                        first = time.perf_counter() - t
                    if d.get("usage"):
                        cached = d["usage"].get("prompt_tokens_details", {}).get("cached_tokens") or 0
        return first, cached

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(90)
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-results/models/large-sp")
    ap.add_argument("--lengths", default="256,1024,4064")
    ap.add_argument("--block-bytes", type=int, default=196608, help="one block of the model, all layers, tier-0 format")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        blocks = n // BLOCK + 1
        workers = [f"--worker-arg=--num-blocks={blocks + 8}"]
        a, b = prompt(n, n), prompt(n + 1, n)
        s = Stack(args.model, 8500, workers)
        try:
            s.ttft(prompt(7, 32))  # warm-up
            miss, _ = s.ttft(a + prompt(11, 16))
            t0, c0 = s.ttft(a + prompt(12, 16))
            s.ttft(b + prompt(13, 16))  # pushes a out of tier 0; kvpool keeps both in CPU
            cpu, c1 = s.ttft(a + prompt(14, 16))
        finally:
            s.close()
        cap = (blocks + 2) * args.block_bytes
        s = Stack(args.model, 8501, workers + [f"--kvpool-arg=--cpu-bytes={cap}", f"--kvpool-arg=--ssd-bytes={8 * cap}"])
        try:
            s.ttft(prompt(7, 32))
            s.ttft(a + prompt(11, 16))
            s.ttft(b + prompt(13, 16))  # a leaves tier 0 and is demoted CPU -> SSD
            ssd, c2 = s.ttft(a + prompt(14, 16))
        finally:
            s.close()
        row = {"prefix": n, "miss_ms": miss * 1e3, "tier0_ms": t0 * 1e3, "tier0_cached": c0, "cpu_ms": cpu * 1e3,
               "cpu_cached": c1, "ssd_ms": ssd * 1e3, "ssd_cached": c2}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| prefix tokens | miss | tier-0 hit | CPU-tier hit | SSD-tier hit |\n|---:|---:|---:|---:|---:|")
    for r in rows:
        m = r["miss_ms"]
        print(f"| {r['prefix']} | {m:.0f} ms | {r['tier0_ms']:.0f} ms ({r['tier0_ms'] / m:.2f}x, {r['tier0_cached']} cached) "
              f"| {r['cpu_ms']:.0f} ms ({r['cpu_ms'] / m:.2f}x, {r['cpu_cached']}) | {r['ssd_ms']:.0f} ms "
              f"({r['ssd_ms'] / m:.2f}x, {r['ssd_cached']}) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

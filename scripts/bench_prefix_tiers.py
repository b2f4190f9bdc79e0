"""TTFT of a 1,024-token prefix through the service: miss, tier-0 hit, CPU-tier hit (after the
prefix is pushed out of the prefill worker's 72-block cache); large demo model.

    .venv/bin/python scripts/bench_prefix_tiers.py   (expects bench-results/models/large-sp)
"""
import subprocess, sys, time, random, json, re, os, signal
import httpx
M = "bench-results/models/large-sp"
proc = subprocess.Popen([".venv/bin/llmbus", "up", "--model", f"large={M}", "--port", "8500", "--data-dir", "/tmp/ttft-tiers",
                         "--worker-arg=--num-blocks=72"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for line in proc.stdout:
    if "ready — OpenAI API" in line:
        break
rng = random.Random(0)
def prompt(seed, n):
    r = random.Random(seed); return [r.randrange(300, 8000) for _ in range(n)]
def ttft(ids):
    t = time.perf_counter(); first = None; cached = None
    body = {"model": "large", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", "http://127.0.0.1:8500/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if first is None and d.get("choices"):
                first = time.perf_counter() - t
            if d.get("usage"):
                cached = d["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    return first, cached
A = prompt(1, 1024); B = prompt(2, 1024)
rows = []
for label, ids in [("warm-up (other prefix)", prompt(9, 64)),
                   ("miss", A + prompt(11, 16)),
                   ("tier-0 hit", A + prompt(12, 16)),
                   ("evict A from tier 0 (another 1,024-token prompt)", B + prompt(13, 16)),
                   ("CPU-tier hit", A + prompt(14, 16)),
                   ("miss (third prefix)", prompt(3, 1024) + prompt(15, 16))]:
    dt, cached = ttft(ids)
    rows.append((label, dt, cached)); print(f"{label}: {dt*1000:.0f} ms, cached {cached}", flush=True)
proc.send_signal(signal.SIGINT); proc.wait(60)

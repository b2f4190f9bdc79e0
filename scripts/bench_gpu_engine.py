"""Decode throughput of the engine on a CUDA device: the large demo model, Triton attention,
model-dtype / int8 / int4 / int4r KV, at several batch sizes, each with decode steps run eagerly and
replayed as CUDA graphs (``--cuda-graphs``; ``--graphs off|on|both``). Prints a markdown table and
writes JSON.

    python scripts/bench_gpu_engine.py --out bench-results/gpu-engine.json [--model DIR] [--graphs both]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(model_dir: str, kv_format: str, batch: int, prompt_len: int, out_len: int, device: str,
            graphs: bool, repeats: int = 3) -> dict:
    """Decode tokens/s of ``batch`` greedy requests, ``repeats`` times over (the median reported: one
    run of 64 steps is ~0.1 s, which one hiccup moves by tens of percent), and the time of each
    run's prefill apart (``prefill_ms``, median: the batch's prompts to their first tokens, each run
    on prompts of its own, so no prefix is cached)."""
    import torch

    from llmbus.engine.llm import LLM
    from llmbus.engine.sampling_params import SamplingParams

    llm = LLM(model_dir, dtype="bfloat16", device=device, kv_format=kv_format, max_num_seqs=batch,
              max_num_batched_tokens=max(2048, batch * prompt_len), kv_cache_bytes=8 << 30,
              cuda_graphs=graphs)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.vocab_size
    prompts_of = [[torch.randint(10, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
                  for _ in range(repeats + 1)]  # the last for the warm-up
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(prompts_of[-1][: min(batch, 4)], warm)
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    engine = llm.engine
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs, prefills, first = [], [], None
    for rep in range(repeats):
        prompts = prompts_of[rep]
        tokens: dict[str, list[int]] = {f"r{rep}b{i}": [] for i in range(batch)}

        def step() -> int:
            outs = engine.step()
            for o in outs:
                tokens[o.request_id].extend(o.new_token_ids)
            return sum(len(o.new_token_ids) for o in outs)

        for i, p in enumerate(prompts):
            engine.add_request(f"r{rep}b{i}", p, params)
        # prefill first (timed apart), then time pure decode steps
        sync()
        t0 = time.perf_counter()
        while any(len(s.output_token_ids) == 0 for s in engine._seqs.values()):
            step()
        sync()
        prefills.append(1000 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        steps = decoded = 0
        while engine.has_unfinished():
            decoded += step()
            steps += 1
        sync()
        runs.append((time.perf_counter() - t0, decoded, steps))
        first = first or [tokens[f"r{rep}b{i}"] for i in range(batch)]
    dt, decoded, steps = sorted(runs, key=lambda r: r[1] / r[0])[len(runs) // 2]  # the median run
    # NOTE: a recording that failed leaves the engine on the dynamic path (logged): say so per row
    recorded = engine.runner.graphs is not None and bool(engine.runner.graphs._graphs)
    return {"kv_format": kv_format, "batch": batch, "graphs": graphs, "recorded": recorded,
            "prompt_len": prompt_len, "decode_tokens": decoded,
            "seconds": dt, "tok_per_s": decoded / dt, "ms_per_step": 1000 * dt / max(steps, 1),
            "tok_per_s_runs": [round(n / t, 1) for t, n, _ in runs],
            "prefill_ms": sorted(prefills)[len(prefills) // 2], "prefill_ms_runs": [round(t, 2) for t in prefills],
            "spread": max(n / t for t, n, _ in runs) / min(n / t for t, n, _ in runs),
            "tokens": first}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy outputs of the same prompts two ways: sequences identical, and the mean length of
    their common prefix (recorded and eager steps may split the KV differently, so a near tie
    can flip a token; a wrong kernel diverges at once)."""
    prefix = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a, b)]
    return {"identical": sum(s == t for s, t in zip(a, b)) / max(1, len(a)),
            "mean_common_prefix": sum(prefix) / max(1, len(prefix))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--formats", default="model,int8,int4,int4r")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (the median reported)")
    ap.add_argument("--graphs", default="both", choices=("off", "on", "both"),
                    help="decode steps eagerly, replayed as CUDA graphs, or each in turn")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    model_dir = args.model
    if not model_dir:
        from llmbus.model.demo import make_demo_model

        model_dir = str(Path(tempfile.mkdtemp()) / "demo-large")
        t = time.perf_counter()
        make_demo_model(model_dir, "large")
        print(f"generated the large demo model in {time.perf_counter() - t:.1f}s", flush=True)
    rows = []
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.graphs]
    name = device_name(args.device)
    for fmt in args.formats.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            for graphs in modes:
                try:
                    r = measure(model_dir, fmt, b, args.prompt_len, args.out_len, args.device, graphs, args.repeats)
                except Exception as exc:  # report and go on: one failure must not hide the rest
                    r = {"kv_format": fmt, "batch": b, "graphs": graphs, "error": f"{type(exc).__name__}: {exc}"}
                eager = next((x for x in rows if x["kv_format"] == fmt and x["batch"] == b and not x["graphs"]
                              and "tokens" in x), None)
                if graphs and eager is not None and "tokens" in r:
                    r["vs_eager"] = agreement(r["tokens"], eager["tokens"])
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
                save(args.out, name, rows)  # NOTE: after every row, so a timeout keeps what was measured
    print(f"\n{name} — large demo model, bf16 weights, prompt {args.prompt_len}, "
          f"{args.out_len} decode steps, median of {args.repeats} runs\n")
    print("| KV format | batch | CUDA graphs | decode tok/s | ms/step | max/min of the runs | prefill ms | tokens as eager |\n"
          "|---|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        mode = "off" if not r["graphs"] else "on" if r.get("recorded", True) else "on, NOT recorded"
        if "error" in r:
            print(f"| {r['kv_format']} | {r['batch']} | {mode} | error: {r['error'][:60]} | | | | |")
        else:
            same = r.get("vs_eager")
            same = f"{same['identical']:.0%} (prefix {same['mean_common_prefix']:.1f})" if same else ""
            print(f"| {r['kv_format']} | {r['batch']} | {mode} | {r['tok_per_s']:.0f} | {r['ms_per_step']:.2f} "
                  f"| {r['spread']:.2f} | {r['prefill_ms']:.1f} | {same} |")
    return 0


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def save(out: str, name: str, rows: list[dict]) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        kept = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
        Path(out).write_text(json.dumps({"device": name, "rows": kept}, indent=1))


if __name__ == "__main__":
    sys.exit(main())

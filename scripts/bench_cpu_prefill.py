"""Prefill time of the in-process engine on CPU, per KV format, side by side.

For each ``--kv-formats`` entry in turn (``--runs`` rounds, formats alternating within a round so a
noisy machine's drift spreads over all of them), a fresh engine on the demo model prefills
``--batch`` random prompts of ``--prompt-len`` tokens to their first token (one warm round first,
not timed) and reports the wall time of the steps that did it. ``--cached-prefix N``: the first
prompt follows N tokens prefilled and cached before the clock starts (prefix reuse: one long
context beside fresh prompts in the same step).

    python scripts/bench_cpu_prefill.py [--model-dir DIR | --demo large] [--kv-formats model,int8,int4] [--batch 8]
        [--prompt-len 1024] [--runs 2] [--cached-prefix N] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prefill_ms(engine, batch: int, prompt_len: int, tag: str, seed: int, cached_prefix: int = 0) -> tuple[float, int]:
    """Wall time of the steps that prefill ``batch`` random prompts of ``prompt_len`` tokens, and the
    prompt tokens they found cached; with ``cached_prefix``, the first prompt follows that many
    tokens prefilled (and cached) before the clock starts, so it attends to a long context beside
    fresh prompts."""
    import torch

    from llmbus.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    prefix = torch.randint(100, engine.vocab_size, (cached_prefix,), generator=g).tolist()
    if prefix:
        engine.add_request(f"{tag}prefix", prefix, params)
        while engine.has_unfinished():
            engine.step()
    for i in range(batch):
        prompt = torch.randint(100, engine.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(f"{tag}{i}", (prefix if i == 0 else []) + prompt, params)
    t = time.perf_counter()
    cached = {}
    while engine.has_unfinished():
        for out in engine.step():
            cached[out.request_id] = out.num_cached_tokens
    return 1000 * (time.perf_counter() - t), sum(cached.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, help="a model directory instead of the demo model")
    ap.add_argument("--demo", default="large")
    ap.add_argument("--kv-formats", default="model,int8,int4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cached-prefix", type=int, default=0,
                    help="the first prompt follows this many cached tokens (a long context beside fresh prompts)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from llmbus.engine.config import EngineConfig
    from llmbus.engine.engine import Engine
    from llmbus.model.demo import ensure_demo_model

    model = str(args.model_dir or ensure_demo_model(args.demo))
    formats = args.kv_formats.split(",")
    engines = {f: Engine.from_model_dir(model, EngineConfig(max_num_seqs=args.batch, kv_format=f)) for f in formats}
    for f, e in engines.items():
        prefill_ms(e, args.batch, args.prompt_len, "warm", 0, args.cached_prefix)
    rows, cached = [], []
    for r in range(args.runs):
        got = {f: prefill_ms(e, args.batch, args.prompt_len, f"r{r}-", r + 1, args.cached_prefix)
               for f, e in engines.items()}
        rows.append({f: ms for f, (ms, _) in got.items()})
        cached.append({f: n for f, (_, n) in got.items()})
        print(f"run {r + 1}: " + ", ".join(f"{f} {ms:.0f} ms" for f, ms in rows[-1].items()), flush=True)
    if args.out:
        given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.out.write_text(json.dumps(dict(args=given, runs=rows, cached_tokens=cached), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

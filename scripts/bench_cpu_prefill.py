"""Prefill time of the in-process engine on CPU, per KV format, side by side.

For each ``--kv-formats`` entry in turn (``--runs`` rounds, formats alternating within a round so a
noisy machine's drift spreads over all of them), a fresh engine on the demo model prefills
``--batch`` random prompts of ``--prompt-len`` tokens to their first token (one warm round first,
not timed) and reports the wall time of the steps that did it.

    python scripts/bench_cpu_prefill.py [--model-dir DIR | --demo large] [--kv-formats model,int8,int4] [--batch 8]
        [--prompt-len 1024] [--runs 2] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prefill_ms(engine, batch: int, prompt_len: int, tag: str, seed: int) -> float:
    import torch

    from llmbus.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}{i}", torch.randint(100, engine.vocab_size, (prompt_len,), generator=g).tolist(), params)
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return 1000 * (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, help="a model directory instead of the demo model")
    ap.add_argument("--demo", default="large")
    ap.add_argument("--kv-formats", default="model,int8,int4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from llmbus.engine.config import EngineConfig
    from llmbus.engine.engine import Engine
    from llmbus.model.demo import ensure_demo_model

    model = str(args.model_dir or ensure_demo_model(args.demo))
    formats = args.kv_formats.split(",")
    engines = {f: Engine.from_model_dir(model, EngineConfig(max_num_seqs=args.batch, kv_format=f)) for f in formats}
    for f, e in engines.items():
        prefill_ms(e, args.batch, args.prompt_len, "warm", 0)
    rows = []
    for r in range(args.runs):
        row = {f: prefill_ms(e, args.batch, args.prompt_len, f"r{r}-", r + 1) for f, e in engines.items()}
        rows.append(row)
        print(f"run {r + 1}: " + ", ".join(f"{f} {ms:.0f} ms" for f, ms in row.items()), flush=True)
    if args.out:
        given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.out.write_text(json.dumps(dict(args=given, runs=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

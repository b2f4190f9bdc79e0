"""The sampler's time per step on CPU: the C warp-and-draw (default) against the torch path
(``LLMBUS_CPU_SAMPLER=torch``), alternating, for a batch of random logits and a few settings
(penalties are applied the same way on both paths).

    python scripts/bench_sampler.py [--batch 32] [--vocab 16384] [--threads 2] [--steps 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from llmbus.engine.sampler import Sampler  # noqa: E402
from llmbus.engine.sampling_params import SamplingParams  # noqa: E402
from llmbus.engine.sequence import Sequence  # noqa: E402

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k 50, top_p 0.95, min_p 0.05": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    "top_p 0.9, repetition_penalty 1.1": SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1),
    "top_p 0.9, frequency_penalty 0.5": SamplingParams(temperature=0.8, top_p=0.9, frequency_penalty=0.5),
}


def time_sampler(path: str, logits: torch.Tensor, params: SamplingParams, steps: int) -> float:
    os.environ["LLMBUS_CPU_SAMPLER"] = path  # read when a Sampler is made
    sampler = Sampler(seed=0)
    # 256 prompt and 100 output tokens each (what the penalties read)
    seqs = [Sequence(request_id=str(i), prompt_token_ids=list(range(i, i + 256)), params=params,
                     output_token_ids=list(range(1000 + i, 1100 + i))) for i in range(logits.shape[0])]  # fmt: skip
    sampler(logits, seqs)  # warm
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        sampler(logits, seqs)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    rows = []
    for name, params in SETTINGS.items():
        t_torch = time_sampler("torch", logits, params, args.steps)
        t_native = time_sampler("native", logits, params, args.steps)
        rows.append({"setting": name, "torch_ms": round(t_torch, 3), "native_ms": round(t_native, 3)})
        print(f"{name:36s} torch {t_torch:7.3f} ms   C {t_native:7.3f} ms   ({t_native / t_torch:.2f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps({"batch": args.batch, "vocab": args.vocab, "threads": args.threads,
                                              "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

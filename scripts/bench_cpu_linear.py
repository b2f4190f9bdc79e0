"""All of a model's projections, one decode step's worth: oneDNN's packed GEMM against our blocked kernel
(and, for bf16 on a CPU with AMX, the blocked weight on AMX's tiles: ``cpu_native.linear_amx``).

Where oneDNN has no packed layout for the dtype (bf16 on a CPU without its bf16 support) the
baseline is ``F.linear`` over the plain weights, which is what a model runs there unpacked.

The shapes of ``--demo`` (default: large) demo model's layers (fused q/k/v, o, fused gate/up, down)
and its lm_head, random weights in ``--dtype`` (bfloat16 or float32), both layouts built in one process; each repetition runs every
product once per layout, alternating, with fresh inputs of ``--rows`` rows; the median of
``--reps`` is reported in ms and as the weights' bytes per second.

    python scripts/bench_cpu_linear.py [--demo large] [--dtype bfloat16|float32] [--rows 1,4,32] [--threads 1]
        [--reps 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmbus.kernels import cpu_native  # noqa: E402
from llmbus.model import cpu_linear  # noqa: E402
from llmbus.model.demo import DEMO_SIZES  # noqa: E402


def shapes(size: str) -> list[tuple[int, int]]:
    c = DEMO_SIZES[size]
    h, i = c["hidden_size"], c["intermediate_size"]
    head = h // c["num_attention_heads"]
    qkv = h + 2 * c["num_key_value_heads"] * head
    return [(qkv, h), (h, h), (2 * i, h), (h, i)] * c["num_hidden_layers"] + [(c["vocab_size"], h)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", default="large", choices=tuple(DEMO_SIZES))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rows", default="1,4,32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not cpu_native.has_linear(dtype):
        print(f"this CPU (or build) has no blocked {args.dtype} kernel (it needs AVX-512, or AVX2 with FMA)")
        return 1
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).to(dtype) for n, k in shapes(args.demo)]
    total = sum(w.numel() * w.element_size() for w in weights)
    in_features = [w.shape[1] for w in weights]
    base = "onednn" if cpu_linear._onednn_supported(dtype, torch.device("cpu")) else "plain"
    baseline = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights] if base == "onednn" else weights
    blocked = [cpu_native.to_blocked(w) for w in weights]
    del weights

    def step(kind: str, rows: int) -> float:
        xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in set(in_features)}
        t = time.perf_counter()
        for p, b, k in zip(baseline, blocked, in_features):
            x = xs[k]
            if kind == "onednn":
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            elif kind == "plain":
                F.linear(x, p)
            elif kind == "amx":
                cpu_native.linear_amx(x, b, None)
            else:
                cpu_native.linear(x, b, None)
        return time.perf_counter() - t

    result = {"demo": args.demo, "dtype": args.dtype, "threads": args.threads, "weight_bytes": total, "baseline": base,
              "rows": {}}
    print(f"{args.demo} demo model, {args.dtype}, {total / 1e6:.0f} MB of projections, {args.threads} thread(s), "
          f"median of {args.reps}")
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {base: [], "blocked": []}
        if dtype == torch.bfloat16 and cpu_native.has_amx_bf16():
            times["amx"] = []
        for _ in range(args.reps):
            for kind in times:
                times[kind].append(step(kind, rows))
        med = {k: statistics.median(v) for k, v in times.items()}
        result["rows"][rows] = {k: 1e3 * v for k, v in med.items()}
        name = {"onednn": "oneDNN", "plain": "F.linear (plain)"}[base]
        print(f"rows {rows:5d}: {name} {1e3 * med[base]:7.2f} ms ({total / med[base] / 1e9:5.1f} GB/s), "
              f"blocked {1e3 * med['blocked']:7.2f} ms ({total / med['blocked'] / 1e9:5.1f} GB/s), "
              f"{med['blocked'] / med[base]:.2f}x" + (f", AMX tiles {1e3 * med['amx']:7.2f} ms "
                                                      f"({total / med['amx'] / 1e9:5.1f} GB/s)" if "amx" in med else ""),
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

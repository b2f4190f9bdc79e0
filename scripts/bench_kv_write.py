"""Time of the CPU KV write (``reference.write_kv_cache``'s job) per KV format: the C kernels in
``llmbus/kernels/cpu_decode.c`` beside the pure-torch reference, on one layer's cache.

A prefill's write: ``--tokens`` new tokens (default 4,096: four 1,024-token prompts) in slot
order, so every full block is sealed (INT4's keys quantized per channel) and the last one is left
filling; the large demo model's attention shape by default (4 KV heads, head_dim 64, bf16,
16-token blocks). Reports each path's median over ``--runs`` calls, in ms a layer.

    python scripts/bench_kv_write.py [--formats int8,int4,int4r] [--tokens 4096] [--kv-heads 4]
        [--head-dim 64] [--runs 9] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_write(write, runs: int) -> float:
    """Median wall time of ``write()`` over ``runs`` calls (one untimed call first), in ms."""
    write()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        write()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    import torch

    from llmbus.kernels import cpu_native, reference
    from llmbus.kernels.kv_cache import allocate_cache
    from llmbus.kv.formats import parse_kv_format
    from llmbus.kv.layout import KVLayout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8,int4,int4r")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not cpu_native.available():
        sys.exit("error: the C kernels did not build here (a C compiler is needed; LLMBUS_CPU_NATIVE unset)")
    lay = KVLayout(num_layers=1, num_kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                   dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(args.tokens, args.kv_heads, args.head_dim, generator=g).bfloat16() for _ in range(2))
    slots = torch.arange(args.tokens)
    rows = []
    for name in args.formats.split(","):
        fmt = parse_kv_format(name)
        blocks = args.tokens // args.block_size + 2
        cache = allocate_cache(fmt, lay, blocks, "cpu")
        native = cpu_native.write_int8 if name == "int8" else cpu_native.write_int4
        if not native(k, v, cache, slots):
            sys.exit(f"error: the C write does not take {name} at this shape")
        c_ms = time_write(lambda: native(k, v, cache, slots), args.runs)
        ref_ms = time_write(lambda: reference.write_kv_cache(k, v, cache, slots), max(1, args.runs // 3))
        rows.append({"format": name, "c_ms": round(c_ms, 3), "torch_ms": round(ref_ms, 3)})
        print(f"{name:6s} C {c_ms:8.2f} ms   torch reference {ref_ms:8.2f} ms   ({ref_ms / c_ms:.1f}x)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

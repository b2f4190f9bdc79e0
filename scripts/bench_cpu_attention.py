"""Time of the C decode attention kernel alone, for one decode step of the large demo model's shape.

Twelve layers (one call each) of a batch of sequences of ~300 tokens on a bf16 paged cache,
large-model heads (12 query heads over 4 KV heads of 64 channels), 16-token blocks scattered at
random. ``--cold``: every layer has its own cache, ~120 MB read per step against a 32 MB L3, as
in the engine; ``--hot``: the twelve layers share one cache (it stays in L3), which leaves the
kernel's own work. Prints the median of ``--steps`` steps. ``--kv-format int4|int4r`` times
``cpu_native.paged_decode_int4`` (its Python checks and table preparation included, a few tens of
microseconds a call), on caches the C write filled.

    python scripts/bench_cpu_attention.py [--cold | --hot] [--batch 32] [--steps 15] [--kv-format model|int8|int4|int4r]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cold", dest="hot", action="store_false", help="a cache per layer (default)")
    mode.add_argument("--hot", dest="hot", action="store_true", help="one cache shared by the layers")
    ap.set_defaults(hot=False)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=280)
    ap.add_argument("--max-len", type=int, default=330)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--kv-format", default="model", choices=("model", "int8", "int4", "int4r"),
                    help="int8: int8 codes with fp16 scales per token and head (half the bytes); int4, int4r: "
                         "a PagedKVCache of that format written by the C write (the bytes llmbus.kv.formats gives)")
    args = ap.parse_args(argv)

    import torch

    from llmbus.kernels import cpu_native

    if not cpu_native.available():
        print("the C kernels are not available on this machine", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    layers, hkv, g, d, bs = 12, 4, 3, 64, 16
    per_seq = args.max_len // bs + 1
    blocks = max(args.batch * per_seq, 2400)
    lens = torch.randint(args.min_len, args.max_len, (args.batch,), dtype=torch.int32)
    tables = torch.randperm(blocks)[: args.batch * per_seq].view(args.batch, per_seq).to(torch.int32)
    q = torch.randn(args.batch, hkv * g, d).to(torch.bfloat16)
    int8, int4 = args.kv_format == "int8", args.kv_format.startswith("int4")

    def make_cache():
        if int4:
            from llmbus.kernels.kv_cache import allocate_cache
            from llmbus.kv.formats import parse_kv_format
            from llmbus.kv.layout import KVLayout

            lay = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype="bfloat16")
            cache = allocate_cache(parse_kv_format(args.kv_format), lay, blocks, "cpu")
            k, v = (torch.randn(blocks * bs, hkv, d).to(torch.bfloat16) for _ in range(2))
            assert cpu_native.write_int4(k, v, cache, torch.arange(blocks * bs))  # every block sealed
            return cache, None
        if not int8:
            return torch.randn(2, blocks, bs, hkv, d).to(torch.bfloat16), None
        return (torch.randint(-127, 128, (2, blocks, bs, hkv, d), dtype=torch.int8),
                (torch.rand(2, blocks, bs, hkv) / 64).to(torch.float16))

    caches = [make_cache() for _ in range(1 if args.hot else layers)]
    caches = caches * (layers if args.hot else 1)
    out = torch.empty_like(q)

    def step() -> float:
        t = time.perf_counter()
        for cache, scales in caches:
            if int4:
                cpu_native.paged_decode_int4(q, cache, tables, lens, d**-0.5)
            elif int8:
                cpu_native.decode_int8_into(out, q, cache, scales, tables, lens, d**-0.5)
            else:
                cpu_native.decode_into(out, q, cache, tables, lens, d**-0.5)
        return time.perf_counter() - t

    for _ in range(3):
        step()
    median = statistics.median(step() for _ in range(args.steps))
    token_bytes = caches[0][0].fmt.bytes_per_token(caches[0][0].layout) if int4 else hkv * 2 * (d + 2 if int8 else d * 2)
    kv_mb = layers * int(lens.sum()) * token_bytes / 1e6
    print(f"{args.kv_format} {'hot' if args.hot else 'cold'}: {layers} layers, batch {args.batch}: median {1000 * median:.2f} ms "
          f"({kv_mb:.0f} MB of K/V, {kv_mb / 1e3 / median:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

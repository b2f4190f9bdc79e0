"""GPU check and benchmark of the Triton KV kernels (needs CUDA).

1. Checks every kernel (write_kv, paged decode with and without split-K, paged prefill) against
   its pure-torch reference natively, for bf16, int8 and int4 KV: prints PASS/FAIL and max errors.
2. Measures paged decode attention's achieved memory bandwidth (KV bytes read, metadata included,
   over kernel time from ``triton.testing.do_bench``) across batch sizes and context lengths, one
   layer of a Llama-3-8B-shaped model (32 query heads, 8 KV heads, head_dim 128, 16-token blocks,
   blocks in a random order). Prints a markdown table and writes JSON to ``--out``.

    python scripts/bench_gpu.py --out bench-results/gpu.json [--peak-gbps 4800] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import reference as ref  # noqa: E402
from kernels.kv_cache import allocate_cache  # noqa: E402
from kernels.paged_decode import paged_decode_attention  # noqa: E402
from kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from kernels.write_kv import write_kv  # noqa: E402
from llmbus.kv.formats import KVFormat  # noqa: E402
from llmbus.kv.layout import KVLayout  # noqa: E402

PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0}
FORMATS = ("model", "int8", "int4")
HQ, HKV, D, BS = 32, 8, 128, 16


def peak_for(name: str) -> float | None:
    for key, val in PEAK_GBPS.items():
        if key in name:
            return val
    return None


def _filled(fmt: str, lay: KVLayout, lens: list[int], gen: torch.Generator):
    nblocks = sum(lay.num_blocks_for(n) for n in lens) + 1
    cache = allocate_cache(KVFormat(fmt), lay, nblocks, "cuda")
    perm = torch.randperm(nblocks, generator=gen).tolist()
    width = max(lay.num_blocks_for(n) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    slots = []
    for i, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(lay.num_blocks_for(n))]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += lay.slot_mapping(blocks, 0, n)
    t = len(slots)
    k = (torch.randn(t, HKV, D, device="cuda") + 0.5).bfloat16()
    v = torch.randn(t, HKV, D, device="cuda").bfloat16()
    return cache, tables.cuda(), torch.tensor(slots, device="cuda"), k, v


def check_kernels() -> list[dict]:
    """Every kernel against its reference on this GPU."""
    gen = torch.Generator().manual_seed(0)
    lay = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype="bfloat16")
    lens = [1, 17, 300, 1029]
    rows = []
    for fmt in FORMATS:
        mine, tables, slots, k, v = _filled(fmt, lay, lens, gen)
        theirs = allocate_cache(KVFormat(fmt), lay, mine.num_blocks, "cuda")
        write_kv(k, v, mine, slots)
        ref.write_kv_cache(k, v, theirs, slots)
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        nb = tables.shape[1]
        used = (torch.arange(nb, device="cuda") * BS < sl[:, None]).reshape(-1)
        full = ((torch.arange(nb, device="cuda") + 1) * BS <= sl[:, None]).reshape(-1)[used]
        ids = tables.reshape(-1)[used]
        err = (ref.dequantize_blocks(mine, ids, full) - ref.dequantize_blocks(theirs, ids, full)).abs()
        # GPU fp32 division is not correctly rounded, so a tie may land one quantization step away
        tol = {"model": 0.0, "int8": 0.1, "int4": 0.6}[fmt]
        rows.append(dict(kernel="write_kv", fmt=fmt, max_err=float(err.max()), tol=tol))
        q = torch.randn(len(lens), HQ, D, device="cuda").bfloat16()
        want = ref.paged_decode_attention_cache(q, theirs, tables, sl, D**-0.5).float()
        for splits in (1, None):
            got = paged_decode_attention(q, theirs, tables, sl, D**-0.5, num_splits=splits).float()
            name = "paged_decode" + (" split-K" if splits is None else "")
            rows.append(dict(kernel=name, fmt=fmt, max_err=float((got - want).abs().max()), tol=4e-2))
        qlens = [1, 17, 100, 333]
        qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        qp = torch.randn(int(qsl[-1]), HQ, D, device="cuda").bfloat16()
        want = ref.paged_prefill_attention_cache(qp, theirs, tables, sl, qsl, D**-0.5).float()
        got = paged_prefill_attention(qp, theirs, tables, sl, qsl, D**-0.5).float()
        rows.append(dict(kernel="paged_prefill", fmt=fmt, max_err=float((got - want).abs().max()), tol=4e-2))
    for r in rows:
        r["ok"] = r["max_err"] <= r["tol"]
        print(f"{'PASS' if r['ok'] else 'FAIL'} {r['kernel']:<20} {r['fmt']:<6} max_err={r['max_err']:.3g} (tol {r['tol']})")
    return rows


def bench_decode(batches, contexts, peak: float | None) -> list[dict]:
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(1)
    lay = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype="bfloat16")
    rows = []
    for fmt in FORMATS:
        kvf = KVFormat(fmt)
        per_token = kvf.layer_block_bytes(lay) / BS
        max_tokens = max(b * c for b in batches for c in contexts)
        nblocks = max_tokens // BS + 1
        cache = allocate_cache(kvf, lay, nblocks, "cuda")
        for t, _ in cache.parts():  # random bytes: bandwidth does not depend on the values
            if t.dtype == torch.bfloat16:
                t.normal_()
            else:
                t.view(torch.uint8).random_(0, 256)
        if cache.k_meta is not None:
            cache.k_meta[..., -2:] = torch.tensor([-1.0, 1.0], dtype=torch.float16, device="cuda").view(torch.int16)
            cache.v_meta.fill_(0.01)
        if cache.scale is not None:
            cache.scale.fill_(0.01)
        perm = torch.randperm(nblocks - 1, generator=gen).to(torch.int32).cuda()
        for b in batches:
            for c in contexts:
                width = c // BS
                tables = perm[: b * width].view(b, width)
                sl = torch.full((b,), c, dtype=torch.int32, device="cuda")
                q = torch.randn(b, HQ, D, device="cuda").bfloat16()
                fn = lambda: paged_decode_attention(q, cache, tables, sl, D**-0.5, max_seq_len=c)  # noqa: E731
                ms = do_bench(fn, warmup=10, rep=40)
                gbps = b * c * per_token / (ms * 1e-3) / 1e9
                row = dict(fmt=fmt, batch=b, context=c, ms=ms, gbps=gbps, pct_peak=(100 * gbps / peak) if peak else None)
                rows.append(row)
                print(f"  {fmt:<6} batch={b:<4} ctx={c:<6} {ms:8.3f} ms {gbps:8.0f} GB/s", flush=True)
        del cache
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], peak: float | None) -> str:
    out = ["| KV format | batch | context | time (ms) | GB/s | % of peak |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        pct = f"{r['pct_peak']:.0f}%" if r["pct_peak"] is not None else "n/a"
        out.append(f"| {r['fmt']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['gbps']:.0f} | {pct} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results path")
    ap.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth (GB/s)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: error: needs a CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_for(name)
    print(f"device: {name}, peak {peak} GB/s, torch {torch.__version__}")
    t0 = time.time()
    checks = check_kernels()
    print(f"checks took {time.time() - t0:.1f} s", flush=True)
    batches = [1, 16, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    contexts = [512, 4096, 32768] if args.quick else [512, 2048, 8192, 32768]
    rows = bench_decode(batches, contexts, peak)
    print(markdown(rows, peak))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=name, peak_gbps=peak, checks=checks, decode=rows), indent=1))
    print(f"total {time.time() - t0:.1f} s; wrote {args.out}")
    return 0 if all(r["ok"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

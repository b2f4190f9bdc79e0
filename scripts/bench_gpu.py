"""GPU check and benchmark of the Triton KV kernels (needs CUDA).

1. Checks every kernel (write_kv, paged decode with and without split-K, paged prefill) against
   its pure-torch reference natively, for bf16, int8, int4 and int4r KV: prints PASS/FAIL and max
   errors (with ``--sweep``, decode under every launch the sweep times too).
2. Sweeps the decode launch (tile, warps, stages, register cap) at a large shape (``--sweep``:
   batch 64 x 8,192; ``--sweep-at B,C``, repeatable, names the shapes, the first choosing).
3. Measures paged decode attention's achieved memory bandwidth (bytes the kernel must read: codes
   and the metadata of full blocks, over kernel time from ``triton.testing.do_bench``) across batch
   sizes and context lengths, one layer of a Llama-3-8B-shaped model (32 query heads, 8 KV heads,
   head_dim 128, 16-token blocks, blocks in a random order), with the launch defaults, or with the
   sweep's best launch where ``--sweep`` ran. Prints a markdown table and writes JSON to ``--out``.

    python scripts/bench_gpu.py --out bench-results/gpu.json [--peak-gbps 4800] [--quick] [--sweep]
        [--sweep-at 64,8192 --sweep-at 256,32768]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmbus.kernels import reference as ref  # noqa: E402
from llmbus.kernels import backends, paged_decode  # noqa: E402
from llmbus.kernels.kv_cache import allocate_cache  # noqa: E402
from llmbus.kernels.paged_decode import paged_decode_attention  # noqa: E402
from llmbus.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from llmbus.kernels.write_kv import write_kv  # noqa: E402
from llmbus.kv.formats import KVFormat  # noqa: E402
from llmbus.kv.layout import KVLayout  # noqa: E402

PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0}
FORMATS = ("model", "int8", "int4", "int4r")
# GPU fp32 division is not correctly rounded, so a tie may land one quantization step away
WRITE_TOL = {"model": 0.0, "int8": 0.1, "int4": 0.6, "int4r": 0.6}
HQ, HKV, D, BS = 32, 8, 128, 16
# where it runs, and the checks' sequence and chunk lengths and long split: a test runs the script's
# checks on CPU under the Triton interpreter at small sizes (tests/test_bench_gpu_sweep.py)
DEVICE = "cuda"
LENS, QLENS, LONG = [1, 17, 300, 1029], [1, 17, 100, 333], 32768 + 5
# --compile-only: every launch runs once, untimed, so that several processes (one per format, in
# parallel: scripts/gpu_check.sh) fill Triton's cache on disk before the one that times
COMPILE_ONLY = False


def peak_for(name: str) -> float | None:
    for key, val in PEAK_GBPS.items():
        if key in name:
            return val
    return None


# (tile, num_warps, num_stages, max registers per thread, 0: no cap) tried by --sweep; the first of
# each is the launch default (llmbus.kernels.paged_decode.CUDA_LAUNCH). The quantized loops keep
# num_stages - 1 tiles of codes in flight (decode_tiles.next_blocks): 2 stages is one tile, as
# every launch had before 2026-11-30 (night), so those rows compare the two. The formats run in
# this order: the ones never timed as they are first, so a run cut short by its time limit keeps them.
SWEEP = {
    # int4r (not yet run on a GPU): its per-warp loop (paged_decode.WARP_TILES), tokens down the dots'
    # rows. Bounds under Triton 3.6 (the H200's; kernel_cost.py): 195% (default: 64-token tiles, 2
    # warps, cap 128, 16 warps an SM), 223% (128, 2 warps, 12 warps an SM), 223% (256, 4, 168, 12),
    # 193% (128, 4, 168, 12); the shared loop's rows (below) 130-169%
    "int4r": [(64, 2, 3, 128), (128, 2, 3, 128), (256, 4, 3, 168), (128, 4, 3, 168)],
    # int8 (not yet run on a GPU as it is): its per-warp loop (paged_decode.WARP_TILES). Bounds under
    # Triton 3.6 (kernel_cost.py): 240% (default: 64-token tiles, 2 warps, cap 168, 12 warps an SM),
    # 241% (128, 4, 168), 226% (64, 2, 128: spills in its loop); the shared loop's rows (below): 183%
    # at its old default (128, 4, 3, 128), measured 66-72% (2026-11-30)
    "int8": [(64, 2, 3, 168), (128, 4, 3, 168), (64, 2, 3, 128), (64, 2, 2, 168)],
    # int4 (not yet run on a GPU as it is): its loop with a softmax per block slot
    # (decode_tiles.int4_blocks_warp_loop). Bounds under Triton 3.6 (kernel_cost.py): 102% (default:
    # 64-token tiles, 2 warps, uncapped: 252 registers, 8 warps an SM), 86% (64, 4), 98% (64, 2, cap
    # 192), 101% (128, 4); its lane loop's rows (below) 76%, measured 29% (2026-11-30)
    # Measured 2026-12-04 (token-major, 256 x 32,768): 2,086 GB/s at the default, 1,448 at (64, 4),
    # 1,743 capped at 192, 1,589 at (128, 4). At 8 warps an SM the default hides memory latency
    # with few warps: 4 stages (three tiles of codes in flight, 24 KB a program) may pay.
    "int4": [(64, 2, 3, 0), (64, 2, 4, 0), (64, 4, 3, 0), (64, 2, 3, 192), (128, 4, 3, 0)],
    "model": [(64, 4, 3, 0)],
}

# the shared loops' launches (paged_decode.WARP_TILES off; the first their default, SHARED_LAUNCH),
# timed beside the per-warp loops
SHARED_SWEEP = {"int8": [(128, 4, 3, 128), (128, 4, 3, 168), (64, 2, 3, 0)],
                "int4r": [(128, 4, 3, 128), (128, 4, 3, 168), (128, 2, 3, 0)],
                "int4": [(64, 4, 3, 128), (64, 4, 3, 168), (128, 4, 3, 168)]}

# other block sizes than BS, checked and timed at the default launch: INT4's block loop does a
# fixed share of its work per block (the key ranges, the scaled queries, the minima term), half as
# much a byte at 32-token blocks (kernel_cost.py --block-size 32: bound 127%, 102% at 16)
BLOCK_SWEEP = {"int4": [32]}


def read_bytes_per_token(fmt: str, lay: KVLayout) -> float:
    """Bytes decode reads per context token and layer: codes plus metadata (INT4 full blocks read
    ``D + 2`` key-metadata slots per head, not the whole ``k_meta`` row)."""
    kvf = KVFormat(fmt)
    if fmt != "int4":
        return kvf.layer_block_bytes(lay) / lay.block_size
    h, d, bs = lay.num_kv_heads, lay.head_dim, lay.block_size
    per_block = 2 * bs * h * d // 2 + h * (d + 2) * 2 + bs * h * (d // KVFormat.value_group(d)) * 4
    return per_block / bs


def _filled(fmt: str, lay: KVLayout, lens: list[int], gen: torch.Generator):
    """Sequences of ``lens`` tokens on shuffled blocks: an empty cache for a kernel to write
    (``mine``), the same cache written by the reference (``theirs``), the block tables, the lengths,
    the slots, and the keys and values written. Both caches are stored as the engine stores them
    on ``DEVICE`` (``backends.head_major``)."""
    nblocks = sum(lay.num_blocks_for(n) for n in lens) + 1
    head_major = backends.head_major(DEVICE)
    cache = allocate_cache(KVFormat(fmt), lay, nblocks, DEVICE, head_major=head_major)
    perm = torch.randperm(nblocks, generator=gen).tolist()
    width = max(lay.num_blocks_for(n) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    slots = []
    for i, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(lay.num_blocks_for(n))]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += lay.slot_mapping(blocks, 0, n)
    t = len(slots)
    k = (torch.randn(t, HKV, D, device=DEVICE) + 0.5).bfloat16()
    v = torch.randn(t, HKV, D, device=DEVICE).bfloat16()
    slots = torch.tensor(slots, device=DEVICE)
    theirs = allocate_cache(KVFormat(fmt), lay, nblocks, DEVICE, head_major=head_major)
    ref.write_kv_cache(k, v, theirs, slots)
    return cache, theirs, tables.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), slots, k, v


def _measure(rows: list[dict], kernel: str, fmt: str, tol: float, fn) -> None:
    """Append ``fn()``'s max error as a row; an exception (a compile error, say) is a FAIL row."""
    try:
        rows.append(dict(kernel=kernel, fmt=fmt, max_err=float(fn()), tol=tol))
    except Exception as exc:  # noqa: BLE001 - report and go on to the next kernel
        rows.append(dict(kernel=kernel, fmt=fmt, max_err=float("inf"), tol=tol, error=f"{type(exc).__name__}: {exc}"[:300]))


def check_kernels(sweep: bool = True, formats: tuple[str, ...] = FORMATS) -> list[dict]:
    """Every kernel against its reference on this GPU: decode at its default launch, INT8's and
    INT4R's per-warp loops at GQA groups of 1, 2 and 8 too, and (``sweep``: the launches the sweep
    times) under every SWEEP launch, the shared loops, and long splits with the codes unbiased.
    Without ``sweep`` it compiles about half the variants (``make bench-gpu``'s time limit)."""
    gen = torch.Generator().manual_seed(0)
    lay = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype="bfloat16")
    lens = LENS
    rows = []
    for fmt in formats:
        mine, theirs, tables, sl, slots, k, v = _filled(fmt, lay, lens, gen)
        ids, full = _blocks_of(tables, sl, BS)
        _measure(rows, "write_kv", fmt, WRITE_TOL[fmt], lambda: _write_err(k, v, mine, theirs, slots, ids, full))
        q = torch.randn(len(lens), HQ, D, device=DEVICE).bfloat16()
        want = ref.paged_decode_attention_cache(q, theirs, tables, sl, D**-0.5).float()
        launches = [(None, {})] + [(1, dict(tile=t, num_warps=w, num_stages=st, max_registers=r))
                                   for t, w, st, r in (SWEEP[fmt][1:] if sweep else ())]
        checks = launches + [(1, {}), (1, dict(heads_first=not paged_decode.HEADS_FIRST))]
        if sweep and fmt in SHARED_SWEEP:  # the other loop at its own default launch (launch_defaults) and at 64 / 2
            checks += [(None, dict(warp_tiles=not paged_decode.WARP_TILES)),
                       (None, dict(warp_tiles=not paged_decode.WARP_TILES, tile=64, num_warps=2))]
        for splits, launch in checks:
            name = "paged_decode" + (" split-K" if splits is None else "") + (" " + "/".join(map(str, launch.values())) if launch else "")
            if "heads_first" in launch:
                name = "paged_decode " + ("heads-first" if launch["heads_first"] else "seq-first")
            if "warp_tiles" in launch:
                name = ("paged_decode split-K " + ("warp-tiles" if launch["warp_tiles"] else "shared tiles")
                        + (f" {launch['tile']}/{launch['num_warps']}" if "tile" in launch else ""))
            _measure(rows, name, fmt, 4e-2, lambda: (paged_decode_attention(
                q, theirs, tables, sl, D**-0.5, num_splits=splits, **launch).float() - want).abs().max())
        # the per-warp loops' query rows are the dots' columns: groups of 1, 2 and 8 (bf16 too)
        if fmt in SHARED_SWEEP or fmt == "model":
            for g in (1, 2, 8):
                qg = torch.randn(len(lens), HKV * g, D, device=DEVICE).bfloat16()
                want_g = ref.paged_decode_attention_cache(qg, theirs, tables, sl, D**-0.5).float()
                _measure(rows, f"paged_decode split-K group {g}", fmt, 4e-2, lambda qg=qg, want_g=want_g: (
                    paged_decode_attention(qg, theirs, tables, sl, D**-0.5).float() - want_g).abs().max())
        # the same blocks stored the other way (kv_cache.allocate_cache; head-major on CUDA, where
        # the checks above ran over token-major ones, and the other way round): written by the kernel
        # (as mine was), and decoded
        other, other_name = _other_storage()
        other_mine, other_theirs = (allocate_cache(KVFormat(fmt), lay, mine.num_blocks, DEVICE, head_major=other)
                                    for _ in range(2))
        ref.write_kv_cache(k, v, other_theirs, slots)
        _measure(rows, f"write_kv {other_name}", fmt, WRITE_TOL[fmt],
                 lambda: _write_err(k, v, other_mine, theirs, slots, ids, full))
        _measure(rows, f"paged_decode {other_name}", fmt, 4e-2, lambda: (paged_decode_attention(
            q, other_theirs, tables, sl, D**-0.5).float() - want).abs().max())
        qlens = QLENS
        qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        qp = torch.randn(int(qsl[-1]), HQ, D, device=DEVICE).bfloat16()
        want_p = ref.paged_prefill_attention_cache(qp, theirs, tables, sl, qsl, D**-0.5).float()
        _measure(rows, "paged_prefill", fmt, 4e-2, lambda: (paged_prefill_attention(
            qp, theirs, tables, sl, qsl, D**-0.5).float() - want_p).abs().max())
        _measure(rows, f"paged_prefill {other_name}", fmt, 4e-2, lambda: (paged_prefill_attention(
            qp, other_theirs, tables, sl, qsl, D**-0.5).float() - want_p).abs().max())
        # one query head a KV head (no GQA): INT4's decode went wrong natively there (2026-12-04)
        qp1 = torch.randn(int(qsl[-1]), HKV, D, device=DEVICE).bfloat16()
        want_p1 = ref.paged_prefill_attention_cache(qp1, theirs, tables, sl, qsl, D**-0.5).float()
        _measure(rows, "paged_prefill group 1", fmt, 4e-2, lambda: (paged_prefill_attention(
            qp1, theirs, tables, sl, qsl, D**-0.5).float() - want_p1).abs().max())
        # the chunks' own keys and values as computed (the engine's call): each sequence's last rows
        ends = torch.tensor(lens).cumsum(0).tolist()
        chunk = tuple(torch.cat([x[e - ql : e] for e, ql in zip(ends, qlens)]) for x in (k, v))
        want_x = ref.paged_prefill_attention_cache(qp, theirs, tables, sl, qsl, D**-0.5, chunk=chunk).float()
        _measure(rows, "paged_prefill exact chunk", fmt, 4e-2, lambda: (paged_prefill_attention(
            qp, theirs, tables, sl, qsl, D**-0.5, chunk=chunk).float() - want_x).abs().max())
    for fmt, sizes in [(f, n) for f, n in BLOCK_SWEEP.items() if f in formats] if sweep else ():  # written by the kernel, decoded at the default launch
        for bs in sizes:
            lay_b = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=bs, dtype="bfloat16")
            mine, theirs, tables, sl, slots, k, v = _filled(fmt, lay_b, lens, gen)
            ids, full = _blocks_of(tables, sl, bs)
            _measure(rows, f"write_kv {bs}-token blocks", fmt, WRITE_TOL[fmt],
                     lambda: _write_err(k, v, mine, theirs, slots, ids, full))
            q = torch.randn(len(lens), HQ, D, device=DEVICE).bfloat16()
            want = ref.paged_decode_attention_cache(q, theirs, tables, sl, D**-0.5).float()
            _measure(rows, f"paged_decode split-K {bs}-token blocks", fmt, 4e-2, lambda: (paged_decode_attention(
                q, mine, tables, sl, D**-0.5).float() - want).abs().max())
    # one long split: fp16 dots take the codes biased (paged_decode.BIASED_VALUES), and tensor
    # cores truncate what they add, so a bias carried over many tiles would grow the error with the
    # split's length; flat softmax (zero queries: every token weighs alike) and random queries, the
    # exact conversion beside them
    n = LONG
    for fmt in [f for f in ("int8", "int4r", "int4") if f in formats]:
        _, long_cache, tables, sl, _, _, _ = _filled(fmt, lay, [n], gen)
        for qname, q in (("flat", torch.zeros(1, HQ, D, device=DEVICE).bfloat16()),
                         ("random", torch.randn(1, HQ, D, device=DEVICE).bfloat16())):
            want = ref.paged_decode_attention_cache(q, long_cache, tables, sl, D**-0.5).float()
            for bias in (paged_decode.BIASED_VALUES, False) if sweep else (paged_decode.BIASED_VALUES,):
                def long_err(q=q, want=want, bias=bias):
                    saved, paged_decode.BIASED_VALUES = paged_decode.BIASED_VALUES, bias
                    try:
                        got = paged_decode_attention(q, long_cache, tables, sl, D**-0.5, num_splits=1).float()
                    finally:
                        paged_decode.BIASED_VALUES = saved
                    return (got - want).abs().max()

                _measure(rows, f"paged_decode 32k 1 split {qname}{' unbiased' if bias is False else ''}", fmt, 4e-2,
                         long_err)
    for r in rows:
        r["ok"] = r["max_err"] <= r["tol"]
        extra = f" {r['error']}" if "error" in r else ""
        print(f"{'PASS' if r['ok'] else 'FAIL'} {r['kernel']:<28} {r['fmt']:<6} max_err={r['max_err']:.3g} (tol {r['tol']}){extra}")
    return rows


def _blocks_of(tables: torch.Tensor, sl: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of the blocks that sequences of ``sl`` tokens use in ``tables``, and which are full."""
    nb = tables.shape[1]
    used = (torch.arange(nb, device=DEVICE) * bs < sl[:, None]).reshape(-1)
    full = ((torch.arange(nb, device=DEVICE) + 1) * bs <= sl[:, None]).reshape(-1)[used]
    return tables.reshape(-1)[used], full


def _write_err(k, v, mine, theirs, slots, ids, full) -> torch.Tensor:
    """``write_kv`` into ``mine`` against the reference's write into ``theirs``: the largest
    difference of the blocks ``ids`` dequantized."""
    write_kv(k, v, mine, slots)
    return (ref.dequantize_blocks(mine, ids, full) - ref.dequantize_blocks(theirs, ids, full)).abs().max()


def _other_storage() -> tuple[bool, str]:
    """The storage the engine does not use on ``DEVICE`` (``backends.head_major``), checked and timed
    beside its own: whether head-major, and its name."""
    other = not backends.head_major(DEVICE)
    return other, "head-major" if other else "token-major"


def _random_cache(fmt: str, lay: KVLayout, nblocks: int, head_major: bool | None = None):
    """A cache of random codes, stored as the engine stores it on CUDA (``backends.head_major``)
    unless ``head_major`` says."""
    head_major = backends.head_major(DEVICE) if head_major is None else head_major
    cache = allocate_cache(KVFormat(fmt), lay, nblocks, DEVICE, head_major=head_major)
    for t, _ in cache.parts():  # random bytes: bandwidth does not depend on the values
        # NOTE: filled through its storage, which a head-major cache's permuted view cannot be viewed as bytes of
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
        if t.dtype == torch.bfloat16:
            flat.normal_()
        else:
            flat.view(torch.uint8).random_(0, 256)
    if cache.fmt.name == "int4r":  # every key per token: one (scale, min) pair each
        cache.k_meta.view(torch.float16).fill_(0.01)
        cache.v_meta.fill_(0.01)
    elif cache.k_meta is not None:
        cache.k_meta[..., -2:] = torch.tensor([-1.0, 1.0], dtype=torch.float16, device=DEVICE).view(torch.int16)
        cache.v_meta.fill_(0.01)
    if cache.scale is not None:
        cache.scale.fill_(0.01)
    return cache


def _time_decode(cache, perm, b: int, c: int, launch: dict) -> tuple[float, int]:
    """Median kernel time in ms (inf if the launch fails: reported, not raised) and the splits it ran with."""
    from triton.testing import do_bench

    def once(fn, **_):
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return 1.0

    try:
        return _do_time(once if COMPILE_ONLY else do_bench, cache, perm, b, c, launch)
    except Exception as exc:  # noqa: BLE001
        print(f"  ERROR {cache.fmt.name} {launch}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return float("inf"), 0


def _do_time(do_bench, cache, perm, b: int, c: int, launch: dict) -> tuple[float, int]:
    bs = cache.layout.block_size
    tables = perm[: b * (c // bs)].view(b, c // bs)
    sl = torch.full((b,), c, dtype=torch.int32, device=DEVICE)
    q = torch.randn(b, HQ, D, device=DEVICE).bfloat16()
    fn = lambda: paged_decode_attention(q, cache, tables, sl, D**-0.5, max_seq_len=c, **launch)  # noqa: E731
    splits = paged_decode.decode_launch(q, cache, tables, sl, max_seq_len=c, **launch).splits
    return do_bench(fn, warmup=10, rep=40, return_mode="median"), splits


def sweep_launch(peak: float | None, batch: int = 64, context: int = 8192,
                 formats: tuple[str, ...] = FORMATS) -> tuple[list[dict], dict]:
    """Every SWEEP launch of every format at one shape: rows, and the best launch per format."""
    gen = torch.Generator().manual_seed(2)
    lay = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype="bfloat16")
    nblocks = batch * context // BS + 1
    rows, best = [], {}
    for fmt, launches in ((f, ls) for f, ls in SWEEP.items() if f in formats):
        cache = _random_cache(fmt, lay, nblocks)
        perm = torch.randperm(nblocks - 1, generator=gen).to(torch.int32).to(DEVICE)
        # NOTE: the default launch once more with the plain-Triton code conversions (unless
        # LLMBUS_TRITON_ASM=0 asked for them throughout), once with the grid sequence-first, and
        # once in one split (at the sweep's shapes, what choose_splits picked before it counted
        # waves: LLMBUS_TRITON_WAVE_SPLITS=0), for comparison
        default_asm, order = paged_decode.ASM, paged_decode.HEADS_FIRST
        plain = paged_decode.WARP_TILES
        biased = paged_decode.BIASED_VALUES
        extra = [(launches[0], False, order, None, plain, biased)] if fmt != "model" and default_asm else []
        extra += [(launches[0], default_asm, not order, None, plain, biased),
                  (launches[0], default_asm, order, 1, plain, biased)]
        # the warps sharing a softmax (decode_tiles.int4_tokens_loop, int8_words_loop) at their best launches
        extra += [(lc, default_asm, order, None, not plain, biased) for lc in SHARED_SWEEP.get(fmt, ())]
        if fmt != "model":  # the default with its codes converted exactly (paged_decode.BIASED_VALUES)
            extra += [(launches[0], default_asm, order, None, plain, False)]
        rows_to_run = [(lc, default_asm, order, None, plain, biased) for lc in launches] + extra
        for (tile, warps, stages, regs), asm, heads_first, splits, warp_tiles, bias in rows_to_run:
            launch = dict(tile=tile, num_warps=warps, num_stages=stages, max_registers=regs, heads_first=heads_first,
                          num_splits=splits, warp_tiles=warp_tiles)
            paged_decode.ASM, paged_decode.BIASED_VALUES = asm, bias
            try:
                ms, ran = _time_decode(cache, perm, batch, context, launch)
            finally:
                paged_decode.ASM, paged_decode.BIASED_VALUES = default_asm, biased
            gbps = batch * context * read_bytes_per_token(fmt, lay) / (ms * 1e-3) / 1e9
            rows.append(dict(fmt=fmt, batch=batch, context=context, **launch, splits=ran, asm=asm, ms=ms, gbps=gbps,
                             pct_peak=(100 * gbps / peak) if peak else None, biased_values=bias))
            print(f"  sweep {batch}x{context} {fmt:<6} tile={tile:<4} warps={warps} stages={stages} regs={regs or '-':<3}"
                  f" splits={ran:<2}{'' if asm else ' no-asm'}{'' if heads_first else ' seq-first'}"
                  f"{'' if splits is None else ' forced'}{(' warp-tiles' if warp_tiles else ' shared-tiles') if fmt in SHARED_SWEEP else ''}"
                  f"{' unbiased' if bias is False and fmt != 'model' else ''}"
                  f" {ms:8.3f} ms {gbps:6.0f} GB/s", flush=True)
            if asm == default_asm and splits is None and bias == biased and (fmt not in best or gbps > best[fmt][1]):
                best[fmt] = ({k: v for k, v in launch.items() if k != "num_splits"}, gbps)
        del cache
        torch.cuda.empty_cache()
        # NOTE: the default launch once more over the other storage than the engine's
        # (backends.head_major; head-major: one head's rows of a block contiguous,
        # kv_cache.allocate_cache): does a program's run of bytes (64 B a token for INT4, 128 B for
        # INT8, 256 B for bf16 when token-major) cost bandwidth? Not a launch option, so never the
        # best launch.
        other, other_name = _other_storage()
        cache = _random_cache(fmt, lay, nblocks, head_major=other)
        launch = dict(zip(("tile", "num_warps", "num_stages", "max_registers"), launches[0]))
        extra = dict(heads_first=order, asm=default_asm)
        _time_default(rows, cache, perm, batch, context, launch, peak, f"{other_name} cache", **extra, head_major=other)
        del cache
        torch.cuda.empty_cache()
        for bs in BLOCK_SWEEP.get(fmt, ()):  # the default launch over blocks of another size
            lay_b = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=bs, dtype="bfloat16")
            nblocks_b = batch * context // bs + 1
            cache = _random_cache(fmt, lay_b, nblocks_b)
            perm_b = torch.randperm(nblocks_b - 1, generator=gen).to(torch.int32).to(DEVICE)
            _time_default(rows, cache, perm_b, batch, context, launch, peak, f"{bs}-token blocks", **extra, block_size=bs)
            del cache
            torch.cuda.empty_cache()
    return rows, {f: launch for f, (launch, _) in best.items()}


def _time_default(rows: list[dict], cache, perm, batch: int, context: int, launch: dict, peak: float | None,
                  label: str, **extra) -> None:
    """Time a format's default ``launch`` over ``cache`` (``label``, ``extra``: how the cache differs
    from the sweep's) and append the row."""
    ms, ran = _time_decode(cache, perm, batch, context, launch)
    fmt = cache.fmt.name
    gbps = batch * context * read_bytes_per_token(fmt, cache.layout) / (ms * 1e-3) / 1e9
    rows.append(dict(fmt=fmt, batch=batch, context=context, **launch, num_splits=None, splits=ran, **extra, ms=ms,
                     gbps=gbps, pct_peak=(100 * gbps / peak) if peak else None))
    print(f"  sweep {batch}x{context} {fmt:<6} default launch, {label} splits={ran:<2} "
          f"{ms:8.3f} ms {gbps:6.0f} GB/s", flush=True)


def every_best(fmt: str) -> list[dict]:
    """Every launch ``sweep_launch`` may choose as ``fmt``'s best: what --compile-only compiles the
    table's shapes under."""
    order, plain = paged_decode.HEADS_FIRST, paged_decode.WARP_TILES
    keys = ("tile", "num_warps", "num_stages", "max_registers")
    runs = [(lc, order, plain) for lc in SWEEP[fmt]] + [(lc, order, not plain) for lc in SHARED_SWEEP.get(fmt, ())]
    runs.append((SWEEP[fmt][0], not order, plain))  # the default launch, also timed in the other grid order
    return [dict(zip(keys, lc), heads_first=first, warp_tiles=wt) for lc, first, wt in runs]


def bench_decode(batches, contexts, peak: float | None, launches: dict | None = None,
                 formats: tuple[str, ...] = FORMATS) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    lay = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype="bfloat16")
    rows = []
    for fmt in formats:
        per_token = read_bytes_per_token(fmt, lay)
        launch = (launches or {}).get(fmt, {})
        max_tokens = max(b * c for b in batches for c in contexts)
        nblocks = max_tokens // BS + 1
        cache = _random_cache(fmt, lay, nblocks)
        perm = torch.randperm(nblocks - 1, generator=gen).to(torch.int32).to(DEVICE)
        for b in batches:
            for c in contexts:
                if COMPILE_ONLY and launches:  # the table's launch is not known yet: each it may be
                    for each in every_best(fmt):
                        _time_decode(cache, perm, b, c, each)
                ms, splits = _time_decode(cache, perm, b, c, launch)
                gbps = b * c * per_token / (ms * 1e-3) / 1e9
                row = dict(fmt=fmt, batch=b, context=c, ms=ms, gbps=gbps, pct_peak=(100 * gbps / peak) if peak else None,
                           launch=launch or "default", splits=splits, head_major=backends.head_major(DEVICE))
                rows.append(row)
                print(f"  {fmt:<6} batch={b:<4} ctx={c:<6} splits={splits:<2} {ms:8.3f} ms {gbps:8.0f} GB/s", flush=True)
        del cache
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], peak: float | None) -> str:
    out = ["| KV format | batch | context | splits | time (ms) | GB/s | % of peak |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pct = f"{r['pct_peak']:.0f}%" if r["pct_peak"] is not None else "n/a"
        out.append(f"| {r['fmt']} | {r['batch']} | {r['context']} | {r['splits']} | {r['ms']:.3f} | {r['gbps']:.0f} | {pct} |")
    return "\n".join(out)


def _shape(text: str) -> tuple[int, int]:
    """``BATCH,CONTEXT`` -> ints; the context a whole number of blocks (the sweep's tables)."""
    try:
        b, c = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCH,CONTEXT, got {text!r}") from None
    step = max([BS] + [n for sizes in BLOCK_SWEEP.values() for n in sizes])  # every block size the sweep reads
    if b < 1 or c < step or c % step:
        raise argparse.ArgumentTypeError(f"batch must be >= 1 and context a multiple of {step}, got {text!r}")
    return b, c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results path")
    ap.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth (GB/s)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="sweep quantized launches first; the table uses the best")
    ap.add_argument("--sweep-at", action="append", metavar="BATCH,CONTEXT", type=_shape,
                    help="sweep at this shape (repeatable; --sweep alone: 64,8192); the table uses the first's best")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma-separated KV formats to check and time (default {','.join(FORMATS)})")
    ap.add_argument("--compile-only", action="store_true",
                    help="run every launch once, untimed: fills Triton's cache for a timed run (in parallel, one format each)")
    args = ap.parse_args(argv)
    formats = tuple(f for f in args.formats.split(",") if f)
    if unknown := [f for f in formats if f not in FORMATS]:
        ap.error(f"unknown KV format(s) {unknown}; choose from {', '.join(FORMATS)}")
    global COMPILE_ONLY
    COMPILE_ONLY = args.compile_only
    if not torch.cuda.is_available():
        print("bench_gpu: error: needs a CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_for(name)
    print(f"device: {name}, peak {peak} GB/s, torch {torch.__version__}")
    t0 = time.time()
    result = dict(device=name, peak_gbps=peak, checks=[], sweep=[], best_launch=None, decode=[])
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        # NOTE: after every stage, so a run cut short by its time limit keeps what it measured; whole
        # (a temporary file renamed), so the cut never leaves half a file
        part = args.out.with_name(args.out.name + ".part")
        part.write_text(json.dumps(result, indent=1))
        os.replace(part, args.out)

    result["checks"] = checks = check_kernels(sweep=bool(args.sweep or args.sweep_at), formats=formats)
    save()
    print(f"checks took {time.time() - t0:.1f} s", flush=True)
    batches = [1, 16, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    contexts = [512, 4096, 32768] if args.quick else [512, 2048, 8192, 32768]
    best = None
    shapes = (args.sweep_at or [(64, 8192)]) if args.sweep or args.sweep_at else []
    for i, (b, c) in enumerate(shapes):
        rows_at, best_at = sweep_launch(peak, b, c, formats)
        result["sweep"] += rows_at
        best = result["best_launch"] = best if i else best_at
        save()
    if best:
        print(f"best launches: {best}")
    result["decode"] = rows = bench_decode(batches, contexts, peak, best, formats)
    save()
    print(markdown(rows, peak))
    print(f"total {time.time() - t0:.1f} s; wrote {args.out}")
    return 0 if all(r["ok"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

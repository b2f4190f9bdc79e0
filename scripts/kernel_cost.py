"""Static cost of paged decode attention's main loop on an NVIDIA GPU, computed without one.

Compiles the decode kernel for ``sm_<arch>`` (through ``scripts/compile_kernels.py``'s compile-only
driver) on the layer ``scripts/bench_gpu.py`` measures (Llama-3-8B-shaped: 32 query heads, 8 KV
heads, head_dim 128, 16-token blocks or ``--block-size``, bf16 queries), per KV format and launch; disassembles the cubin
with the ``nvdisasm`` Triton ships; finds the main loop (the longest backward branch) and counts its
instructions per execution pipe. Each pipe's count, at Hopper's issue rate for it, bounds the bytes
per clock the loop can consume; the report gives that bound as a % of the H200's peak (4,800 GB/s
over 132 SMs at 1.98 GHz: 18.4 bytes per SM per clock) and names the pipe that binds. The
``smem`` bound does the same for the bytes the loop moves through shared memory (and the L1 that
shares its SRAM: spills), at 128 bytes per SM per clock: cp.async's writes, operand loads, layout
conversions. "smem bytes / KV byte" is that traffic over the cache bytes the loop reads.

It is a bound from the instruction mix alone, not a measurement: memory latency, occupancy, and
stalls come on top. On the H200 (2026-11-30, Triton 3.6) INT4's loop before c99c4ae measured 29%
against an smem bound of 53% and an issue bound of 73% (launches at 16 warps an SM measured about half their smem bound,
at 8 warps about 0.4); INT8, bound at 178%, measured 72%; the model dtype, at 221%, 92%. Use it
to compare formulations of a kernel between GPU sessions, and confirm on a GPU (``bench_gpu.py``).
``buffers`` lists the shared-memory buffer counts of the loop's pipelined loads (two: a tile in
flight while another is used). ``spills`` is the stack frame's bytes (where ptxas puts registers that do not fit a cap); the
loop's own ``LDL``/``STL`` count in ``ops``.

``--kernel prefill`` costs the prefill kernel's main loop instead (its bound is per program: every
query block of a sequence reads the same tiles, so it is no bandwidth figure).

``--lines`` counts the loop's instructions per source line (nvdisasm's line table): which lines of
``llmbus/kernels/`` the loop's cost comes from.

    python scripts/kernel_cost.py [--formats model,int8,int4,int4r] [--launch TILE,WARPS,STAGES[,MAXREGS]]
        [--kernel decode|prefill] [--ops] [--lines [DEPTH]] [--json F]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
os.environ.pop("TRITON_INTERPRET", None)  # NOTE: before triton.jit decorates our kernels
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))

# warp instructions per SM per clock on sm_90 (CUDA programming guide's throughput table / 32)
PIPE_RATE = {"issue": 4.0, "fp": 4.0, "imad": 2.0, "alu": 2.0, "xu": 0.5, "lsu": 1.0, "tensor": 0.5}
PIPES = {
    "tensor": ("HMMA", "IMMA", "HGMMA"),
    "fp": ("FFMA", "FADD", "FMUL", "HADD2", "HFMA2", "HMUL2"),
    "imad": ("IMAD",),
    "xu": ("MUFU", "I2F", "F2I", "F2F", "FRND"),
    "lsu": ("LDS", "LDSM", "STS", "STSM", "LDG", "LDGSTS", "STG", "SHFL", "LD", "ST", "ATOMS", "RED", "LDC"),
}
# control, uniform-datapath and barrier instructions take an issue slot but no vector pipe
NO_PIPE = re.compile(r"^(BRA|BAR|NOP|DEPBAR|LDGDEPBAR|EXIT|WARPSYNC|BSSY|BSYNC|CALL|RET|YIELD|S2R|S2UR|CS2R|R2UR|U[A-Z0-9]+)$")
PEAK_BYTES_PER_CLOCK = 4800e9 / 132 / 1.98e9  # H200
SMEM_BYTES_PER_CLOCK = 128  # shared memory bandwidth per SM (32 banks x 4 bytes)


def smem_bytes(op: str) -> int:
    """Bytes a warp moves through shared memory with one ``op`` (0 for anything else): its width
    per lane times 32, ``ldmatrix``/``stmatrix`` by their matrix count, cp.async by what it writes,
    and spilled registers' local loads and stores, which share the L1's SRAM (and its bandwidth)
    with shared memory. Bank conflicts come on top."""
    parts = op.split(".")
    base = parts[0]
    if base in ("LDSM", "STSM"):
        count = next((int(p) for p in reversed(parts) if p in ("1", "2", "4")), 1)
        return 128 * count
    if base not in ("LDS", "STS", "LDGSTS", "LDL", "STL"):
        return 0
    width = next((int(p) for p in parts[1:] if p in ("64", "128")), 32)
    width = 16 if "U16" in parts or "S16" in parts else 8 if "U8" in parts or "S8" in parts else width
    return width * 32 // 8


def pipe_of(op: str) -> str | None:
    base = op.split(".")[0]
    for pipe, ops in PIPES.items():
        if base in ops:
            return pipe
    return None if NO_PIPE.match(base) else "alu"


def instructions(sass: str) -> tuple[list[tuple[str, list[str]]], dict[str, int]]:
    """nvdisasm output -> its instructions (text without predicate, and the source lines it comes
    from, outermost call first, where ``-gi`` annotated them) and each label's index among them."""
    insts, labels, frames, chain = [], {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^\s*\.?(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(insts)
            continue
        # a change of source line: //## File "inner.py", line 9 inlined at "outer.py", line 3, one
        # line a frame, the innermost first; the instructions after it come from there
        where = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if where:
            frames.append(f"{Path(where.group(1)).name}:{where.group(2)}")
            continue
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins:
            if frames:
                chain, frames = frames[::-1], []
            insts.append((re.sub(r"^@!?U?P\w+\s+", "", ins.group(1)), chain))
    return insts, labels


def _loop(sass: str) -> list[tuple[str, list[str]]]:
    insts, labels = instructions(sass)
    loops = []
    for i, (text, _) in enumerate(insts):
        target = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)
        if target and labels.get(target.group(1), i + 1) <= i:
            loops.append(insts[labels[target.group(1)]: i + 1])
    if not loops:
        raise RuntimeError("no loop found in the disassembly")
    return max(loops, key=len)


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop (a branch back to an earlier label) in nvdisasm output."""
    return [text.split()[0] for text, _ in _loop(sass)]


def loop_lines(sass: str, depth: int = 0) -> collections.Counter:
    """Instructions of the longest loop per source line, from ``nvdisasm -gi`` output: each goes to
    the frame of its call chain below the calls nine in ten of the loop's instructions share (the
    call of a loop in a helper, such as the quantized loops in ``decode_tiles``), ``depth`` frames
    deeper still; an instruction whose chain is shorter goes to its innermost frame."""
    loop = _loop(sass)
    level = 0
    while any(len(chain) > level + 1 for _, chain in loop):
        heads = collections.Counter(chain[level] for _, chain in loop if len(chain) > level)
        if heads.most_common(1)[0][1] < 0.9 * len(loop):
            break
        level += 1
    level += depth
    return collections.Counter((chain[min(level, len(chain) - 1)] if chain else "?") for _, chain in loop)


def source_line(where: str) -> str:
    """The text of ``file.py:N`` (a file of ``llmbus/kernels/``), stripped; empty if it is not there."""
    name, _, line = where.partition(":")
    path = SCRIPTS.parent / "llmbus" / "kernels" / name
    if not path.is_file() or not line.isdigit():
        return ""
    lines = path.read_text().splitlines()
    return lines[int(line) - 1].strip()[:100] if 0 < int(line) <= len(lines) else ""


def occupancy(regs: int, warps: int, smem: int) -> int:
    """Resident warps per SM of a Hopper GPU (``paged_decode.resident_programs``)."""
    from llmbus.kernels.paged_decode import HOPPER_SM, resident_programs

    return resident_programs(regs, warps, smem, HOPPER_SM) * warps


@functools.lru_cache(maxsize=None)
def _compile_only(arch: int) -> list:
    from compile_kernels import compile_only

    return compile_only(arch)


def analyse(fmt: str, launch: tuple[int, ...] | None = None, arch: int = 90, kernel: str = "decode",
            lines_depth: int = 0, block_size: int | None = None) -> dict:
    """Compile one decode launch (or, ``kernel="prefill"``, the prefill kernel at its defaults: 64
    query rows of one head a program, 64-token tiles) and cost its main loop (the module docstring);
    ``lines`` counts its instructions per source line (``loop_lines`` at ``lines_depth``)."""
    import torch
    import triton

    from bench_gpu import BS, D, HKV, HQ, read_bytes_per_token
    from compile_kernels import CudaLike, cuda_cache
    from llmbus.kernels.paged_decode import launch_defaults, paged_decode_attention, register_cap
    from llmbus.kernels.paged_prefill import paged_prefill_attention
    from llmbus.kv.layout import KVLayout

    tile, warps, stages = (launch or launch_defaults(fmt))[:3]
    regs_cap = launch[3] if launch and len(launch) > 3 else None  # None: the wrapper's default
    lay = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=block_size or BS, dtype="bfloat16")
    cache = cuda_cache(fmt, lay)
    q = torch.randn(2, HQ, D).to(torch.bfloat16).as_subclass(CudaLike)
    tables = torch.zeros(2, 4, dtype=torch.int32).as_subclass(CudaLike)
    lens = torch.tensor([40, 5], dtype=torch.int32).as_subclass(CudaLike)
    compiled = _compile_only(arch)
    compiled.clear()
    if kernel == "prefill":
        qsl = torch.tensor([0, 1, 2], dtype=torch.int32).as_subclass(CudaLike)
        kv = torch.randn(2, HKV, D).to(torch.bfloat16).as_subclass(CudaLike)
        paged_prefill_attention(q, cache, tables, lens, qsl, 0.1, chunk=(kv, kv))  # as the engine calls it
        tile, warps, stages, regs_cap = 64, 4, 3, 0  # the wrapper's CUDA defaults (Triton's warps and stages)
    else:
        paged_decode_attention(q, cache, tables, lens, 0.1, num_splits=1, tile=tile, num_warps=warps,
                               num_stages=stages, max_registers=regs_cap)
    binary = compiled[0][1]
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", "-gi", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    regs, spills = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    # the pipelined loads' shared-memory buffers (the leading dimension of each multi-buffered
    # allocation): how many tiles of each can be in flight at once
    buffers = sorted({int(n) for n in re.findall(
        r"ttg\.local_alloc\s*(?:\{[^}]*\})?\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+[^>]*mutable", binary.asm["ttgir"])})
    loop = main_loop(sass)
    ops = collections.Counter(loop)
    per_pipe = collections.Counter({"issue": len(loop)})
    for op, n in ops.items():
        if (pipe := pipe_of(op)) is not None:
            per_pipe[pipe] += n
    smem = sum(smem_bytes(op) * n for op, n in ops.items()) * warps  # per iteration, all warps
    bytes_per_iter = read_bytes_per_token(fmt, lay) / HKV * tile
    # % of peak each pipe allows: bytes per iteration over its clocks per iteration (warps x count / rate)
    bound = {p: 100 * bytes_per_iter / (n * warps / PIPE_RATE[p]) / PEAK_BYTES_PER_CLOCK for p, n in per_pipe.items()}
    if smem:
        bound["smem"] = 100 * bytes_per_iter / (smem / SMEM_BYTES_PER_CLOCK) / PEAK_BYTES_PER_CLOCK
    binding = min(bound, key=bound.get)
    return dict(fmt=fmt, arch=arch, triton=triton.__version__, block_size=lay.block_size, tile=tile, warps=warps, stages=stages,
                max_registers=register_cap(cache, regs_cap), regs=regs,
                spills=spills, smem=binary.metadata.shared, buffers=buffers, warps_per_sm=occupancy(regs, warps, binary.metadata.shared),
                loop_instructions=len(loop), bytes_per_iteration=bytes_per_iter, smem_bytes_per_iteration=smem,
                instructions_per_byte=len(loop) * warps / bytes_per_iter, bound_pct=bound, binding=binding,
                ops=dict(ops.most_common()), lines=dict(loop_lines(sass, lines_depth).most_common()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="model,int8,int4,int4r")
    ap.add_argument("--launch", default=None, help="TILE,WARPS,STAGES[,MAXREGS] (default: the CUDA launch defaults; MAXREGS 0: no cap)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--ops", action="store_true", help="also print the loop's opcode counts")
    ap.add_argument("--kernel", choices=("decode", "prefill"), default="decode",
                    help="prefill: its main loop per program (64 query rows of one head); --launch does not apply")
    ap.add_argument("--lines", type=int, nargs="?", const=0, default=None, metavar="DEPTH",
                    help="also print the loop's instructions per source line (DEPTH: that many calls deeper)")
    ap.add_argument("--block-size", type=int, default=None, help="tokens a KV block (default: bench_gpu.py's, 16)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    launch = tuple(int(x) for x in args.launch.split(",")) if args.launch else None
    rows = []
    print("| KV format | tile, warps, stages, reg cap | regs | warps/SM | loop instr | warp instr / KV byte | smem bytes / KV byte | bound (% of H200 peak) | binding pipe |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for fmt in args.formats.split(","):
        r = analyse(fmt, launch, args.arch, args.kernel, args.lines or 0, args.block_size)
        rows.append(r)
        spilled = f" ({r['spills']} B spilled)" if r["spills"] else ""
        print(f"| {fmt} | {r['tile']}, {r['warps']}, {r['stages']}, {r['max_registers'] or '-'} | {r['regs']}{spilled} | {r['warps_per_sm']} | "
              f"{r['loop_instructions']} | {r['instructions_per_byte']:.3f} | "
              f"{r['smem_bytes_per_iteration'] / r['bytes_per_iteration']:.1f} | {r['bound_pct'][r['binding']]:.0f}% | "
              f"{r['binding']} |", flush=True)
        if args.ops:
            print("    " + ", ".join(f"{op} {n}" for op, n in r["ops"].items()))
        if args.lines is not None:
            for where, n in r["lines"].items():
                print(f"    {n:4d}  {where:<24} {source_line(where)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

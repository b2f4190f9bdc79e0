"""scripts/kernel_cost.py: the static cost of the decode (and prefill) kernel's main loop, compiled for sm_90 here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kernel_cost.py"
SASS = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0110*/                   LDS.U8 R2, [R3] ;
        /*0120*/                   PRMT R4, R2, 0x7610, R5 ;
        /*0130*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0140*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*0150*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0160*/                   FADD R1, R1, R2 ;
        /*0170*/              @!P1 BRA `(.L_x_1) ;
        /*0180*/                   EXIT ;
"""


def _load():
    """The script as a module. NOTE: it drops TRITON_INTERPRET from the environment on import (for
    its own process); this test process keeps it, or kernels imported later would compile natively."""
    saved = os.environ.get("TRITON_INTERPRET")
    spec = importlib.util.spec_from_file_location("kernel_cost", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    return mod


def test_the_longest_loop_is_found_and_its_instructions_go_to_pipes():
    cost = _load()
    loop = cost.main_loop(SASS)
    assert loop == ["LDS.U8", "PRMT", "HMMA.16816.F32", "UIADD3", "BRA"]
    assert [cost.pipe_of(op) for op in loop] == ["lsu", "alu", "tensor", None, None]
    assert cost.occupancy(regs=80, warps=4, smem=13440) == 24 and cost.occupancy(regs=243, warps=4, smem=30992) == 8


SASS_LINES = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
	//## File "/k/decode_tiles.py", line 40 inlined at "/k/decode_tiles.py", line 12
	//## File "/k/decode_tiles.py", line 12 inlined at "/k/paged_decode.py", line 7
	//## File "/k/paged_decode.py", line 7
        /*0110*/                   LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT ;
        /*0120*/                   HADD2 R2, R2, -R4 ;
	//## File "/k/decode_tiles.py", line 13 inlined at "/k/paged_decode.py", line 7
	//## File "/k/paged_decode.py", line 7
        /*0130*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
	//## File "/k/paged_decode.py", line 7
        /*0140*/               @P0 BRA `(.L_x_0) ;
"""


def test_loop_lines_attribute_instructions_below_the_loops_shared_call():
    """nvdisasm -gi annotates a change of source line with its call chain, innermost first; the
    loop's instructions go to the frame below the call they (nine in ten) share, or deeper."""
    cost = _load()
    assert cost.main_loop(SASS_LINES) == ["LOP3.LUT", "HADD2", "HMMA.16816.F32", "BRA"]
    assert cost.loop_lines(SASS_LINES) == {"decode_tiles.py:12": 2, "decode_tiles.py:13": 1, "paged_decode.py:7": 1}
    assert cost.loop_lines(SASS_LINES, depth=1) == {"decode_tiles.py:40": 2, "decode_tiles.py:13": 1,
                                                     "paged_decode.py:7": 1}


def _cost(tmp_path: Path, fmt: str, asm: bool, kernel: str = "decode", warp_tiles: bool = True,
          block_size: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"LLMBUS_TRITON_ASM": "1" if asm else "0",
                                                                            "LLMBUS_TRITON_WARP_TILES": str(int(warp_tiles))}
    out = tmp_path / f"{fmt}-{asm}-{kernel}-{warp_tiles}-{block_size}.json"
    sizes = ["--block-size", str(block_size)] if block_size else []
    proc = subprocess.run([sys.executable, str(SCRIPT), "--formats", fmt, "--kernel", kernel, "--json", str(out), *sizes],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())
    return row


def _asynchronous_and_double_buffered(row: dict, max_sync: int) -> None:
    """The loop's only synchronous global loads are the next tile's block ids (at most ``max_sync``
    a thread, used an iteration after they are issued: ``decode_tiles.next_blocks``), and every
    pipelined load has two buffers, so two tiles can be in flight. Loaded in the same iteration
    as the codes they locate, the ids left Triton one buffer a load (before 2026-11-30, night)."""
    assert sum(n for op, n in row["ops"].items() if op.startswith("LDG.")) <= max_sync, row["ops"]
    assert row["buffers"] == [2], row["buffers"]


def test_int8_decode_reads_words_and_converts_pairs_in_ptx(tmp_path):
    """The INT8 loop gathers no single bytes from shared memory (it reads 32-bit words by channel
    class), and the inline-PTX pair conversion leaves fewer instructions per KV byte than its
    plain-Triton twin. Under the launch's register cap (128-token tiles, the H200's best) the loop
    stores no spilled register and reloads few. Compiled for sm_90 and counted; nothing here runs
    on a GPU."""
    asm, plain = _cost(tmp_path, "int8", True), _cost(tmp_path, "int8", False)
    for row in (asm, plain):
        assert any(op.startswith("HMMA") for op in row["ops"])
        assert not [op for op in row["ops"] if op.startswith(("LDS.U8", "LDS.S8"))], row["ops"]
        assert row["max_registers"] and row["regs"] <= row["max_registers"]
        spill_ops = {op: n for op, n in row["ops"].items() if op.startswith(("LDL", "STL"))}
        assert not [op for op in spill_ops if op.startswith("STL")], spill_ops
        assert sum(spill_ops.values()) < 0.02 * row["loop_instructions"], spill_ops
        # every load of codes and metadata is asynchronous (cp.async, pipelined: fp16 scales come
        # in pairs) and double-buffered; the one synchronous load is the next tile's block ids
        _asynchronous_and_double_buffered(row, max_sync=2)
    assert asm["instructions_per_byte"] < plain["instructions_per_byte"]
    assert asm["bound_pct"][asm["binding"]] > plain["bound_pct"][plain["binding"]]


def test_int4_decode_works_out_key_ranges_per_channel_and_fits_its_register_cap(tmp_path):
    """The INT4 loop works out key ranges once per channel (a handful of int-to-float conversions;
    computed in the dot operand's layout they were 128 per thread and iteration), its inline-PTX
    nibble conversion beats the plain-Triton twin, and under the launch's register cap (16 warps an
    SM instead of 8) the loop stores no spilled register and reloads few (under 2% of its
    instructions: what spills lives mostly outside it). Its codes are read as 16-bit lanes, so the
    dots' operands take the two-per-register layout (read as bytes, every operand register of every
    mma was first moved: ~130 moves per iteration); its metadata is read in 32-bit words, so Triton
    pipelines every global load (16-bit loads it leaves synchronous, in the loop)."""
    asm, plain = _cost(tmp_path, "int4", True, warp_tiles=False), _cost(tmp_path, "int4", False, warp_tiles=False)
    for row in (asm, plain):
        assert any(op.startswith("HMMA") for op in row["ops"])
        # per source line: the loop's instructions, in the lane loop's lines
        assert sum(row["lines"].values()) == row["loop_instructions"]
        assert next(iter(row["lines"])).startswith("decode_tiles.py:"), row["lines"]
        assert sum(n for op, n in row["ops"].items() if op.startswith(("I2F", "I2FP"))) <= 8, row["ops"]
        assert row["max_registers"] and row["regs"] <= row["max_registers"]
    spill_ops = {op: n for op, n in asm["ops"].items() if op.startswith(("LDL", "STL"))}
    assert not [op for op in spill_ops if op.startswith("STL")], spill_ops
    assert sum(spill_ops.values()) < 0.02 * asm["loop_instructions"], spill_ops
    moves = sum(n for op, n in asm["ops"].items() if op.startswith(("MOV", "IMAD.MOV")))
    assert moves < 0.02 * asm["loop_instructions"], asm["ops"]
    assert asm["instructions_per_byte"] < plain["instructions_per_byte"]
    # every load of codes and metadata is asynchronous (cp.async, pipelined) and double-buffered
    _asynchronous_and_double_buffered(asm, max_sync=6)


def test_int4_decode_dequantizes_in_the_dot_operands_layout(tmp_path):
    """The INT4 loop stores no dequantized tile to shared memory: its codes go from shared memory
    straight into the mma operands' registers and are dequantized there, so the loop moves under
    ten bytes through shared memory per KV byte it reads (13 when each dequantized key and value
    tile was stored and read back: 16 STS a thread and iteration, against a handful now for the
    key ranges' one conversion and the softmax's reductions)."""
    row = _cost(tmp_path, "int4", True, warp_tiles=False)
    stores = sum(n for op, n in row["ops"].items() if op.startswith(("STS", "STSM")))
    assert stores <= 8, row["ops"]  # 4 under Triton 3.9, 8 under 3.6
    assert row["smem_bytes_per_iteration"] < 10 * row["bytes_per_iteration"], row["smem_bytes_per_iteration"]
    assert row["bound_pct"]["smem"] > 60


def test_int4_block_loop_takes_fewer_instructions_a_byte_than_the_lane_loop(tmp_path):
    """INT4 decode's default loop (decode_tiles.int4_blocks_warp_loop: the key ranges scale the
    queries, a softmax a block) runs fewer instructions and moves fewer shared-memory bytes a KV
    byte than the lane loop, which dequantizes every code; its scaled queries reach their dots a
    channel pair at a time (no 16-bit shared-memory access: computed channels down the rows, they
    went a 16-bit element at a time), it spills nothing, and its loads stay asynchronous and
    double-buffered. At 32-token blocks its fixed work a block (the ranges, the scaled queries, the
    minima term) is spread over twice the bytes (bench_gpu.BLOCK_SWEEP)."""
    blocks, lanes = _cost(tmp_path, "int4", True), _cost(tmp_path, "int4", True, warp_tiles=False)
    wide = _cost(tmp_path, "int4", True, block_size=32)
    assert (blocks["block_size"], wide["block_size"]) == (16, 32)
    assert wide["instructions_per_byte"] < 0.9 * blocks["instructions_per_byte"], (wide, blocks)  # 0.80, 0.74: 3.6, 3.9
    assert blocks["instructions_per_byte"] < 0.85 * lanes["instructions_per_byte"], (blocks, lanes)  # 0.75, 0.8: 3.6, 3.9
    assert blocks["smem_bytes_per_iteration"] / blocks["bytes_per_iteration"] < (
        0.8 * lanes["smem_bytes_per_iteration"] / lanes["bytes_per_iteration"])
    assert not [op for op in blocks["ops"] if op.startswith(("LDS.U16", "LDL", "STL"))], blocks["ops"]
    assert blocks["spills"] == 0 and blocks["bound_pct"]["issue"] > lanes["bound_pct"]["issue"]
    # the slots' block ids load once for each layout that addresses with them (codes, ranges, pairs)
    _asynchronous_and_double_buffered(blocks, max_sync=10)


def test_smem_bytes_count_each_access_by_its_width():
    cost = _load()
    assert [cost.smem_bytes(op) for op in ("LDS", "LDS.64", "LDS.128", "LDS.U16", "STS.U8", "LDSM.16.M88.4",
                                           "LDSM.16.MT88.2", "STSM.16.M88.4", "LDGSTS.E.BYPASS.128", "LDGSTS.E",
                                           "LDL", "STL.64", "HMMA.16816.F32", "LDG.E")] == [
        128, 256, 512, 64, 32, 512, 256, 512, 512, 128, 128, 256, 0, 0]


def test_quantized_prefill_runs_the_decode_loops(tmp_path):
    """Prefill over INT8 and INT4 contexts (head_dim 128) reads them as the decode loops do: no
    synchronous global load but the next tile's block ids, and no int-to-float conversion instruction per code in its main loop
    (the generic tile load had 128 single-byte loads and 128 conversions a tile for INT4), and the
    INT4 loop stays within 1.6x the bf16 one's instructions (1.4x / 1.5x under Triton 3.6 / 3.9; it
    was 3.8x / 3.3x)."""
    model = _cost(tmp_path, "model", True, "prefill")
    for fmt in ("int8", "int4"):
        row = _cost(tmp_path, fmt, True, "prefill")
        assert sum(n for op, n in row["ops"].items() if op.startswith("LDG.")) <= 6, row["ops"]
        assert sum(n for op, n in row["ops"].items() if op.startswith(("I2F", "I2FP"))) <= 8, row["ops"]
        assert row["loop_instructions"] < 1.6 * model["loop_instructions"], (fmt, row["loop_instructions"])

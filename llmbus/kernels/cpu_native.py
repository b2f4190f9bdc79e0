"""The CPU kernels in ``llmbus/kernels/cpu_decode.c``: built once per machine, loaded with ctypes.

``paged_decode(q, cache, block_tables, seq_lens, scale)`` is the whole decode half of a step in one
call; ``CpuAttentionBackend`` uses it when ``available()``, else its torch path (same results within
the dtype's rounding, checked by tests/test_cpu_native.py against ``llmbus.kernels.reference``). The same
library holds bf16 prefill attention (``prefill_into``), the model's element-wise fusions
(``rms_norm``, ``silu_mul``, ``rope``), the bf16/float32 linear product over blocked weights
(``linear``) and the sampler's warp and draw (``sample``), each of which returns None (or is not
planned) where it does not apply, so the caller's torch ops serve; and a decode-only step's
decoder layers in one call (``decode_layers``).

Build: the system C compiler (``$CC``, else ``cc``) with ``-O3 -march=native -fopenmp``, into
``$LLMBUS_DATA_DIR/native`` (else ``~/.cache/llmbus/native``) under a name that hashes the source, the
flags and this CPU's feature flags, so a cache shared between machines never loads code built for
another CPU. Written aside and renamed into place, so concurrent workers never load half a file. No
compiler, a failed build or ``LLMBUS_CPU_NATIVE=0``: ``available()`` is False (logged once) and the
torch path serves. ctypes drops the GIL for the call, so the event loop keeps running meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch

from llmbus.kernels import reference

log = logging.getLogger("llmbus.kernels")

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-fno-signed-zeros", "-fassociative-math"]  # fmt: skip
if platform.machine() in ("x86_64", "AMD64"):
    # NOTE: gcc vectorizes the element-wise loops (RMSNorm, SwiGLU, rotary) 256 bits wide unless
    # told: 512 made them 25-35% faster on an AVX-512 Xeon (ignored on CPUs without AVX-512)
    FLAGS.insert(2, "-mprefer-vector-width=512")
# kernel limits (MAX_G, MAX_D, MAX_BS in the source): larger shapes use the torch path
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 32, 256, 64
STALE_BUILD_S = 7 * 24 * 3600  # builds of other source versions older than this are removed
BUILD_TIMEOUT_S = 120  # the compiler's limit

# int8 caches: entry point per (query dtype, scale dtype)
_WRITE_INT8 = {(q, sc): f"write_int8_{qn}_{sn}" for q, qn in ((torch.float32, "f32"), (torch.bfloat16, "bf16"))
               for sc, sn in ((torch.float16, "f16"), (torch.float32, "f32"))}
_INT8 = {(torch.float32, torch.float16): "paged_decode_int8_f32_f16", (torch.float32, torch.float32): "paged_decode_int8_f32_f32",
         (torch.bfloat16, torch.float16): "paged_decode_int8_bf16_f16",
         (torch.bfloat16, torch.float32): "paged_decode_int8_bf16_f32"}  # fmt: skip

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
# NOTE: LLMBUS_CPU_INT4_FUSED=0: int4 blocks dequantized before the kernel, not inside it, and written by
# the torch reference instead of write_int4 (for comparison)
INT4_FUSED = os.environ.get("LLMBUS_CPU_INT4_FUSED", "1") != "0"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    data = os.environ.get("LLMBUS_DATA_DIR")
    return (Path(data) if data else Path.home() / ".cache" / "llmbus") / "native"


def _build(force: bool = False) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (set CC or install gcc)")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), cc, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]  # fmt: skip
    out = build_dir() / f"cpu_decode-{key}.so"
    if out.is_file() and not force:
        with contextlib.suppress(OSError):
            os.utime(out)  # in use: not stale
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S)  # fmt: skip
        os.chmod(tmp, 0o644)  # NOTE: mkstemp's 0600 would lock out other users of a shared data dir
        os.replace(tmp, out)
        stale = time.time() - STALE_BUILD_S
        for old in out.parent.glob("cpu_decode-*.so"):  # other versions' builds, unused for a week
            with contextlib.suppress(OSError):
                if old != out and old.stat().st_mtime < stale:
                    old.unlink()
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{cc} failed: {exc.stderr.strip()[-500:]}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def _remove_abandoned(folder: Path) -> None:
    """Temporary outputs of builds whose process was killed mid-compile (its ``finally`` never ran):
    older than any build may take, so no build still running owns them."""
    old = time.time() - 2 * BUILD_TIMEOUT_S
    for tmp in folder.glob("tmp*.so"):
        with contextlib.suppress(OSError):
            if tmp.stat().st_mtime < old:
                tmp.unlink()


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _lib is not None:  # loaded: no lock (every kernel call of every step asks)
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("LLMBUS_CPU_NATIVE", "1") == "0":
            log.info("fused CPU decode kernel disabled (LLMBUS_CPU_NATIVE=0): torch path")
            return None
        try:
            try:
                lib = ctypes.CDLL(str(_build()))
            except OSError:  # removed or unreadable between the check and the load: build it afresh
                lib = ctypes.CDLL(str(_build(force=True)))
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            log.warning("fused CPU decode kernel unavailable, using the torch path: %s", exc)
            return None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for fn in (lib.paged_decode_f32, lib.paged_decode_bf16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        for fn in _INT8.values():
            fn = getattr(lib, fn)
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        for fn in (lib.paged_decode_int4_f32, lib.paged_decode_int4_bf16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64,
                           i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]  # fmt: skip
        for fn in _WRITE_INT8.values():
            fn = getattr(lib, fn)
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        for fn in (lib.write_int4_f32, lib.write_int4_bf16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64,
                           ctypes.c_int]
        for fn in (lib.rotate_f32, lib.rotate_bf16):
            fn.restype, fn.argtypes = ctypes.c_int, [ptr, i64, i64, ptr, ctypes.c_int]
        for src in ("f32", "bf16"):
            for dst in ("f32", "bf16"):
                fn = getattr(lib, f"round_query_{src}_{dst}")
                fn.restype, fn.argtypes = None, [ptr, i64, i64, ptr, ctypes.c_int]
        lib.dequant_int4.restype = ctypes.c_int
        lib.dequant_int4.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ptr, ctypes.c_int]
        lib.prefill_attn_bf16.restype = lib.have_bf16_dot.restype = lib.linear_bf16.restype = ctypes.c_int
        lib.prefill_attn_bf16.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                          ctypes.c_float, ctypes.c_int]  # fmt: skip
        lib.have_bf16_dot.argtypes = []
        lib.linear_bf16.argtypes = lib.linear_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        lib.linear_amx_bf16.argtypes = lib.linear_bf16.argtypes
        lib.linear_amx_bf16.restype = lib.have_amx_bf16.restype = ctypes.c_int
        lib.have_amx_bf16.argtypes = []
        lib.set_amx.argtypes, lib.set_amx.restype = [ctypes.c_int], None
        lib.set_amx(int(os.environ.get("LLMBUS_CPU_AMX", "1") != "0"))
        lib.linear_f32.restype = lib.have_linear_f32.restype = lib.have_linear_bf16.restype = ctypes.c_int
        lib.have_linear_f32.argtypes = lib.have_linear_bf16.argtypes = []
        for sfx in ("bf16", "f32"):
            norm, silu, rot = getattr(lib, f"rms_norm_{sfx}"), getattr(lib, f"silu_mul_{sfx}"), getattr(lib, f"rope_{sfx}")
            norm.restype = silu.restype = rot.restype = None
            norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
            silu.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
            rot.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        lib.sample_f32.restype = ctypes.c_int
        lib.sample_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        lib.greedy_f32.restype = None
        lib.greedy_f32.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
        for fn in (lib.decode_layers_bf16, lib.decode_layers_f32):
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr,
                           i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float, ctypes.c_int]  # fmt: skip
        _lib = lib
        return lib


def available() -> bool:
    return _load() is not None


def supports(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    return (dtype in (torch.float32, torch.bfloat16) and num_kv_heads > 0 and num_q_heads > 0
            and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
            and block_size <= MAX_BLOCK_SIZE)  # fmt: skip


def prepare_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables ``[B, M]`` and lengths ``[B]`` as the kernel takes them (contiguous int32), with
    what it leaves to its caller checked: every length in ``[0, M * block_size]`` (block ids
    themselves are checked by the kernel). Once per step; the calls then reuse them."""
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if tables.dim() != 2 or lens.dim() != 1:
        raise ValueError(f"block_tables {list(tables.shape)} and seq_lens {list(lens.shape)} do not match")
    _check_lens(tables, lens, block_size)
    return tables, lens


def _check_lens(tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> None:
    """Every length in ``[0, table width * block_size]``: what the kernels trust their caller for."""
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > tables.shape[1] * block_size):
        raise ValueError(f"sequence lengths must lie in [0, {tables.shape[1] * block_size}] for {tables.shape[1]} "
                         f"blocks of {block_size}, got {lens.tolist()}")


def _check_batch(q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, *tensors: torch.Tensor) -> None:
    """What every decode entry trusts its caller for: one table row and one length per query, int32,
    and contiguous CPU tensors."""
    if tables.dim() != 2 or tables.shape[0] != q.shape[0] or lens.shape != (q.shape[0],):
        raise ValueError(f"block_tables {list(tables.shape)} and seq_lens {list(lens.shape)} do not match "
                         f"{q.shape[0]} queries")
    if tables.dtype != torch.int32 or lens.dtype != torch.int32:
        raise ValueError("block tables and sequence lengths must be int32")
    for t in (q, tables, lens, *tensors):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("the fused CPU decode kernel takes contiguous CPU tensors only")


def _run(entry: str, out: torch.Tensor, q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None,
         tables: torch.Tensor, lens: torch.Tensor, scale: float) -> None:
    """One kernel call, after checking what the C side trusts: shapes that agree, int32 tables,
    contiguous CPU tensors (checks that cost microseconds)."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the fused CPU decode kernel is not available")
    if data.dim() != 5 or data.shape[0] != 2 or q.dim() != 3 or q.shape[2] != data.shape[4] or out.shape != q.shape:
        raise ValueError(f"q {list(q.shape)}, out {list(out.shape)} and cache {list(data.shape)} do not agree")
    _check_batch(q, tables, lens, out, data, *((scales,) if scales is not None else ()))
    b, hq, d = q.shape
    _, n_blocks, bs, hkv, _ = data.shape
    ptrs = [data.data_ptr()] + ([scales.data_ptr()] if scales is not None else [])
    rc = getattr(lib, entry)(*ptrs, q.data_ptr(), out.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                             b, hq, hkv, d, bs, n_blocks, float(scale), torch.get_num_threads())  # fmt: skip
    if rc == 1:
        raise ValueError(f"a block table names a block outside the cache's {n_blocks}")
    if rc != 0:
        raise ValueError(f"unsupported decode shape: q {q.dtype} {list(q.shape)}, cache {list(data.shape)}")


def decode_into(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                scale: float) -> None:
    """The kernel over a model-dtype cache, on tables from ``prepare_tables``: ``out``/``q``
    contiguous ``[B, Hq, D]`` in the cache's dtype (``supports``), cache ``[2, N, bs, Hkv, D]``."""
    if q.dtype != cache.dtype or out.dtype != q.dtype:
        raise ValueError("q, out and the cache must share a dtype")
    _run("paged_decode_bf16" if q.dtype == torch.bfloat16 else "paged_decode_f32", out, q, cache, None, tables, lens,
         scale)  # fmt: skip


def decode_int8_into(out: torch.Tensor, q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor, scale: float) -> None:
    """``decode_into`` over an int8 cache: ``data`` int8 ``[2, N, bs, Hkv, D]`` and ``scales``
    ``[2, N, bs, Hkv]`` (fp16 or fp32), entry = int8 x scale (``llmbus/kernels/kv_cache.py``)."""
    entry = _INT8.get((q.dtype, scales.dtype))
    if entry is None or data.dtype != torch.int8 or scales.shape != data.shape[:4] or out.dtype != q.dtype:
        raise ValueError(f"unsupported int8 decode: q {q.dtype}, data {data.dtype} {list(data.shape)}, "
                         f"scales {scales.dtype} {list(scales.shape)}")
    _run(entry, out, q, data, scales, tables, lens, scale)


def write_int8(key: torch.Tensor, value: torch.Tensor, cache, slot_mapping: torch.Tensor) -> bool:
    """``reference.write_kv_cache`` into an INT8 ``PagedKVCache`` in one C call, with the same bytes
    as a result; False (nothing written) where it does not apply, as ``write_int4``."""
    lay = cache.layout
    entry = _WRITE_INT8.get((key.dtype, cache.scale.dtype if cache.scale is not None else None))
    if (entry is None or _load() is None or cache.fmt.name != "int8" or value.dtype != key.dtype
            or key.device.type != "cpu" or slot_mapping.device.type != "cpu" or key.shape != value.shape
            or key.dim() != 3 or tuple(key.shape[1:]) != (lay.num_kv_heads, lay.head_dim) or not int8_tensors_fit(cache)):
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {list(slots.shape)}")
    key, value = key.contiguous(), value.contiguous()
    rc = getattr(_lib, entry)(key.data_ptr(), value.data_ptr(), key.shape[0], slots.data_ptr(), cache.data.data_ptr(),
                              cache.scale.data_ptr(), cache.num_blocks, lay.block_size, lay.num_kv_heads,
                              lay.head_dim)  # fmt: skip
    if rc == 1:
        raise ValueError(_bad_slot(slots, cache.num_blocks * lay.block_size))
    return rc == 0  # 2: a head dim past the kernel's buffers (the reference writes it)


def int8_tensors_fit(cache) -> bool:
    """Whether an INT8 cache's tensors are what the C entries index blindly: int8 data of its
    layout's shape and its scales, both contiguous."""
    lay = cache.layout
    return (cache.data.dtype == torch.int8 and cache.scale is not None and cache.data.is_contiguous()
            and cache.scale.is_contiguous()
            and tuple(cache.data.shape) == (2, cache.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
            and cache.scale.shape == cache.data.shape[:4])


def _bad_slot(slots: torch.Tensor, limit: int) -> str:
    bad = int(slots[(slots < 0) | (slots >= limit)][0])
    return f"slots must lie in [0, {limit}), got {bad}"


def int4_tensors_fit(cache, dtype: torch.dtype, tails: bool) -> bool:
    """Whether an INT4 cache's tensors are what the C entries index blindly: contiguous, of its
    layout's shapes, and (``tails``) tail rows of ``dtype``. Tensors of other dtypes than an INT4
    cache's raise."""
    if cache.data.dtype != torch.uint8 or cache.k_meta.dtype != torch.int16 or cache.v_meta.dtype != torch.float16:
        raise ValueError(f"not an INT4 cache's tensors: {cache.data.dtype}, {cache.k_meta.dtype}, {cache.v_meta.dtype}")
    lay = cache.layout
    d, bs, h, n = lay.head_dim, lay.block_size, lay.num_kv_heads, cache.num_blocks
    want = [(cache.data, (2, n, bs, h, d // 2), torch.uint8), (cache.k_meta, (n, h, cache.fmt.key_meta_slots(d, bs)), torch.int16),
            (cache.v_meta, (n, bs, h, d // cache.fmt.groups(d, bs)[0], 2), torch.float16)]  # fmt: skip
    if tails and cache.k_tail is not None:
        want += [(t, (cache.num_tail_rows * bs, h, d), dtype) for t in (cache.k_tail, cache.v_tail)]
    return all(t.is_contiguous() and tuple(t.shape) == shape and t.dtype == dt for t, shape, dt in want)


def _int4_meta_shape(cache) -> tuple[int, int, int]:
    """An INT4 (or INT4R) cache's ``(key_slots, key group, value group)``, as the C entries take them."""
    gv, gk = cache.fmt.groups(cache.layout.head_dim, cache.layout.block_size)
    return cache.k_meta.shape[-1], gk, gv


def _int4_tail_slots(cache, slots: torch.Tensor, tail_slots: torch.Tensor | None) -> torch.Tensor | None:
    """``tail_slots`` checked against ``cache`` and ``slots`` (``reference.check_tail_slots``), contiguous."""
    tails = reference.check_tail_slots(cache, slots, tail_slots)
    return tails.contiguous() if tails is not None else None


def _int4_tail_rows(cache, tail_rows: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """Each of ``b`` sequences' tail row (-1: none) as contiguous int32, checked against the cache's
    rows; None where the cache keeps none or none are given."""
    if tail_rows is None or cache.k_tail is None:
        return None
    rows = tail_rows.to(torch.int32).contiguous()
    if rows.shape != (b,) or (rows.numel() and int(rows.max()) >= cache.num_tail_rows):
        raise ValueError(f"tail_rows must be [{b}] rows below {cache.num_tail_rows}, got {rows.tolist()}")
    return rows


def write_int4(key: torch.Tensor, value: torch.Tensor, cache, slot_mapping: torch.Tensor,
               tail_slots: torch.Tensor | None = None) -> bool:
    """``reference.write_kv_cache`` into an INT4 (or INT4R: every key per token, nothing sealed)
    ``PagedKVCache`` in one C call, with the same bytes as a result (up to the sign of a zero range
    end: ``write_int4_*`` in cpu_decode.c). False
    (nothing written) where it does not apply: keys not float32 or bfloat16 or not the cache's model
    dtype, cache tensors not contiguous or not of its layout, a shape the kernel does not take, no
    library; the caller's path serves."""
    lay = cache.layout
    if (not INT4_FUSED or _load() is None or not cache.fmt.int4_codes or key.dtype != cache.model_dtype
            or key.dtype not in _SUFFIX or value.dtype != key.dtype or key.device.type != "cpu"
            or slot_mapping.device.type != "cpu" or key.shape != value.shape or key.dim() != 3
            or tuple(key.shape[1:]) != (lay.num_kv_heads, lay.head_dim)):
        return False
    if not int4_tensors_fit(cache, key.dtype, tails=True):
        return False
    d, bs = lay.head_dim, lay.block_size
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {list(slots.shape)}")
    tails = _int4_tail_slots(cache, slots, tail_slots)
    key, value = key.contiguous(), value.contiguous()
    fn = getattr(_lib, f"write_int4_{_SUFFIX[key.dtype]}")
    rc = fn(key.data_ptr(), value.data_ptr(), key.shape[0], slots.data_ptr(), tails.data_ptr() if tails is not None else None,
            cache.data.data_ptr(), cache.k_meta.data_ptr(), cache.v_meta.data_ptr(),
            cache.k_tail.data_ptr() if cache.k_tail is not None else None,
            cache.v_tail.data_ptr() if cache.v_tail is not None else None, cache.num_blocks, bs, lay.num_kv_heads, d,
            *_int4_meta_shape(cache), int(cache.fmt.name == "int4r"))  # fmt: skip
    if rc == 1:
        raise ValueError(_bad_slot(slots, cache.num_blocks * bs))
    if rc == 3:
        raise MemoryError("the INT4 write could not allocate its workspace")
    return rc == 0


def dequantize_int4_blocks(cache, block_ids: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``reference.dequantize_blocks`` of an INT4 (or INT4R) ``PagedKVCache`` in one C pass: fp32
    ``[2, n, bs, Hkv, D]`` (equal to the reference's up to fused multiply-adds). INT4R's keys are
    all per token, as INT4's partial blocks' are (``full`` does not matter). Falls back to the
    reference where the library did not build, and for caches not stored contiguously (head-major
    ones: ``kv_cache.allocate_cache``)."""
    lib = _load()
    lay = cache.layout
    if (lib is None or not cache.fmt.int4_codes or cache.data.device.type != "cpu"
            or not all(t.is_contiguous() for t in (cache.data, cache.k_meta, cache.v_meta))):
        return reference.dequantize_blocks(cache, block_ids, full)
    ids = block_ids.to(torch.int64).contiguous()
    flags = (full if cache.fmt.name == "int4" else torch.zeros_like(full)).to(torch.uint8).contiguous()
    if ids.dim() != 1 or flags.shape != ids.shape:
        raise ValueError(f"block ids {list(ids.shape)} and full flags {list(flags.shape)} must be matching vectors")
    bs, hkv, d = lay.block_size, lay.num_kv_heads, lay.head_dim
    out = torch.empty(2, ids.numel(), bs, hkv, d, dtype=torch.float32)
    rc = lib.dequant_int4(cache.data.data_ptr(), cache.k_meta.data_ptr(), cache.v_meta.data_ptr(), ids.data_ptr(),
                          flags.data_ptr(), ids.numel(), cache.num_blocks, bs, hkv, d, *_int4_meta_shape(cache),
                          out.data_ptr(), torch.get_num_threads())  # fmt: skip
    if rc == 1:
        raise ValueError(f"block ids must lie in [0, {cache.num_blocks}), got {ids.tolist()}")
    if rc != 0:
        return reference.dequantize_blocks(cache, block_ids, full)  # a head_dim the C pass does not take
    return out


def round_query(q: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """``quant_reference.round_query(q).to(out_dtype)`` in one C pass (the same fp32 operations,
    so the same values; ``out_dtype`` float32 or bfloat16). None where it does not apply (no
    library, ``q`` not a float32 or bfloat16 CPU tensor): the caller's path serves."""
    if (_load() is None or q.dtype not in _SUFFIX or out_dtype not in _SUFFIX or q.device.type != "cpu"
            or q.dim() == 0 or q.shape[-1] == 0):
        return None
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=out_dtype)
    getattr(_lib, f"round_query_{_SUFFIX[q.dtype]}_{_SUFFIX[out_dtype]}")(
        q.data_ptr(), q.numel() // q.shape[-1], q.shape[-1], out.data_ptr(), torch.get_num_threads())
    return out


def rotate(x: torch.Tensor) -> torch.Tensor | None:
    """``quant_reference.rotate(x)`` in one C pass (the same butterflies in the same order: the
    same bits). None where it does not apply (no library, ``x`` not a float32 or bfloat16 CPU
    tensor, a last dimension not a power of two up to ``MAX_HEAD_DIM``)."""
    if _load() is None or x.dtype not in _SUFFIX or x.device.type != "cpu" or x.dim() == 0:
        return None
    d = x.shape[-1]
    if d < 1 or d > MAX_HEAD_DIM or d & (d - 1):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    getattr(_lib, f"rotate_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.numel() // d, d, out.data_ptr(), torch.get_num_threads())
    return out


def paged_decode_int4(q: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      tail_rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """``reference.paged_decode_attention_cache`` over an INT4 or INT4R ``PagedKVCache`` in one call,
    its blocks widened inside the kernel (equal to the reference up to fused multiply-adds and
    summation order; INT4R's rounded queries, ``round_query``, enter in the model dtype: a bf16
    rounding of each); ``tail_rows`` ([B], -1: none) as there. INT4R's ``q`` comes rotated, as the
    reference takes it. None where it does not apply (q not float32 or bfloat16 or not the cache's
    model dtype, a shape the kernel does not take, no library): the caller's path serves."""
    lay = cache.layout
    b, hq, d = q.shape if q.dim() == 3 else (0, 0, 0)
    if (not INT4_FUSED or _load() is None or not cache.fmt.int4_codes or q.dim() != 3 or d != lay.head_dim or q.dtype != cache.model_dtype
            or not supports(q.dtype, hq, lay.num_kv_heads, d, lay.block_size) or cache.data.device.type != "cpu"):
        return None
    tails = tail_rows is not None and cache.k_tail is not None
    if not int4_tensors_fit(cache, q.dtype, tails):
        return None
    tables, lens = prepare_tables(block_tables, seq_lens, lay.block_size)
    rows = _int4_tail_rows(cache, tail_rows, b)
    q = round_query(q, q.dtype) if cache.fmt.rotates_keys else q.contiguous()
    out = torch.empty_like(q)
    _check_batch(q, tables, lens, out, *((rows,) if tails else ()))
    fn = _lib.paged_decode_int4_bf16 if q.dtype == torch.bfloat16 else _lib.paged_decode_int4_f32
    rc = fn(cache.data.data_ptr(), cache.k_meta.data_ptr(), cache.v_meta.data_ptr(),
            cache.k_tail.data_ptr() if tails else None, cache.v_tail.data_ptr() if tails else None,
            rows.data_ptr() if tails else None, *_int4_meta_shape(cache), q.data_ptr(), out.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
            b, hq, lay.num_kv_heads, d, lay.block_size, cache.num_blocks, float(scale), torch.get_num_threads(),
            int(cache.fmt.rotates_keys))  # fmt: skip
    if rc == 1:
        raise ValueError(f"a block table names a block outside the cache's {cache.num_blocks}")
    return out if rc == 0 else None


def paged_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, scales: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[B, Hq, D]`` (one token per sequence), cache ``[2, N, bs, Hkv, D]`` (float32 or
    bfloat16, q's dtype; or int8 with its ``scales``), block_tables ``[B, >= ceil(len / bs)]``,
    seq_lens ``[B]`` -> ``[B, Hq, D]``; a sequence of length 0 gets zeros."""
    _, _, bs, hkv, d = cache.shape
    if cache.device.type != "cpu" or q.dim() != 3 or q.shape[2] != d or not supports(q.dtype, q.shape[1], hkv, d, bs):
        raise ValueError(f"unsupported decode: q {q.dtype} {list(q.shape)}, cache {cache.dtype} {list(cache.shape)}")
    tables, lens = prepare_tables(block_tables, seq_lens, bs)
    q = q.contiguous()
    out = torch.empty_like(q)
    if scales is None:
        decode_into(out, q, cache.contiguous(), tables, lens, scale)
    else:
        decode_int8_into(out, q, cache.contiguous(), scales.contiguous(), tables, lens, scale)
    return out


_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _fusable(x: torch.Tensor) -> bool:
    return x.dtype in _SUFFIX and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """HF's RMSNorm of bf16 or float32 rows ``x [T, n]`` (rows may be strided) in one pass; None
    where the kernel does not apply (other dtypes, kernel unavailable): the caller runs torch's
    ops. bf16 rounds where torch's ops round; float32 sums the squares in another order."""
    if not (_fusable(x) and weight.dtype == x.dtype and weight.is_contiguous()) or _load() is None:
        return None
    y = torch.empty(x.shape, dtype=x.dtype)
    getattr(_lib, f"rms_norm_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(),
                                                  x.shape[0], x.shape[1], eps, torch.get_num_threads())  # fmt: skip
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``llmbus.kernels.reference.rotary`` of bf16 or float32 ``x [T, H, D]`` (rows may be strided,
    heads contiguous) in one pass (bf16: bit-identical); cos/sin ``[T, 1, D/2]`` of x's dtype.
    None where the kernel does not apply."""
    if (x.dtype not in _SUFFIX or x.device.type != "cpu" or x.dim() != 3 or x.stride(2) != 1
            or x.stride(1) != x.shape[2] or x.shape[2] % 2 or _load() is None):  # fmt: skip
        return None
    t, h, d = x.shape
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.numel() != t * (d // 2) or sin.numel() != cos.numel():
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype)
    getattr(_lib, f"rope_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                                              t, h, d, torch.get_num_threads())  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of a contiguous bf16 or float32 ``[T, 2n]`` gate_up projection in one
    pass; None where the kernel does not apply."""
    if not (_fusable(gate_up) and gate_up.is_contiguous()) or _load() is None:
        return None
    t, n2 = gate_up.shape
    out = torch.empty((t, n2 // 2), dtype=gate_up.dtype)
    getattr(_lib, f"silu_mul_{_SUFFIX[gate_up.dtype]}")(gate_up.data_ptr(), out.data_ptr(), t, n2 // 2,
                                                        torch.get_num_threads())  # fmt: skip
    return out


PREFILL_MAX_GROUP = 64  # query heads per KV head the prefill kernel's tiles hold


@functools.cache  # NOTE: asked on every linear call: the answer is kept once known
def has_bf16_dot() -> bool:
    """Whether the library loaded and this CPU has the bf16 dot instruction its bf16 kernels use."""
    return _load() is not None and bool(_lib.have_bf16_dot())


def prefill_supports(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether ``prefill_into`` serves these caches here: bf16, head dims multiple of 32, blocks
    multiple of 16, and a CPU with the bf16 dot instruction the kernel is written with."""
    return (dtype == torch.bfloat16 and num_kv_heads > 0 and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads <= PREFILL_MAX_GROUP and head_dim % 32 == 0
            and head_dim <= MAX_HEAD_DIM and block_size % 16 == 0 and block_size <= MAX_BLOCK_SIZE
            and has_bf16_dot())  # fmt: skip


def prefill_into(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
                 lens: torch.Tensor, ctxs: torch.Tensor, scale: float) -> None:
    """Causal attention of a step's prefill chunks over the paged cache (their keys/values written
    there already): chunk i's queries are ``q`` rows ``[rows[i], rows[i] + lens[i])`` at positions
    ``ctxs[i] - lens[i] ...``, attending to keys ``0 ..`` own position through ``tables[i]``. Fills
    those rows of ``out`` (contiguous ``[T, Hq, D]``). ``q``: ``[T, Hq, D]``, heads contiguous (rows
    may be strided, as a slice of the qkv projection). Tables/rows/lens/ctxs: contiguous int32."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    _, n_blocks, bs, hkv, d = cache.shape
    t, hq, _ = q.shape
    if q.dtype != torch.bfloat16 or cache.dtype != q.dtype or out.dtype != q.dtype or out.shape != q.shape:
        raise ValueError(f"prefill needs bf16 q, out and cache: q {q.dtype} {list(q.shape)}, cache {cache.dtype}")
    if q.stride(2) != 1 or q.stride(1) != d or not out.is_contiguous() or not cache.is_contiguous():
        raise ValueError("prefill needs heads contiguous in q and a contiguous out and cache")
    n = rows.shape[0]
    for x in (rows, lens, ctxs, tables):
        if x.dtype != torch.int32 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("prefill tables and lengths must be contiguous int32 CPU tensors")
    if lens.shape != (n,) or ctxs.shape != (n,) or tables.dim() != 2 or tables.shape[0] != n:
        raise ValueError(f"{n} chunks but lens {list(lens.shape)}, ctxs {list(ctxs.shape)}, tables {list(tables.shape)}")
    if n and (int(rows.min()) < 0 or int((rows + lens).max()) > t):
        raise ValueError(f"prefill rows outside the step's {t} query rows")
    rc = lib.prefill_attn_bf16(cache.data_ptr(), q.data_ptr(), q.stride(0), out.data_ptr(), tables.data_ptr(),
                               tables.shape[1], rows.data_ptr(), lens.data_ptr(), ctxs.data_ptr(), n, hq, hkv, d, bs,
                               n_blocks, float(scale), torch.get_num_threads())  # fmt: skip
    if rc == 1:
        raise ValueError(f"a prefill chunk's table names a block outside the cache's {n_blocks}, or its lengths do "
                         "not fit its table")
    if rc != 0:
        raise ValueError(f"unsupported prefill: q {list(q.shape)}, cache {list(cache.shape)}")


LINEAR_BLOCK = 16  # output rows per block of ``to_blocked``'s layout (the kernel's 16 fp32 lanes)


@functools.cache
def has_linear_f32() -> bool:
    """Whether the library loaded and this CPU has what its float32 linear kernel is written with
    (AVX-512, or AVX2 with FMA)."""
    return _load() is not None and bool(_lib.have_linear_f32())


@functools.cache
def has_linear_bf16() -> bool:
    """Whether the library loaded and this CPU has what its bf16 linear kernel is written with
    (the bf16 dot instruction, or AVX2 with FMA widening the weights)."""
    return _load() is not None and bool(_lib.have_linear_bf16())


@functools.cache
def has_amx_bf16() -> bool:
    """Whether ``linear_amx`` runs here: built for a CPU with AMX-BF16 (``-march=native``), on
    Linux, which granted this process the tiles."""
    return _load() is not None and bool(_lib.have_amx_bf16())


def set_amx(on: bool) -> None:
    """Whether the C kernels may put work on AMX's tiles (the one-call decode's products, prefill
    attention); at load, unless ``LLMBUS_CPU_AMX=0``. For comparisons: benchmarks and tests."""
    if _load() is not None:
        _lib.set_amx(int(on))


def linear_amx(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``linear`` for a bf16 blocked weight on AMX's tiles (the layout is their operand as it is);
    None where it does not apply (no AMX here, other rows or dtypes, inputs not a multiple of 32)."""
    if (blocked.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or not _fusable(x) or not has_amx_bf16()
            or x.shape[1] % 32 or x.shape[1] != 2 * blocked.shape[1] or bias is not None and bias.dtype != x.dtype):
        return None
    n = blocked.shape[0] * LINEAR_BLOCK
    if bias is not None:
        if bias.numel() != n:
            raise ValueError(f"bias has {bias.numel()} values, the weight {n} outputs")
        bias = bias.contiguous()
    y = torch.empty((x.shape[0], n), dtype=x.dtype)
    rc = _lib.linear_amx_bf16(x.data_ptr(), x.stride(0), blocked.data_ptr(), None if bias is None else bias.data_ptr(),
                              y.data_ptr(), x.shape[0], n, x.shape[1], torch.get_num_threads())  # fmt: skip
    if rc == 3:
        raise MemoryError("linear_amx: out of memory for the padded rows")
    return y if rc == 0 else None


def has_linear(dtype: torch.dtype) -> bool:
    """Whether ``linear`` runs this dtype here (bf16 or float32, by the CPU's instructions)."""
    return has_linear_bf16() if dtype == torch.bfloat16 else dtype == torch.float32 and has_linear_f32()


def linear_supported(weight: torch.Tensor) -> bool:
    """Whether ``linear`` can serve this ``[out, in]`` weight: bf16 (``in`` a multiple of 2) or
    float32, on a CPU with AVX-512 or AVX2 with FMA (bf16's dot instruction where it has one),
    ``out`` a multiple of 16."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.numel() > 0
            and weight.shape[0] % LINEAR_BLOCK == 0 and has_linear(weight.dtype)
            and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0))  # fmt: skip


def to_blocked(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> bf16 ``[N/16, K/2, 16, 2]`` or float32 ``[N/16, K, 16]`` (a copy): the layout
    ``linear`` reads (one weight vector per dot instruction or FMA)."""
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.float32:
        return w.reshape(n // LINEAR_BLOCK, LINEAR_BLOCK, k).transpose(1, 2).contiguous()
    return w.reshape(n // LINEAR_BLOCK, LINEAR_BLOCK, k // 2, 2).transpose(1, 2).contiguous()


def from_blocked(blocked: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_blocked``: the plain ``[N, K]`` weight (a copy)."""
    if blocked.dim() == 3:
        g, k, n = blocked.shape
        return blocked.transpose(1, 2).reshape(g * n, k)
    g, k2, n, two = blocked.shape
    return blocked.transpose(1, 2).reshape(g * n, k2 * two)


def linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for rows ``x [M, K]`` (rows may be strided) of the blocked
    weight's dtype, from the weight blocked by ``to_blocked``. None where the kernel does not apply
    (other rows, a bias of another dtype, no kernel for the dtype here): the caller unblocks."""
    dtype = blocked.dtype
    if not _fusable(x) or x.dtype != dtype or not has_linear(dtype) or (bias is not None and bias.dtype != dtype):
        return None
    k = blocked.shape[1] * (2 if dtype == torch.bfloat16 else 1)
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weight {k}")
    n = blocked.shape[0] * LINEAR_BLOCK
    if bias is not None:
        if bias.numel() != n:
            raise ValueError(f"bias has {bias.numel()} values, the weight {n} outputs")
        bias = bias.contiguous()
    y = torch.empty((x.shape[0], n), dtype=dtype)
    entry = getattr(_lib, f"linear_{_SUFFIX[dtype]}")
    entry(x.data_ptr(), x.stride(0), blocked.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
          x.shape[0], n, x.shape[1], torch.get_num_threads())  # fmt: skip
    return y


DECODE_LAYER_PTRS = 10  # addresses per layer in ``decode_layers``'s table (DL_PTRS in the source)
DECODE_CACHE_PTRS = 5  # addresses per layer's cache (DC_PTRS)
_CACHE_KINDS = {"model": 0, ("int8", torch.float16): 1, ("int8", torch.float32): 2, "int4": 3, "int4r": 4}  # DC_*


def _cache_rows(caches: list, dtype: torch.dtype) -> tuple[int, list[list[int]], tuple[int, int, int, int]]:
    """``decode_layers``' cache kind, each layer's cache addresses (DC_PTRS), and the caches'
    (blocks, block size, KV heads, head dim); ValueError unless every layer's cache is one the
    kernels index blindly: contiguous, of one shape, of the hidden states' dtype (the model's)."""
    first = caches[0]
    if isinstance(first, torch.Tensor):
        if any(c.shape != first.shape or c.dtype != dtype or not c.is_contiguous() or c.device.type != "cpu"
               for c in caches):
            raise ValueError(f"decode_layers needs every layer's cache a contiguous {dtype} CPU tensor of one shape")
        _, n, bs, hkv, d = first.shape
        return 0, [[c.data_ptr(), 0, 0, 0, 0] for c in caches], (n, bs, hkv, d)
    lay, fmt = first.layout, first.fmt.name
    rows = []
    for c in caches:
        if (c.fmt.name != fmt or c.layout != lay or c.num_blocks != first.num_blocks or c.data.device.type != "cpu"
                or c.model_dtype != dtype):
            raise ValueError("decode_layers needs every layer's cache of one format, layout and size, in the model dtype")
        if fmt == "int8":
            if not int8_tensors_fit(c) or c.scale.dtype != first.scale.dtype:
                raise ValueError("decode_layers needs int8 caches' data and scales contiguous, of their layout")
            rows.append([c.data.data_ptr(), c.scale.data_ptr(), 0, 0, 0])
        elif fmt in ("int4", "int4r"):
            if not int4_tensors_fit(c, dtype, tails=True) or c.num_tail_rows != first.num_tail_rows:
                raise ValueError("decode_layers needs int4 caches' tensors contiguous, of their layout, with "
                                 "as many tail rows each")
            tails = [c.k_tail.data_ptr(), c.v_tail.data_ptr()] if c.k_tail is not None else [0, 0]
            rows.append([c.data.data_ptr(), c.k_meta.data_ptr(), c.v_meta.data_ptr(), *tails])
        else:
            raise ValueError("decode_layers takes model-dtype caches as [2, N, bs, Hkv, D] tensors, int8 and int4(r) "
                             f"ones as PagedKVCache; got a {fmt} PagedKVCache")
    kind = _CACHE_KINDS[(fmt, first.scale.dtype) if fmt == "int8" else fmt]
    return kind, rows, (first.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)


# the layer address tables found whole: id -> (the table, weakly; its storage; its version). A
# model's stays the same from step to step, and checking it took a third of decode_layers' Python
# (~20 us a step); an edit in place bumps the version, a new table at a dead one's id fails the ref
_checked_layers: dict[int, tuple[weakref.ref, int, int]] = {}


def _check_layer_addresses(layers: torch.Tensor) -> None:
    known = _checked_layers.get(id(layers))
    if known is not None and known[0]() is layers and known[1:] == (layers.data_ptr(), layers._version):
        return
    if not bool((layers[:, [0, 1, 3, 5, 6, 8]] != 0).all()):
        raise ValueError("every layer needs its norm and projection weights (only biases may be 0)")
    if len(_checked_layers) >= 64:  # a bounded memo, not a registry
        _checked_layers.clear()
    _checked_layers[id(layers)] = (weakref.ref(layers), layers.data_ptr(), layers._version)


def decode_layers(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers: torch.Tensor,
                  caches: list, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                  num_heads: int, intermediate: int, eps: float, scale: float,
                  tail_slots: torch.Tensor | None = None, tail_rows: torch.Tensor | None = None) -> None:
    """Every decoder layer of a step whose tokens are all decodes, in one call (bf16 or float32,
    blocked weights; llmbus/kernels/cpu_decode.c ``decode_layers_*``): ``h [B, H]`` holds the embedded
    tokens and is replaced in place by the last layer's output (bf16: bit-identical to running the
    layers' modules; float32: up to the order of sums); every layer's new keys/values are written
    to its cache. ``layers``: int64 ``[L, 10]``
    addresses per layer (input norm weight, qkv blocked weight, qkv bias, o weight, o bias,
    post-attention norm weight, gate_up weight, gate_up bias, down weight, down bias; 0 for no bias),
    which the caller keeps alive, all of h's dtype. ``caches``: L contiguous ``[2, N, bs, Hkv, D]``
    tensors, or L int8 / int4 / int4r ``PagedKVCache`` (written and read by the kernels the per-layer
    path calls, ``write_int8`` / ``write_int4`` and their decodes, INT4R's rotations and query rounding
    by ``rotate`` / ``round_query``'s: the same bytes); for int4 and int4r,
    ``tail_slots`` / ``tail_rows`` as ``write_int4`` / ``paged_decode_int4`` take them. ``slots``
    ``[B]``; tables/lens from ``prepare_tables``; cos/sin ``B x D/2``."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    b, hidden = h.shape
    dtype = h.dtype
    if dtype not in _SUFFIX or not h.is_contiguous() or h.device.type != "cpu":
        raise ValueError("decode_layers needs contiguous bf16 or float32 CPU hidden states")
    want = (len(caches), DECODE_LAYER_PTRS)
    if layers.dtype != torch.int64 or tuple(layers.shape) != want or not layers.is_contiguous():
        raise ValueError(f"expected int64 {list(want)} layer addresses, got {list(layers.shape)}")
    kind, rows, (n_blocks, bs, hkv, d) = _cache_rows(caches, dtype)
    cos, sin = cos.contiguous(), sin.contiguous()
    if cos.dtype != dtype or sin.dtype != dtype or cos.numel() != b * (d // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be {dtype} with {b} x {d // 2} values")
    slots = slots.to(torch.int64).contiguous()
    if slots.shape != (b,) or tables.dim() != 2 or tables.shape[0] != b or lens.shape != (b,):
        raise ValueError(f"slots {list(slots.shape)}, tables {list(tables.shape)}, lens {list(lens.shape)} do not match "
                         f"{b} decodes")  # fmt: skip
    if tables.dtype != torch.int32 or lens.dtype != torch.int32 or not tables.is_contiguous() or not lens.is_contiguous():
        raise ValueError("block tables and sequence lengths must be contiguous int32")
    if not (cos.is_cpu and sin.is_cpu and slots.is_cpu and tables.is_cpu and lens.is_cpu and layers.is_cpu):
        raise ValueError("decode_layers takes CPU tensors only")
    _check_lens(tables, lens, bs)
    _check_layer_addresses(layers)
    ts = tr = None
    key_slots = gk = gv = 0
    if kind in (_CACHE_KINDS["int4"], _CACHE_KINDS["int4r"]):
        key_slots, gk, gv = _int4_meta_shape(caches[0])
        ts = _int4_tail_slots(caches[0], slots, tail_slots)
        tr = _int4_tail_rows(caches[0], tail_rows, b)
    ptrs = torch.tensor(rows, dtype=torch.int64)
    entry = getattr(lib, f"decode_layers_{_SUFFIX[dtype]}")
    rc = entry(h.data_ptr(), cos.data_ptr(), sin.data_ptr(), layers.data_ptr(), ptrs.data_ptr(), kind,
               ts.data_ptr() if ts is not None else None, tr.data_ptr() if tr is not None else None, key_slots, gk, gv,
               len(caches), slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), b, hidden, num_heads,
               hkv, d, intermediate, bs, n_blocks, float(eps), float(scale), torch.get_num_threads())  # fmt: skip
    if rc == 1:
        raise ValueError(f"a block table names a block outside the cache's {n_blocks}")
    if rc == 2:
        raise ValueError(f"a cache slot lies outside the cache's {n_blocks * bs}")
    if rc == 3:
        raise MemoryError("decode_layers could not allocate its scratch buffers")
    if rc != 0:
        raise ValueError(f"unsupported decode_layers shape: hidden {hidden}, {num_heads}/{hkv} heads of {d}, "
                         f"intermediate {intermediate}, block size {bs}")


def greedy(x: torch.Tensor) -> torch.Tensor | None:
    """The first index of each row's maximum of float32 CPU logits ``x [n, V]`` (rows may be
    strided): int64 ``[n]``, -1 for a row holding a NaN or whose maximum is not finite. None where
    the library is unavailable."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1 or _load() is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib.greedy_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def sample(x: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
           keys: list[int], filtered: torch.Tensor | None = None) -> torch.Tensor | None:
    """One draw per row of float32 CPU logits ``x [n, V]`` (rows may be strided) after the row's
    temperature (> 0), top-k, top-p and min-p (``llmbus.engine.sampler.warp_logits``'s rules), row
    ``i``'s randomness only from ``keys[i]`` (64-bit): int64 ``[n]`` token ids, -1 for a row with no
    finite entry. ``filtered`` (contiguous float32 ``[n, V]``, optional) receives the warped rows.
    None where the library is unavailable."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1 or _load() is None:
        return None
    rows, v = x.shape
    if not len(temperature) == len(top_k) == len(top_p) == len(min_p) == len(keys) == rows:
        raise ValueError(f"per-row parameters must have {rows} entries each")
    if filtered is not None and (filtered.shape != x.shape or filtered.dtype != torch.float32
                                 or not filtered.is_contiguous() or filtered.device.type != "cpu"):  # fmt: skip
        raise ValueError("filtered must be a contiguous float32 CPU tensor shaped like x")
    temps = torch.tensor(temperature, dtype=torch.float32)
    if rows and not bool((temps > 0).all()):
        raise ValueError("sampling temperatures must be > 0")
    ks = torch.tensor([k if 0 < k < v else 0 for k in top_k], dtype=torch.int64)  # 0: no top-k (any int)
    ps, mins = torch.tensor(top_p, dtype=torch.float32), torch.tensor(min_p, dtype=torch.float32)
    k = torch.tensor([key & 0xFFFFFFFFFFFFFFFF for key in keys], dtype=torch.uint64)
    out = torch.empty(rows, dtype=torch.int64)
    rc = _lib.sample_f32(x.data_ptr(), x.stride(0), rows, v, temps.data_ptr(), ks.data_ptr(), ps.data_ptr(),
                         mins.data_ptr(), k.data_ptr(), out.data_ptr(),
                         None if filtered is None else filtered.data_ptr(), torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise MemoryError("the sampler could not allocate its row buffers")
    return out

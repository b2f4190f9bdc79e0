"""Decode step time of the in-process engine on CPU, two variants side by side.

``--compare native`` (default): the fused C kernels against the torch path (``LLMBUS_CPU_NATIVE=0``;
for ``--kv-format int8|int4|int4r`` the torch path is the references). ``--compare gemm``: bf16 weights
in oneDNN's packed layout (``LLMBUS_CPU_GEMM=onednn``) against our blocked kernel's (the default).
``--compare layers``: a decode-only step's layers run module by module (``LLMBUS_CPU_FUSED_LAYERS=0``)
against all of them in one C call (``cpu_native.decode_layers``, the default). ``--compare tails``
(with ``--kv-format int4``): no exact tail rows (``LLMBUS_KV_TAILS=0``) against them. ``--compare
int4`` (with ``--kv-format int4``): int4 blocks dequantized before the kernel
(``LLMBUS_CPU_INT4_FUSED=0``, which also writes them through the torch reference) against inside it.

Each run starts two fresh processes in turn (the baseline, then the variant), which add
``--batch`` random prompts of ``--prompt-len`` tokens, step until every prompt is prefilled and
``--warm-steps`` decode steps have run, then time ``--steps`` decode steps and report the median.
Alternating the two run by run keeps a noisy shared machine's drift out of the ratio.
``--interleave`` (variants chosen when an engine is built: ``tails``) instead builds both engines
in one process and times them in alternating windows of 10 steps, ``--runs`` windows each: a
tighter comparison where separate processes land on different machine states.

    python scripts/bench_cpu_decode.py [--model-dir DIR | --demo large] [--batch 32] [--runs 3] [--temperature 0]
        [--kv-format model|int8|int4|int4r] [--compare native|gemm|layers|tails|int4] [--interleave] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def warm_engine(args, steps: int):
    """An engine with ``--batch`` prompts prefilled and ``--warm-steps`` decode steps run."""
    import torch

    from llmbus.engine.config import EngineConfig
    from llmbus.engine.engine import Engine
    from llmbus.engine.sampling_params import SamplingParams

    config = EngineConfig(max_num_seqs=args.batch, kv_format=args.kv_format, num_threads=args.threads)
    engine = Engine.from_model_dir(str(args.model_dir), config)
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.warm_steps + steps + 64, ignore_eos=True, temperature=args.temperature)
    for i in range(args.batch):
        engine.add_request(f"r{i}", torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist(), params)
    for _ in range(args.warm_steps + -(-args.batch * args.prompt_len // engine.config.max_num_batched_tokens)):
        engine.step()
    return engine


def timed_steps(engine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def child(args) -> dict:
    return {"median_ms": 1000 * statistics.median(timed_steps(warm_engine(args, args.steps), args.steps))}


def interleaved(args) -> list[dict]:
    """Both variants' engines in this one process, timed in alternating windows of 10 steps, so
    the machine's drift falls on both alike. Only for variants chosen when an engine is built."""
    engines = []
    for _, env in VARIANTS[args.compare]:
        os.environ.update(env)
        engines.append(warm_engine(args, args.runs * 10))
    rows = []
    for _ in range(args.runs):
        rows.append({label: 1000 * statistics.median(timed_steps(e, 10))
                     for (label, _), e in zip(VARIANTS[args.compare], engines)})
    return rows


# --compare: (label, environment) of the baseline, then of the variant
VARIANTS = {
    "native": (("torch", {"LLMBUS_CPU_NATIVE": "0"}), ("fused", {"LLMBUS_CPU_NATIVE": "1"})),
    "gemm": (("onednn", {"LLMBUS_CPU_GEMM": "onednn"}), ("blocked", {"LLMBUS_CPU_GEMM": "blocked"})),
    "layers": (("modules", {"LLMBUS_CPU_FUSED_LAYERS": "0"}), ("fused", {"LLMBUS_CPU_FUSED_LAYERS": "1"})),
    "tails": (("no-tails", {"LLMBUS_KV_TAILS": "0"}), ("tails", {"LLMBUS_KV_TAILS": "1"})),
    "int4": (("dequantized", {"LLMBUS_CPU_INT4_FUSED": "0"}), ("fused", {"LLMBUS_CPU_INT4_FUSED": "1"})),
}
INTERLEAVABLE = ("tails",)  # read when an engine is built, so two can live in one process


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--demo", default="large")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--warm-steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--kv-format", default="model", choices=("model", "int8", "int4", "int4r"))
    ap.add_argument("--compare", default="native", choices=tuple(VARIANTS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--interleave", action="store_true",
                    help=f"one process, variants alternating every 10 steps (--compare {'|'.join(INTERLEAVABLE)})")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model_dir is None:
        from llmbus.model.demo import ensure_demo_model

        args.model_dir = ensure_demo_model(args.demo)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.interleave and args.compare not in INTERLEAVABLE:
        ap.error(f"--interleave works with --compare {' or '.join(INTERLEAVABLE)} only")
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--child"]
    if "--model-dir" not in passed:
        passed += ["--model-dir", str(args.model_dir)]
    rows = interleaved(args) if args.interleave else []
    (base, _), (variant, _) = VARIANTS[args.compare]
    for run in range(args.runs):
        if not args.interleave:
            row = {}
            for label, env in VARIANTS[args.compare]:
                out = subprocess.run([sys.executable, __file__, *passed, "--child"], env={**os.environ, **env},
                                     check=True, capture_output=True, text=True).stdout  # fmt: skip
                row[label] = json.loads(out.strip().splitlines()[-1])["median_ms"]
            rows.append(row)
        row = rows[run]
        print(f"run {run + 1}: {base} {row[base]:.1f} ms, {variant} {row[variant]:.1f} ms "
              f"({row[variant] / row[base]:.2f}x)", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model_dir), "batch": args.batch, "prompt_len": args.prompt_len,
                                        "temperature": args.temperature, "kv_format": args.kv_format,
                                        "compare": args.compare, "threads": args.threads,
                                        "interleave": args.interleave, "runs": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

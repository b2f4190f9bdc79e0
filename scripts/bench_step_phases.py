"""Where an in-process decode step's time goes: the engine's host work against the forward.

Runs ``--batch`` greedy requests on the in-process engine (CPU) and, over ``--steps`` decode
steps, times each phase of ``Engine.step`` by wrapping its callees: the scheduler's ``schedule``
and ``update``, the runner's input preparation (``_prepare``: token ids, positions, attention
metadata), the model's forward, the LM head, the sampler; "other" is the rest of the step (the
engine's per-request outputs). Everything but the forward and the LM head is host bookkeeping,
which a GPU does not speed up.

    python scripts/bench_step_phases.py --demo small --batch 64 [--rounds 3] [--out phases.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from llmbus.engine import runner as runner_module
from llmbus.engine import sampler as sampler_module
from llmbus.engine import scheduler as scheduler_module
from llmbus.engine.llm import LLM
from llmbus.engine.sampling_params import SamplingParams
from llmbus.kv.formats import KV_FORMATS
from llmbus.model import llama
from llmbus.model.demo import ensure_demo_model

PHASES = [  # (label, class, method)
    ("schedule", scheduler_module.Scheduler, "schedule"),
    ("prepare", runner_module.ModelRunner, "_prepare"),
    ("forward", runner_module.ModelRunner, "_forward_all"),
    ("lm_head", llama.LlamaForCausalLM, "compute_logits"),
    ("sampler", sampler_module.Sampler, "__call__"),
    ("update", scheduler_module.Scheduler, "update"),
]


def _timed(totals: Counter, label: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", default="small")
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, one after another (contexts grow)")
    ap.add_argument("--kv-format", default="model", choices=KV_FORMATS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model_dir = args.model_dir or ensure_demo_model(args.demo)
    llm = LLM(model_dir, device="cpu", max_num_seqs=args.batch, kv_format=args.kv_format,
              max_model_len=args.prompt_len + args.steps * args.rounds + 32)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.steps * args.rounds + 16, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [(7 * i + j) % 500 + 3 for j in range(args.prompt_len)], params)
    while engine.scheduler.num_waiting or any(s.num_computed_tokens < args.prompt_len for s in engine._seqs.values()):
        engine.step()  # the prompts' prefill, untimed
    for _ in range(5):
        engine.step()
    totals: Counter = Counter()
    for label, cls, name in PHASES:
        setattr(cls, name, _timed(totals, label, getattr(cls, name)))
    rows = []
    for r in range(args.rounds):
        totals.clear()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step = time.perf_counter() - t
        ms = {label: totals[label] / args.steps * 1e3 for label, _, _ in PHASES}
        ms["other"] = (step - sum(totals.values())) / args.steps * 1e3
        ms["host"] = sum(v for k, v in ms.items() if k not in ("forward", "lm_head"))
        ms["step"] = step / args.steps * 1e3
        rows.append(ms)
        print(f"round {r} (context {args.prompt_len + 6 + r * args.steps}+): "
              + " ".join(f"{k} {v:.3f}" for k, v in ms.items()) + " ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(model_dir=str(model_dir), batch=args.batch, kv_format=args.kv_format,
                                            steps=args.steps, rounds=rows), indent=1))


if __name__ == "__main__":
    main()

"""`bench offline --backend vllm`: vllm's offline engine on a bench dataset, same report shape.

Run with the vllm venv's python (vllm lives in its own venv; this imports only the torch-free
parts of llmbus.bench from this checkout):
    .peers/vllm-venv/bin/python scripts/peers/vllm_offline.py --model DIR --dataset random --out r.json
Each token is timed through the engine's step API (`llm.llm_engine.add_request/step`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import deque

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from llmbus.bench.args import add_dataset_args, dataset_summary, load_items, rate  # noqa: E402
from llmbus.bench.arrivals import ArrivalProcess  # noqa: E402
from llmbus.bench.metrics import summarize  # noqa: E402
from llmbus.bench.offline import TokenClock, wait_until  # noqa: E402
from llmbus.bench.progress import Progress  # noqa: E402
from llmbus.bench.report import format_table, make_report, write_report  # noqa: E402
from llmbus.bench.slo import SLO  # noqa: E402


def run(args) -> int:
    from vllm import LLM, SamplingParams

    items, warmup, _ = load_items(args, args.model)
    arrivals = ArrivalProcess(rate=args.request_rate, process=args.arrival or ("gamma" if args.burstiness else "poisson"),
                              burstiness=args.burstiness or 1.0)
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=args.seed,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching)
    if warmup:  # unmeasured
        llm.generate([{"prompt_token_ids": it.prompt_token_ids} for it in warmup],
                     SamplingParams(max_tokens=warmup[0].output_len, temperature=0.0, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    params = [SamplingParams(max_tokens=it.output_len, temperature=args.temperature, top_p=args.top_p,
                             ignore_eos=args.ignore_eos)
              for it in items]
    schedule = arrivals.schedule(len(items), args.seed)
    bar = Progress(len(items), "vllm offline", enabled=not args.no_progress)
    cpu0 = time.process_time()
    clock = TokenClock(items, schedule)
    pending, seen = deque(range(len(items))), {}
    while pending or engine.has_unfinished_requests():
        while pending and schedule[pending[0]] <= clock.now():
            i = pending.popleft()
            clock.start(i)
            engine.add_request(f"bench-{i}", {"prompt_token_ids": items[i].prompt_token_ids}, params[i])
        if not engine.has_unfinished_requests():
            wait_until(clock, schedule[pending[0]])
            continue
        outs = engine.step()
        at = clock.now()
        for o in outs:
            i = int(o.request_id.split("-")[-1])
            n = len(o.outputs[0].token_ids)  # cumulative output by default
            clock.tokens(i, n - seen.get(i, 0), at)
            seen[i] = n
            if o.finished:
                clock.records[i].cached_tokens = o.num_cached_tokens
                clock.finish(i, at)
                bar.update(clock.records[i].success)
    duration, cpu = max(clock.now(), 1e-9), time.process_time() - cpu0
    # NOTE: vllm computes in an engine-core subprocess; this process's CPU time undercounts it
    # unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (the default this script sets).
    summary = summarize(clock.records, duration, SLO.parse(args.slo), cpu_s=cpu)
    cfg = {k: v for k, v in vars(args).items()}
    cfg["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    cfg["dataset"] = dataset_summary(args, items)
    report = make_report("offline", args.label or "offline-vllm", cfg, clock.records, summary)
    print(format_table(report))
    if args.out:
        write_report(report, args.out)
        print(f"report: {args.out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--request-rate", type=rate, default=math.inf)
    p.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default=None)
    p.add_argument("--burstiness", type=float, default=None)
    p.add_argument("--slo", nargs="+")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--label")
    p.add_argument("--out")
    p.add_argument("--no-progress", action="store_true")
    add_dataset_args(p)
    args = p.parse_args()
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"vllm_offline: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # NOTE: vllm's workers re-import the main module; keep this guard
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

"""`llmbus bench serve|offline|compare`: argument parsing only; the work lives in the modules."""

from __future__ import annotations

import argparse
import math
import os
import sys

from llmbus import aio
from llmbus.bench.args import add_dataset_args, dataset_summary, load_items, rate


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a server or the in-process engine")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    s = sub.add_parser("serve", help="load-test an OpenAI-compatible endpoint (streaming)")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", required=True, help="model name the server serves")
    s.add_argument("--tokenizer", required=True, help="model directory (or tokenizer.json) to build prompts with")
    s.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    s.add_argument("--prompt-format", choices=("text", "ids"), default="text", help="completions: send text or token ids")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--extra-body", type=_json_object, default={}, help='JSON merged into each request, e.g. \'{"min_tokens": 8}\'')
    s.add_argument("--server-pid", type=int, action="append", help="count this process tree's CPU time (repeatable)")
    s.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    _common(s)
    add_dataset_args(s)
    s.set_defaults(func=_serve)

    o = sub.add_parser("offline", help="run the in-process engine (or HF static batches) on a dataset")
    o.add_argument("--model", required=True, help="model directory")
    o.add_argument("--backend", choices=("llmbus", "hf"), default="llmbus",
                   help="llmbus: the in-process engine; hf: transformers static batches. For vllm run "
                        "scripts/peers/vllm_offline.py with the vllm venv's python (docs/benchmarks.md)")
    o.add_argument("--batch-size", type=int, default=8, help="hf: static batch size")
    o.add_argument("--dtype", default=None)
    o.add_argument("--max-num-seqs", type=int, default=64)
    o.add_argument("--max-num-batched-tokens", type=int, default=2048)
    o.add_argument("--no-chunked-prefill", action="store_true")
    o.add_argument("--no-prefix-caching", action="store_true")
    o.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    o.add_argument("--max-concurrency", action=_ServeOnly, default=None, help=argparse.SUPPRESS)
    _common(o)
    add_dataset_args(o)
    o.set_defaults(func=_offline)

    c = sub.add_parser("compare", help="compare reports side by side (ratios to the first)")
    c.add_argument("baseline", metavar="REPORT", help="the report the others are compared to")
    c.add_argument("reports", nargs="+", metavar="REPORT")
    c.add_argument("--chart", help="PNG path (needs matplotlib)")
    c.add_argument("--markdown", action="store_true", help="print a markdown table")
    c.add_argument("--update-doc", help="markdown file whose <!-- bench:SECTION --> block to refresh")
    c.add_argument("--section", help="section name for --update-doc")
    c.set_defaults(func=_compare)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-rate", type=rate, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default=None,
                   help="default: poisson, or gamma when --burstiness is given")
    p.add_argument("--burstiness", type=float, default=None, help="gamma shape: 1 Poisson, <1 burstier")
    p.add_argument("--slo", nargs="+", metavar="METRIC:MS", help="goodput objectives, e.g. ttft:500 tpot:50")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the requested output lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    p.add_argument("--cpus", help="pin this process to these cores, e.g. 1 or 0-1")
    p.add_argument("--label", default=None, help="name in reports and comparisons")
    p.add_argument("--out", help="JSON report path")
    p.add_argument("--chart", help="PNG chart path (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")


class _ServeOnly(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} applies to `bench serve` only "
                     "(offline: --max-num-seqs for llmbus, --batch-size for hf)")


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _arrivals(args):
    from llmbus.bench.arrivals import ArrivalProcess

    process = args.arrival or ("gamma" if args.burstiness is not None else "poisson")
    return ArrivalProcess(rate=args.request_rate, process=process,
                          burstiness=1.0 if args.burstiness is None else args.burstiness)


def _pin(spec: str | None) -> None:
    if not spec:
        return
    cores: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, cores)
    except (ValueError, OSError) as exc:
        raise ValueError(f"bad --cpus {spec!r}: {exc}") from None


def _check_outputs(args) -> None:
    """What the run will be asked to write is checked before the run, not after it."""
    if args.chart:
        from llmbus.bench.chart import require

        require()


def _finish(args, kind: str, label: str, config: dict, records, summary) -> int:
    from llmbus.bench.chart import draw
    from llmbus.bench.report import format_table, make_report, write_report

    report = make_report(kind, label, config, records, summary)
    print(format_table(report))
    if args.out:
        write_report(report, args.out)
        print(f"report: {args.out}")
    if args.chart:
        msg = draw([report], args.chart)
        print(msg or f"chart: {args.chart}", file=sys.stderr if msg else sys.stdout)
    if not summary["completed"]:
        first = next((r.error for r in records if r.error), "")  # e.g. the server unreachable, an unknown model
        print(f"llmbus bench {kind}: no request succeeded" + (f"; the first failed with: {first[:500]}" if first else ""),
              file=sys.stderr)
        return 1
    return 0


def _config(args, items) -> dict:
    skip = {"func", "api_key", "command", "bench_command"}
    cfg = {k: v for k, v in vars(args).items() if k not in skip}
    cfg["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    cfg["dataset"] = dataset_summary(args, items)
    return cfg


def _serve(args) -> int:
    from llmbus.bench.client import RequestConfig
    from llmbus.bench.serve import LoadConfig, run_serve
    from llmbus.bench.slo import SLO

    _pin(args.cpus)
    _check_outputs(args)
    slo = SLO.parse(args.slo)
    req = RequestConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint,
                        prompt_format=args.prompt_format, ignore_eos=args.ignore_eos,
                        temperature=args.temperature, top_p=args.top_p, api_key=args.api_key, timeout_s=args.timeout,
                        extra_body=args.extra_body)
    load = LoadConfig(arrivals=_arrivals(args), max_concurrency=args.max_concurrency, seed=args.seed,
                      progress=not args.no_progress)
    items, warmup, _ = load_items(args, args.tokenizer)
    records, summary = aio.run(run_serve(req, load, items, warmup=warmup, slo=slo, server_pids=args.server_pid))
    label = args.label or f"{args.model}@{args.base_url}"
    return _finish(args, "serve", label, _config(args, items), records, summary)


def _offline(args) -> int:
    from llmbus.bench.metrics import summarize
    from llmbus.bench.offline import run_hf, run_llmbus
    from llmbus.bench.slo import SLO

    _pin(args.cpus)
    _check_outputs(args)
    slo = SLO.parse(args.slo)
    arrivals = _arrivals(args)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    items, warmup, _ = load_items(args, args.model)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.backend == "hf":
        records, duration, cpu = run_hf(args.model, items, arrivals, args.seed, batch_size=args.batch_size,
                                        ignore_eos=args.ignore_eos, temperature=args.temperature, top_p=args.top_p,
                                        dtype=args.dtype or "float32", warmup=warmup, progress=not args.no_progress)
    else:
        kw = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_chunked_prefill=not args.no_chunked_prefill, enable_prefix_caching=not args.no_prefix_caching)
        records, duration, cpu = run_llmbus(args.model, items, arrivals, args.seed, ignore_eos=args.ignore_eos,
                                            temperature=args.temperature, top_p=args.top_p, engine_kwargs=kw,
                                            warmup=warmup, progress=not args.no_progress)
    summary = summarize(records, duration, slo, cpu_s=cpu)
    label = args.label or f"offline-{args.backend}"
    return _finish(args, "offline", label, _config(args, items), records, summary)


def _compare(args) -> int:
    from llmbus.bench.chart import draw
    from llmbus.bench.compare import format_comparison, load_reports, update_doc

    if args.update_doc and not args.section:
        raise ValueError("--update-doc needs --section NAME")
    _check_outputs(args)
    reports = load_reports([args.baseline, *args.reports])
    print(format_comparison(reports, markdown=args.markdown))
    if args.update_doc:
        update_doc(args.update_doc, args.section, format_comparison(reports, markdown=True))
        print(f"refreshed section {args.section!r} of {args.update_doc}")
    if args.chart:
        msg = draw(reports, args.chart)
        print(msg or f"chart: {args.chart}", file=sys.stderr if msg else sys.stdout)
    return 0

"""Command-line options shared by `bench serve`, `bench offline` and the peers' offline scripts."""

from __future__ import annotations

import argparse
import math

from llmbus.bench.datasets import DATASETS, BenchItem, DatasetConfig, build_dataset
from llmbus.bench.tokens import BenchTokenizer


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--num-prompts", type=int, default=64, help="requests (mixed, random)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--input-len", type=int, default=256, help="prompt tokens (short ones for mixed; per turn for multi-turn)")
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1-r)..len*(1+r)")
    g.add_argument("--groups", type=int, default=4, help="shared-prefix: groups")
    g.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: prompts per group")
    g.add_argument("--system-len", type=int, default=512, help="shared-prefix: shared system prompt tokens")
    g.add_argument("--question-len", type=int, default=64, help="shared-prefix: question tokens")
    g.add_argument("--long-share", type=float, default=0.1, help="mixed: share of long-prompt requests")
    g.add_argument("--long-input-len", type=int, default=2048, help="mixed: long prompt tokens")
    g.add_argument("--long-output-len", type=int, default=16, help="mixed: long request output tokens")
    g.add_argument("--conversations", type=int, default=8, help="multi-turn: conversations")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument("--warmup", type=int, default=0, help="unmeasured warm-up requests (from another seed)")


def dataset_config(args: argparse.Namespace, *, seed: int | None = None, num_prompts: int | None = None) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset, num_prompts=num_prompts or args.num_prompts,
        seed=args.seed if seed is None else seed, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, groups=args.groups, prompts_per_group=args.prompts_per_group,
        system_len=args.system_len, question_len=args.question_len, long_share=args.long_share,
        long_input_len=args.long_input_len, long_output_len=args.long_output_len,
        conversations=args.conversations, turns=args.turns)


def load_items(args: argparse.Namespace, tokenizer_path: str) -> tuple[list[BenchItem], list[BenchItem], BenchTokenizer]:
    """(measured items, warm-up items, tokenizer). Warm-up items are a random dataset drawn from a
    different seed, so they never warm the measured prompts' prefix cache."""
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    tok = BenchTokenizer(tokenizer_path)
    items = build_dataset(dataset_config(args), tok)
    warmup: list[BenchItem] = []
    if args.warmup:
        wcfg = DatasetConfig(name="random", num_prompts=args.warmup, seed=args.seed + 1_000_003,
                             input_len=min(args.input_len, 128), output_len=min(args.output_len, 16))
        warmup = build_dataset(wcfg, tok)
    return items, warmup, tok


def rate(value: str) -> float:
    """argparse type for --request-rate: a positive number or inf."""
    try:
        r = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rate must be a number or inf, got {value!r}") from None
    if not (r > 0 or math.isinf(r)):
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {value!r}")
    return r


def dataset_summary(args: argparse.Namespace, items: list[BenchItem]) -> dict:
    cfg = vars(dataset_config(args)).copy()
    cfg["warmup"] = args.warmup
    cfg["mean_prompt_len"] = sum(i.prompt_len for i in items) / len(items) if items else 0
    cfg["mean_output_len"] = sum(i.output_len for i in items) / len(items) if items else 0
    return cfg

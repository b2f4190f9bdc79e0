"""Command-line options shared by the engine-driving services (prefill, decode)."""

from __future__ import annotations

import argparse

from llmbus.engine.config import KV_FORMATS, EngineConfig


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``NAME=DIR`` -> (name, dir). A bare ``DIR`` is named by its last path component."""
    name, sep, path = spec.partition("=")
    if not sep:
        path = spec
        name = spec.rstrip("/").rsplit("/", 1)[-1]
    if not name or not path:
        raise ValueError(f"--model must be NAME=DIR, got {spec!r}")
    return name, path


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="NAME=DIR: the served name and its Hugging Face directory")
    parser.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--kv-format", default="model", choices=KV_FORMATS)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks in this worker's cache")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--long-prefill-threshold", type=int, default=0,
                        help="cap on one prefill chunk (0: the whole step budget)")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads for this worker")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        long_prefill_token_threshold=args.long_prefill_threshold,
        enable_prefix_caching=not args.no_prefix_cache,
        enable_chunked_prefill=not args.no_chunked_prefill,
        kv_format=args.kv_format,
        num_threads=args.threads,
    )

"""`python -m services.prefill --nats-url URL --model NAME=DIR [engine options]`."""

from __future__ import annotations

import dataclasses
import sys

from llmbus.engine.config import EngineConfig
from llmbus.worker.main import worker_main
from services.prefill.service import PrefillWorker


def add_args(parser) -> None:
    parser.add_argument("--colocated", action="store_true",
                        help="decode here too instead of handing off to the decode pool (no decode workers needed)")


def adjust(config: EngineConfig, args) -> EngineConfig:
    """A prefill worker that hands off never runs decode-only steps: no CUDA graphs to record,
    unless asked for."""
    if args.colocated or config.cuda_graphs is not None:
        return config
    return dataclasses.replace(config, cuda_graphs=False)


if __name__ == "__main__":
    sys.exit(worker_main("prefill", lambda ctx, engine, name, args: PrefillWorker(
        ctx, engine, name, colocated=args.colocated, drain_s=args.drain_timeout).run(), add_args=add_args, adjust=adjust))

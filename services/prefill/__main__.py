"""`python -m services.prefill --nats-url URL --model NAME=DIR [engine options]`."""

from __future__ import annotations

import sys

from llmbus.worker.main import worker_main
from services.prefill.service import PrefillWorker


def add_args(parser) -> None:
    parser.add_argument("--colocated", action="store_true",
                        help="decode here too instead of handing off to the decode pool (no decode workers needed)")


if __name__ == "__main__":
    sys.exit(worker_main("prefill", lambda ctx, engine, name, args: PrefillWorker(
        ctx, engine, name, colocated=args.colocated).run(), add_args=add_args))

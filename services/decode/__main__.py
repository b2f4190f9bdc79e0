"""`python -m services.decode --nats-url URL --model NAME=DIR [engine options]`."""

from __future__ import annotations

import sys

from llmbus.worker.main import worker_main
from services.decode.service import DecodeWorker

if __name__ == "__main__":
    sys.exit(worker_main("decode", lambda ctx, engine, name, args: DecodeWorker(ctx, engine, name, drain_s=args.drain_timeout).run()))

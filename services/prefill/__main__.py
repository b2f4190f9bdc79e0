"""`python -m services.prefill --nats-url URL --model NAME=DIR [engine options]`."""

from __future__ import annotations

import sys

from llmbus.worker.main import worker_main
from services.prefill.service import PrefillWorker

if __name__ == "__main__":
    sys.exit(worker_main("prefill", lambda ctx, engine, name: PrefillWorker(ctx, engine, name).run()))

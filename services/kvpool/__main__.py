"""`python -m services.kvpool --nats-url URL --block-bytes N --capacity-blocks N`."""

from __future__ import annotations

import argparse
import asyncio
import sys

from llmbus.bus.service import ServiceOptions, add_common_args, run_service, setup_logging
from services.kvpool.config import KVPoolConfig
from services.kvpool.service import KVPool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.kvpool", description="llmbus kvpool (CPU tier)")
    add_common_args(parser)
    parser.add_argument("--block-bytes", type=int, required=True,
                        help="bytes per block: KVLayout.bytes_per_block of the served model")  # fmt: skip
    parser.add_argument("--capacity-blocks", type=int, required=True, help="blocks in the shared-memory CPU tier")
    parser.add_argument("--max-ttl", type=float, default=3600.0, help="longest lease TTL a client may ask for, seconds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        setup_logging(args.log_level)
        config = KVPoolConfig(args.block_bytes, args.capacity_blocks, max_ttl_s=args.max_ttl)
        options = ServiceOptions(role="kvpool", nats_url=args.nats_url, instance_id=args.instance_id)
    except ValueError as exc:
        print(f"kvpool: error: {exc}", file=sys.stderr)
        return 2

    async def body(ctx):
        await KVPool(ctx, config).run()

    try:
        return asyncio.run(run_service(options, body))
    except ConnectionError as exc:
        print(f"kvpool: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

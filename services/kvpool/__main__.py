"""`python -m services.kvpool --nats-url URL --block-bytes N --capacity-blocks N
[--kv-layout L,H,D,BS,DTYPE --kv-format F --cpu-format F --cpu-bytes N --ssd-format F --ssd-bytes N --data-dir DIR]`.

With ``--kv-layout`` kvpool also runs the prefix cache (index, CPU tier, SSD tier)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from llmbus.bus.service import ServiceOptions, add_common_args, serve, setup_logging
from services.kvpool.config import KVPoolConfig, PrefixConfig, parse_layout
from services.kvpool.service import KVPool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.kvpool", description="llmbus kvpool (CPU tier)")
    add_common_args(parser)
    parser.add_argument("--block-bytes", type=int, required=True,
                        help="bytes per block: KVLayout.bytes_per_block of the served model")  # fmt: skip
    parser.add_argument("--capacity-blocks", type=int, required=True, help="blocks in the shared-memory CPU tier")
    parser.add_argument("--max-ttl", type=float, default=3600.0, help="longest lease TTL a client may ask for, seconds")
    g = parser.add_argument_group("prefix cache (off unless --kv-layout is given)")
    g.add_argument("--kv-layout", default="", help="LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE,DTYPE of the served model")
    g.add_argument("--kv-format", default="model", help="the workers' (tier-0) KV format: model, int8, int4, int4r")
    g.add_argument("--cpu-format", default="same", help="CPU tier format: same (as tier 0), model, int8, int4, int4r")
    g.add_argument("--cpu-bytes", type=int, default=1 << 30, help="CPU tier budget in bytes (shared memory)")
    g.add_argument("--ssd-format", default="same", help="SSD tier format: same, model, int8, int4, int4r")
    g.add_argument("--ssd-bytes", type=int, default=0, help="SSD tier budget in bytes (0: no SSD tier)")
    g.add_argument("--data-dir", default="", help="the SSD tier keeps its block files under DATA_DIR/kvpool-ssd")
    return parser.parse_args(argv)


def _check_ssd_dir(ssd: Path | None, data_dir: str) -> None:
    """The SSD tier's directory exists (made now) and is writable."""
    if ssd is None:
        raise ValueError("--ssd-bytes needs --data-dir")
    try:
        ssd.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--data-dir {data_dir}: cannot hold the SSD tier ({exc})") from None
    if not os.access(ssd, os.W_OK):
        raise ValueError(f"--data-dir {data_dir}: {ssd} is not writable")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        setup_logging(args.log_level)
        prefix = None
        if args.ssd_bytes and not args.kv_layout:
            raise ValueError("--ssd-bytes needs --kv-layout (the prefix cache it serves)")
        if args.kv_layout:
            ssd = Path(args.data_dir) / "kvpool-ssd" if args.data_dir else None
            if args.ssd_bytes:  # NOTE: checked before connecting, not when the first block is stored
                _check_ssd_dir(ssd, args.data_dir)
            prefix = PrefixConfig(parse_layout(args.kv_layout), args.kv_format, args.cpu_format, args.cpu_bytes,
                                  args.ssd_format, args.ssd_bytes, ssd)  # fmt: skip
        config = KVPoolConfig(args.block_bytes, args.capacity_blocks, max_ttl_s=args.max_ttl, prefix=prefix)
        options = ServiceOptions(role="kvpool", nats_url=args.nats_url, instance_id=args.instance_id)
    except ValueError as exc:
        print(f"kvpool: error: {exc}", file=sys.stderr)
        return 2

    async def body(ctx):
        await KVPool(ctx, config).run()

    return serve(options, body)


if __name__ == "__main__":
    sys.exit(main())

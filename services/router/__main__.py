"""`python -m services.router --nats-url URL [--models a,b] [--long-threshold N] [--no-kv-routing]
[--max-imbalance N] [--whole-threshold N]`."""

from __future__ import annotations

import argparse
import sys

from llmbus.bus.service import ServiceOptions, add_common_args, serve, setup_logging
from services.router.policy import RoutingPolicy
from services.router.service import Router


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.router", description="llmbus router")
    add_common_args(parser)
    parser.add_argument("--models", default="", help="served model names, comma-separated "
                        "(default: the models live prefill instances report)")  # fmt: skip
    parser.add_argument("--long-threshold", type=int, default=1024,
                        help="prompts with more tokens than this take the long lane")  # fmt: skip
    parser.add_argument("--no-kv-routing", dest="kv_routing", action="store_false",
                        help="send every request to its lane, never to the prefill worker that caches its prefix")
    parser.add_argument("--max-imbalance", type=int, default=2,
                        help="KV routing: requests a worker may hold beyond the least busy one and still be "
                             "sent one for its cached prefix")
    parser.add_argument("--whole-threshold", type=int, default=128,
                        help="prompts of at most this many tokens skip the prefill pool: a decode worker prefills "
                             "and decodes them whole, with no handoff (0: never)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        setup_logging(args.log_level)
        models = tuple(m.strip() for m in args.models.split(",") if m.strip())
        policy = RoutingPolicy(models=models, long_threshold=args.long_threshold, kv_routing=args.kv_routing,
                               max_imbalance=args.max_imbalance, whole_threshold=args.whole_threshold)  # fmt: skip
        options = ServiceOptions(role="router", nats_url=args.nats_url, instance_id=args.instance_id, models=models)
    except ValueError as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2

    async def body(ctx):
        await Router(ctx, policy).run()

    return serve(options, body)


if __name__ == "__main__":
    sys.exit(main())

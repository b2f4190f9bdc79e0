"""The command line of an engine-driving service: parse, load the model, run the service body."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
from collections.abc import Awaitable, Callable

from llmbus.bus.service import ServiceOptions, add_common_args, serve, setup_logging
from llmbus.engine.config import EngineConfig, add_engine_args, engine_config_from_args
from llmbus.worker.base import DRAIN_S
from llmbus.worker.options import parse_model_spec


def worker_main(role: str, body: Callable[..., Awaitable[None]], argv: list[str] | None = None,
                add_args: Callable[[argparse.ArgumentParser], None] | None = None,
                adjust: Callable[[EngineConfig, argparse.Namespace], EngineConfig] | None = None) -> int:
    """``body(ctx, engine, model_name, args)`` runs the service; ``add_args`` adds role-specific
    options; ``adjust`` returns the engine config the role wants from the parsed one."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{role}", description=f"llmbus {role} worker")
    add_common_args(parser)
    parser.add_argument("--model", required=True, help="NAME=DIR: the served name and its Hugging Face directory")
    add_engine_args(parser)
    parser.add_argument("--drain-timeout", type=float, default=DRAIN_S, metavar="S",
                        help="at SIGINT/SIGTERM, take nothing new and let the requests held finish for up to S "
                             f"seconds (default {DRAIN_S:.0f}; a second signal stops at once)")  # fmt: skip
    if add_args is not None:
        add_args(parser)
    args = parser.parse_args(argv)
    try:
        setup_logging(args.log_level)
        name, path = parse_model_spec(args.model)
        if args.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
        config = engine_config_from_args(args)
        if config.warmup is None:  # NOTE: on CPU too: the first burst must not pay a full step's page faults
            config = dataclasses.replace(config, warmup=True)
        if adjust is not None:
            config = adjust(config, args)
        options = ServiceOptions(role=role, nats_url=args.nats_url, instance_id=args.instance_id, models=(name,))
        from llmbus.engine.engine import Engine
        from llmbus.engine.omp import on_own_thread, serial_here

        serial_here()  # the engine thread alone computes with OpenMP (llmbus.engine.omp says why)
        engine = on_own_thread(lambda: Engine.from_model_dir(path, config))
        # NOTE: the guided-decoding index, built while the worker connects and registers
        threading.Thread(target=engine.prepare_guides, name="guide-index", daemon=True).start()
    except (ValueError, FileNotFoundError) as exc:
        print(f"{role}: error: {exc}", file=sys.stderr)
        return 2

    async def run(ctx):
        await body(ctx, engine, name, args)

    return serve(options, run)

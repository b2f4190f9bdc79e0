"""The `llmbus` command. Each subcommand lives with the code it drives and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# module path -> it exposes `register(subparsers)`; each registered parser sets `func(args) -> int`
_COMMANDS = (
    "llmbus.model.cli",
    "llmbus.engine.cli",
    "llmbus.bench.cli",
    "llmbus.launch",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmbus", description="LLM inference over NATS JetStream")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # bad input, or a path that cannot be read or written
        print(f"llmbus {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

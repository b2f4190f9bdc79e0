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
    "llmbus.top",
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
    _own_errors(parser)
    return parser


def _own_errors(parser: argparse.ArgumentParser) -> None:
    """Each (nested) subcommand's parser names itself in its namespace: main's unknown-argument
    error then prints that subcommand's usage."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.set_defaults(_parser=command)
                _own_errors(command)


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    own = vars(args).pop("_parser")  # NOTE: out of the namespace, which commands may record (bench reports)
    if unknown:  # NOTE: parse_args would print the top-level usage, not the subcommand's
        own.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # bad input, or a path that cannot be read or written
        print(f"llmbus {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

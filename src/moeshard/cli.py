"""``moeshard`` command line: check, backends, run, bench, eplb.

Each subcommand lives in ``moeshard.commands.<name>`` and exposes ``add_parser(subparsers)``,
which registers its options and sets ``func(args) -> int`` (the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("check", "backends", "run", "bench", "eplb")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"moeshard.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        # Refusals of bad input are ValueErrors with a complete message; no traceback needed.
        print(f"moeshard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moeshard {args.command}: interrupted", file=sys.stderr)
        return 130

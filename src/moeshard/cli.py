"""``moeshard`` command line: check, backends, run, bench, generate, eplb.

Each subcommand lives in ``moeshard.commands.<name>`` and exposes ``add_parser(subparsers)``,
which registers its options and sets ``func(args) -> int`` (the exit code).

``main`` turns every expected failure into one line on stderr and an exit code of
``moeshard.errors.ExitCode`` (the table is in that module and in docs/reliability.md):
a refusal (``ValueError``) 2, nothing verified 3, a rank that failed or died 4, one that timed
out 5, an output that could not be written 6, SIGINT 130, SIGTERM 143. SIGTERM is handled like
Ctrl-C: it raises in the main thread, so every rank is stopped on the way out.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from moeshard.errors import ExitCode, MoeshardError, Terminated

COMMANDS = ("check", "backends", "run", "bench", "generate", "eplb")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"moeshard.commands.{name}").add_parser(sub)
    return parser


def _one_line(text: str) -> str:
    return " | ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


def _on_sigterm(signum: int, frame: object) -> None:
    # Once: a second SIGTERM while the ranks are being stopped must not cut the clean-up short
    # (the ranks die with this process anyway: see moeshard.parallel.worker).
    signal.signal(signum, signal.SIG_IGN)
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from moeshard.parallel.spawn import RankFailure  # after parsing: --help stays fast

    def error(message: str, code: ExitCode) -> int:
        print(f"moeshard {args.command}: error: {_one_line(message)}", file=sys.stderr)
        return int(code)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    try:
        return int(args.func(args))
    except ValueError as exc:
        # Refusals of bad input are ValueErrors with a complete message; no traceback needed.
        return error(str(exc), ExitCode.REFUSED)
    except MoeshardError as exc:
        return error(str(exc), exc.exit_code)
    except RankFailure as exc:
        return error(exc.summary, ExitCode.RANK_TIMEOUT if exc.timed_out else ExitCode.RANK_FAILED)
    except Terminated as exc:
        print(f"moeshard {args.command}: terminated by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return int(ExitCode.TERMINATED)
    except KeyboardInterrupt:
        print(f"moeshard {args.command}: interrupted", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

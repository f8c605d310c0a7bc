"""``moeshard`` command line: check, backends, families, run, bench, generate, train, eplb.

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
import contextlib
import importlib
import os
import signal
import sys
import threading
import warnings

from moeshard.errors import ExitCode, MoeshardError, Terminated

COMMANDS = ("check", "backends", "families", "run", "bench", "generate", "train", "eplb")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"moeshard.commands.{name}").add_parser(sub)
    return parser


def _one_line(text: str) -> str:
    return " | ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warning_shower(command: str, default):
    """``warnings.showwarning`` for one command: a warning raised by moeshard's own code (a
    world started again after gloo failed to connect, say) is one line, ``moeshard check:
    warning: ...``; any other library's keeps its usual form."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not os.path.abspath(filename).startswith(_PACKAGE_DIR):
            default(message, category, filename, lineno, file, line)
            return
        print(f"moeshard {command}: warning: {_one_line(str(message))}", file=file or sys.stderr)
    return show


def _on_sigterm(signum: int, frame: object) -> None:
    # Once: a second SIGTERM while the ranks are being stopped must not cut the clean-up short
    # (the ranks die with this process anyway: see moeshard.parallel.worker).
    signal.signal(signum, signal.SIG_IGN)
    raise Terminated(signum)


class _WatchedStdout:
    """The standard output, unchanged, except that it remembers a write or flush that failed
    (``> /dev/full``, a closed pipe), so that ``main`` can tell that failure from any other
    OSError: the first is an expected one (exit code 6), the second a bug."""

    def __init__(self, inner) -> None:
        self.inner, self.failed = inner, False

    def write(self, text: str) -> int:
        try:
            return self.inner.write(text)
        except OSError:
            self.failed = True
            raise

    def flush(self) -> None:
        try:
            self.inner.flush()
        except OSError:
            self.failed = True
            raise

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _silence(stream: object) -> None:
    """Points the process's standard output at the null device, so the interpreter's own flush
    at exit does not fail a second time on what is still buffered."""
    if stream is sys.__stdout__ and sys.__stdout__ is not None:
        stream = sys.__stdout__
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)


def entry() -> int:
    """The ``moeshard`` command (and ``python -m moeshard``): ``main``'s exit code. Where a torchrun
    rendezvous that ``init_from_env`` gave up on is still inside torch's C++ store client, the
    process ends here, its output flushed, instead of finalizing the interpreter around that
    thread: when the client then fails, it aborts the process (SIGABRT, exit 134), which lost
    the exit code and added a C++ backtrace after the one error line in 3 of 8 runs against an
    unreachable MASTER_PORT on a loaded 2-core machine."""
    code = main()
    from moeshard.parallel.torchrun import rendezvous_pending

    if rendezvous_pending():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from moeshard.parallel.spawn import RankFailure  # after parsing: --help stays fast

    def error(message: str, code: ExitCode) -> int:
        print(f"moeshard {args.command}: error: {_one_line(message)}", file=sys.stderr)
        return int(code)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    stdout = _WatchedStdout(sys.stdout)
    sys.stdout = stdout
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_shower(args.command, warnings.showwarning)
            code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit: a full disk under > FILE is this command's failure
        return code
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
    except OSError as exc:
        if not stdout.failed:
            raise  # not an expected failure: keep the traceback
        sys.stdout = stdout.inner
        _silence(stdout.inner)
        return error(f"cannot write the standard output: {exc.strerror or exc}", ExitCode.OUTPUT)
    finally:
        sys.stdout = stdout.inner
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

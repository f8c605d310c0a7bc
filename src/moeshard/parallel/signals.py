"""Signals around local ranks: Ctrl-C / SIGTERM deferred while ranks start, SIGINT blocked for
the processes started (the parent answers it for all of them), and a SIGALRM deadline for work
run in this process (a one-rank world, which starts no rank and so has no ``LocalWorld``
deadline)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from moeshard.errors import TimedOut
from moeshard.validate import timeout


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...]) -> Iterator[None]:
    """In the main thread (where Python runs signal handlers): the signals in ``signums`` that
    arrive inside the block are recorded, then raised again once it is left, so they reach
    their usual handlers (KeyboardInterrupt, moeshard's SIGTERM handler) after it. Elsewhere a
    no-op: the main thread's handlers cannot interrupt another thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.getsignal(s) for s in signums}
    previous = {s: h for s, h in previous.items() if h is not None}  # None: a handler not set from Python
    for s in previous:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread inside the block, so processes started here inherit it blocked."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def in_process_deadline(timeout_s: float, what: str, flag: str = "--timeout") -> Iterator[None]:
    """Bounds the block, work of a one-rank world run in this process, by ``timeout_s`` seconds:
    when they pass, ``TimedOut`` (exit code 5) is raised in the main thread, naming ``what`` and
    ``flag``. A world of local ranks is bounded by its ``LocalWorld.deadline``; this is the same
    promise for the path that starts no rank. Off the main thread (where no signal handler runs)
    or without ``setitimer`` the block runs unbounded."""
    timeout("", flag, timeout_s)
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise TimedOut(f"{what} did not finish within {timeout_s:g} s ({flag} {timeout_s:g})")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

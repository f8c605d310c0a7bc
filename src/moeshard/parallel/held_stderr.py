"""Holding back torch's C++ log lines while a process group is joined.

torch's C++ side (c10d's sockets and stores, gloo) logs straight to file descriptor 2, past
``sys.stderr``: a rendezvous that waits for a peer prints ``[W... socket.cpp:...] [c10d]
waitForInput ... likely a timeout``, one that cannot connect prints ``[E...]`` lines with a C++
backtrace. When that wait runs out, moeshard reports it in one line (the rank, the address, the
timeout); the C++ lines say the same thing and would only bury that line. ``stderr_held`` keeps
what the block writes to descriptor 2 in an unnamed temporary file and writes it out when the
block ends, so nothing is lost, except when the block raises one of the exceptions the caller
reports itself: then the held lines are dropped with the wait they describe.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

STDERR_FD = 2


@contextlib.contextmanager
def stderr_held(dropped_on: tuple[type[BaseException], ...]) -> Iterator[None]:
    """What the block writes to file descriptor 2 (Python's ``sys.stderr`` and C++ alike) is
    held, then written to descriptor 2 when the block ends, unless the block raises one of
    ``dropped_on`` (the exceptions that the caller turns into its own one-line report). Where
    descriptor 2 cannot be duplicated (closed) or no temporary file can be made, the block runs
    with nothing held."""
    try:
        held = tempfile.TemporaryFile()
    except OSError:  # no writable temporary directory: nothing is held
        yield
        return
    try:
        saved = os.dup(STDERR_FD)
    except OSError:
        held.close()
        yield
        return
    drop = False
    try:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(held.fileno(), STDERR_FD)
        try:
            yield
        except dropped_on:
            drop = True
            raise
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, STDERR_FD)
    finally:
        os.close(saved)
        with held:
            if not drop:
                held.seek(0)
                text = memoryview(held.read())
                with contextlib.suppress(OSError):
                    while text:
                        text = text[os.write(STDERR_FD, text):]

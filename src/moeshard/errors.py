"""Expected failures and the exit codes of the ``moeshard`` command line.

Every expected failure ends ``moeshard`` with one line on stderr, ``moeshard <command>: error:
<what, the value, the rank>``, and one of these exit codes (docs/reliability.md lists them with
the tests that prove them). Anything else is a bug and keeps its traceback.

====  ==================================================================================
code  meaning
====  ==================================================================================
0     success
1     ``check``: a case failed or errored (the verification found a problem)
2     refused: a bad option, configuration, input or output path (a ``ValueError``);
      argparse's usage errors too. Raised before any rank starts wherever it can be known
3     ``check``: nothing was verified (no valid case, or none could run on this machine)
4     a rank failed: it raised an unexpected error, died or was killed
5     a rank did not finish within ``--timeout``
6     an output file could not be written (I/O error, disk full); nothing partial is left
7     a result holds NaN or Inf: ``run``'s output, ``generate``'s logits, ``train``'s losses,
      ``eplb``'s and ``bench``'s figures (nothing written unless ``--allow-nonfinite``)
130   interrupted (SIGINT, Ctrl-C); every rank stopped
143   terminated (SIGTERM); every rank stopped
====  ==================================================================================
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1
    REFUSED = 2
    NOTHING_VERIFIED = 3
    RANK_FAILED = 4
    RANK_TIMEOUT = 5
    OUTPUT = 6
    NONFINITE = 7
    INTERRUPTED = 130
    TERMINATED = 143


class MoeshardError(Exception):
    """An expected failure that is not a refusal of bad input (those are ``ValueError``s): the
    command line prints the message as one line and exits with ``exit_code``."""

    exit_code: ExitCode = ExitCode.FAILED


class NothingVerified(MoeshardError):
    """A verification run that verified nothing (zero valid cases, or none could run)."""

    exit_code = ExitCode.NOTHING_VERIFIED


class RankFailed(MoeshardError):
    """A rank raised an unexpected error (not a refusal), died or was killed."""

    exit_code = ExitCode.RANK_FAILED


class TimedOut(MoeshardError):
    """Work that runs in this process (a world of one rank) did not finish within ``--timeout``."""

    exit_code = ExitCode.RANK_TIMEOUT


class NonFiniteOutput(MoeshardError):
    """A computed output holds NaN or Inf values: a result that is no result."""

    exit_code = ExitCode.NONFINITE


class OutputError(MoeshardError):
    """An output file could not be written; the file is left as it was (writes are atomic)."""

    exit_code = ExitCode.OUTPUT


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by ``moeshard``'s SIGTERM handler, so a terminated run unwinds
    exactly like Ctrl-C: every ``LocalWorld`` is left through its ``with`` block, which stops
    every rank."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

"""How a local world failed, in words: ``RankFailure`` (who raised, died, never joined or did not
finish) and the rule that blames a rendezvous that never completed on the ranks that never came.

A rank stopped (``kill -STOP``) or stuck before it joins the process group never reports
anything; its peers wait for it at the rendezvous and give up after the process-group timeout
with torch's ``DistStoreError`` (or the parent's deadline passes first). Their errors are only
the consequence: the failure is the absent rank's, a rank that did not finish in time (exit code
5), and the one line names it (``rendezvous_culprits``, ``did_not_join``).
"""

from __future__ import annotations

import signal
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from moeshard.parallel.worker import RankError


def ended(code: int | None) -> str:
    """How a process ended, in words: ``exited with code 3`` / ``was killed by SIGKILL``."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class SilentRanks:
    """What the parent knows of the ranks still running without having reported
    (``LocalWorld.silent_ranks``).

    not_joined: those that had not joined the process group.
    absent: those of ``not_joined`` that never reached the rendezvous store at all.
    halted: rank -> why its process cannot run (``"stopped by a signal (SIGSTOP or SIGTSTP)"``).
    """

    not_joined: tuple[int, ...] = ()
    absent: tuple[int, ...] = ()
    halted: dict[int, str] = field(default_factory=dict)


def rendezvous_culprits(silent: SilentRanks, errors: dict[int, RankError], died: Collection[int],
                        timed_out: bool) -> list[int]:
    """The ranks a failure is blamed on when it is a rendezvous that never completed, else [].

    It is one when no rank died, some rank had not joined the process group, and either every
    rank that raised only gave up waiting at the rendezvous (``RankError.rendezvous``), or nobody
    raised before the deadline. The culprits are the ranks that had not joined and whose process
    cannot run (stopped); else those that never reached the store while others waited there
    (with errors: else every rank that had not joined)."""
    if died or not silent.not_joined or not (errors or timed_out):
        return []
    if not all(err.rendezvous for err in errors.values()):
        return []
    halted = [r for r in silent.not_joined if r in silent.halted]
    if halted:
        return halted
    if errors:
        return list(silent.absent or silent.not_joined)
    waiting = set(silent.not_joined) - set(silent.absent)
    return list(silent.absent) if waiting and silent.absent else []


def did_not_join(rank: int, silent: SilentRanks, within: str) -> str:
    """``rank 1 did not join the process group within 10 s (...)``, with why its process cannot run."""
    why = silent.halted.get(rank, "")
    return f"rank {rank} did not join the process group within {within}" + (f": its process is {why}" if why else "")


# Failures of joining the process group that a new world of the same ranks does not repeat: gloo
# setting up its pairwise connections on loopback, seen once in about a hundred two-rank worlds
# while another world was starting on the same machine ("Connection closed by peer").
TRANSIENT_JOIN_FAILURES = ("Gloo connectFullMesh failed",)


def transient_join_failure(err: RankError) -> bool:
    """Whether a rank's error is a failure to join the process group that a new world would not
    repeat (``TRANSIENT_JOIN_FAILURES``), not a peer that never came or the rank's own work."""
    return err.joining and any(text in err.message for text in TRANSIENT_JOIN_FAILURES)


def gave_up_waiting(err: RankError) -> bool:
    """Whether a rank's error is a wait for its peers that ran out (a collective's or a store's
    timeout), not a failure of its own work."""
    return err.type_name in ("DistBackendError", "DistStoreError", "DistNetworkError") \
        or "timed out" in err.message.lower()


def raised_verb(culprits: list[int]) -> str:
    """How a rank's error is introduced: "raised", or, when it only waited for ``culprits``,
    "gave up waiting for it:"."""
    return f"gave up waiting for {'it' if len(culprits) == 1 else 'them'}:" if culprits else "raised"


def _while_waiting(others: list[int], silent: SilentRanks, culprits: list[int]) -> list[str]:
    """Where the silent ranks other than the culprits were: waiting at the rendezvous, or not there yet."""
    them = "it" if len(culprits) == 1 else "them"
    waiting = [r for r in others if r in silent.not_joined and r not in silent.absent]
    starting = [r for r in others if r in silent.absent]
    stopped = [r for r in others if r not in waiting and r not in starting]
    return ([f"ranks {waiting} waited for {them} at the rendezvous"] if waiting else []) + \
        ([f"ranks {starting} had not reached the rendezvous yet"] if starting else []) + \
        ([f"ranks {stopped} were stopped after the failure above"] if stopped else [])


class RankFailure(RuntimeError):
    """Some ranks of a ``spawn`` (or a ``LocalWorld``) raised, died, or did not finish in time.

    Attributes:
      ``errors``: rank -> ``RankError`` for each rank that raised.
      ``missing``: ranks that reported nothing (died, timed out, or stopped after another failed).
      ``died``: rank -> exit code, for the missing ranks that exited on their own.
      ``silent``: ``SilentRanks``, what was known of the missing ranks still running when the
        world was stopped (which had not joined the process group, which were halted).
      ``timed_out``: a rank did not finish in time: the deadline passed with no rank failed or
        dead, or the failure is a rendezvous that never completed (``rendezvous_culprits``: the
        summary names the ranks that never joined first, the others only waited for them), or a
        rank that had joined cannot run (stopped) while every rank that raised only gave up
        waiting (``gave_up_waiting``): the summary names it first.
      ``exitcodes``: rank -> final exit code of every rank (negative: ended by that signal).
      ``results``: rank -> return value, for the ranks that finished.
      ``summary``: the failure in one line (each rank's error type and first message line, how
        dead ranks ended, which did not join or finish), without the tracebacks ``str()`` adds.
    """

    def __init__(self, world_size: int, errors: dict[int, RankError], missing: list[int], died: dict[int, int],
                 timed_out: bool, timeout_s: float, exitcodes: dict[int, int | None], results: dict[int, Any],
                 silent: SilentRanks | None = None, pg_timeout_s: float | None = None):
        silent = silent or SilentRanks()
        culprits = rendezvous_culprits(silent, errors, died, timed_out)
        # A rank whose process cannot run (stopped) after joining is what its peers waited for:
        # their collectives' timeouts are its doing, so the failure is a rank that did not
        # finish (exit 5), named first, not the peers' errors (exit 4).
        stuck = [] if culprits or not all(map(gave_up_waiting, errors.values())) else \
            [r for r in missing if r in silent.halted and r not in died and r not in silent.not_joined]
        self.world_size = world_size
        self.errors = errors
        self.missing = missing
        self.died = died
        self.silent = silent
        self.timed_out = timed_out or bool(culprits) or bool(stuck)
        self.exitcodes = exitcodes
        self.results = results
        # The peers gave up after the process-group timeout, or the parent's deadline came first.
        within = (f"{timeout_s / 2 if pg_timeout_s is None else pg_timeout_s:g} s (the process-group timeout)"
                  if errors else f"{timeout_s:g} s")
        head = [did_not_join(rank, silent, within) for rank in culprits]
        head += [f"rank {rank} did not finish: its process is {silent.halted[rank]}" for rank in stuck]
        verb = raised_verb(culprits) if not stuck else f"gave up waiting for {'it' if len(stuck) == 1 else 'them'}:"
        lines = [f"spawn(world_size={world_size}) failed:", *head]
        lines += [f"rank {rank} {verb} {err.type_name}: {err.message}" for rank, err in sorted(errors.items())]
        first = [f"rank {rank} {verb} {err.type_name}: {err.first_line}"
                 for rank, err in sorted(errors.items())]
        rest = [f"rank {rank} {ended(code)} without reporting a result" for rank, code in sorted(died.items())]
        others = [r for r in missing if r not in died and r not in culprits and r not in stuck]
        if culprits:
            rest += _while_waiting(others, silent, culprits)
        elif others:
            why = f"did not finish within {timeout_s:g} s" if timed_out else "were stopped after the failure above"
            not_joined = [r for r in others if r in silent.not_joined]
            if not_joined:
                why += f" (ranks {not_joined} had not joined the process group)"
            rest.append(f"ranks {others} {why}")
        rest += [f"rank {rank}'s process is {why}" for rank, why in sorted(silent.halted.items()) if rank in others]
        lines += rest
        self.summary = "; ".join(head + first + rest)
        for rank, err in sorted(errors.items()):
            lines.append(f"--- traceback of rank {rank} ---\n{err.traceback.rstrip()}")
        super().__init__("\n".join(lines))

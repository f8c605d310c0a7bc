"""Starting ranks: ``LocalWorld`` and ``spawn`` for N local processes (torchrun: ``parallel.torchrun``;
machine capacity: ``parallel.capacity``; signals around the ranks: ``parallel.signals``).

``LocalWorld`` starts ``world_size`` fresh interpreters ("spawn" start method, so nothing of the
parent's state, CUDA included, leaks into them; or, with ``preload``, forks them from a fresh
fork server that imported torch once), joins them into one process group, runs a
function on each, and streams to the parent what the ranks send and how each one ends.  Its
``events()`` is the one loop that polls the ranks; ``spawn`` (run a function on every rank,
return every result) and the harness's ``Runner`` (cases under a watchdog) are built on it.
Neither ever hangs:

  * the rendezvous is a TCPStore owned by the parent on a socket bound to 127.0.0.1 port 0, so
    it listens on loopback only and two runs at once get different ports (the port is held from
    the moment it is picked, so there is no pick-then-bind race); gloo's own connections stay on
    loopback too;
  * the process group has a timeout, so a stuck collective raises inside the rank;
  * the parent waits for the ranks at most until ``LocalWorld.deadline``; a rank that exits
    without a report is noticed within a second;
  * leaving the ``with`` block stops every rank, whether the block ended normally, raised or was
    interrupted (Ctrl-C is a KeyboardInterrupt in the parent; ``moeshard``'s SIGTERM handler
    raises one too): after a clean run the ranks get ``CLEAN_EXIT_WAIT_S`` to exit on their own,
    otherwise they are terminated and, if needed, killed; every child has exited (and been
    reaped) when the block is left;
  * a parent killed outright (SIGKILL) takes its ranks with it: each rank dies with its parent
    and hands over its last report within a bound (``moeshard.parallel.worker``);
  * the ranks ignore SIGINT (the parent answers Ctrl-C for all of them), so an interrupted run
    prints no rank's KeyboardInterrupt traceback; a Ctrl-C or SIGTERM that arrives while the
    ranks are being started is deferred until all of them are (a rank whose start-up data was
    cut off would die with an EOFError traceback);
  * a world larger than the machine can hold is refused before anything starts
    (``check_local_world``: at most ``RANKS_PER_CORE`` ranks per usable core on CPU, one per
    GPU on CUDA, and ``RANK_MEMORY_BYTES`` of available memory per rank).

A world that fails to form for a reason a new one does not repeat (gloo failing to set up its
connections: ``LocalWorld.failed_to_join_transiently``) is started again by ``spawn`` and by the
harness, once, with a warning; the function had run on no rank.

``spawn`` waits at most ``timeout_s`` in all; when a rank fails it waits ``grace_s`` more for the
others to report, then stops them (at once when a rank gave up waiting at the rendezvous: the
world cannot form any more).  A failed run raises ``RankFailure``: each rank's exception
with its traceback, the ranks that never reported, and the results of those that did.
"""

from __future__ import annotations

import os
import queue as queue_module
import signal
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from moeshard.parallel.capacity import check_local_world
from moeshard.parallel.processes import halted_state, rendezvous_progress, rendezvous_store, start_context, stop_processes
from moeshard.parallel.rank_failure import RankFailure, SilentRanks, transient_join_failure
from moeshard.parallel.signals import sigint_blocked, signals_deferred
from moeshard.parallel.worker import DEFAULT_TIMEOUT_S, RankChannel, RankError, loads, rank_main
from moeshard.validate import positive_int, timeout

__all__ = ["CLEAN_EXIT_WAIT_S", "DEFAULT_TIMEOUT_S", "JOIN_ATTEMPTS", "LocalWorld", "RankChannel", "RankError", "RankEvent",
           "RankFailure", "spawn"]

CLEAN_EXIT_WAIT_S = 10.0  # after a clean run: how long the ranks may take to tear down their groups
EXIT_REPORT_WAIT_S = 1.0  # a rank that exited may still have its report in the pipe this long
JOIN_ATTEMPTS = 2  # worlds started in all when one fails to form transiently (failed_to_join_transiently)
MIN_RESTART_S = 5.0  # a new world is started only with at least this much of the timeout left
_POLL_S = 0.1


@dataclass(frozen=True)
class RankEvent:
    """What the parent hears from one rank, in the order it happened on that rank.

    kind: ``"message"`` (value: what the rank sent through ``LocalWorld.channel``), ``"finished"``
    (value: the function's return value), ``"raised"`` (value: ``RankError``) or ``"died"``
    (value: exit code; the rank exited without reporting).  The last three end the rank.
    """

    kind: str
    rank: int
    value: Any


class LocalWorld:
    """``world_size`` local ranks in one default process group, watched from the parent::

        with LocalWorld(2, timeout_s=60) as world:
            world.start(fn, (x, world.channel))   # fn(*args) on every rank; ranks may channel.send()
            for event in world.events():          # RankEvents until every rank ended or the deadline
                ...                               # react; move world.deadline; or break
            world.stop(CLEAN_EXIT_WAIT_S if world.all_finished else 0.0)
        failure = world.failure()                 # None, or a RankFailure to raise

    Args:
      world_size: number of ranks, >= 1, within what the machine holds (``check_local_world``).
      device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank r on cuda device r).
      timeout_s: ``deadline`` starts ``timeout_s`` after the ranks are started (the caller may
        move it); also the rendezvous store's timeout. Finite (``validate.timeout``).
      backend: override the process-group backend (default gloo for cpu, nccl for cuda).
      pg_timeout_s: the process group's timeout (default ``timeout_s / 2``, so a stuck
        collective fails inside the rank, with its traceback, before the parent's deadline).
      name: process names are ``f"{name}{rank}"``.
      preload: modules the ranks need (besides torch), imported once in a fork server that then
        forks the ranks, instead of each rank starting an interpreter that imports them (see
        ``_context``); empty: every rank is a fresh "spawn" interpreter.
    The function must be module-level (picklable), as must its arguments and what it returns or
    sends; the ranks are daemon processes, so it cannot start processes of its own. Start the
    world from a thread that outlives it (the main thread, as moeshard does): on Linux a rank
    gets SIGKILL when the thread that started it exits (``moeshard.parallel.worker``).

    State, filled in by ``events()``: ``results`` (rank -> return value), ``errors`` (rank ->
    ``RankError``), ``died`` (rank -> exit code of a rank that exited without reporting; ``stop``
    adds those seen exited less than ``EXIT_REPORT_WAIT_S`` before), ``timed_out`` (the deadline
    passed before any rank failed or died).
    """

    def __init__(self, world_size: int, *, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
                 backend: str | None = None, pg_timeout_s: float | None = None, name: str = "moeshard-rank",
                 preload: tuple[str, ...] = ()) -> None:
        positive_int("LocalWorld", "world_size", world_size)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"LocalWorld.device: must be 'cpu' or 'cuda', got {device!r}")
        check_local_world(world_size, device)
        self.world_size, self.device, self.backend, self.name = world_size, device, backend, name
        self.timeout_s = timeout("LocalWorld", "timeout_s", timeout_s)
        self.pg_timeout_s = timeout("LocalWorld", "pg_timeout_s", timeout_s / 2 if pg_timeout_s is None else pg_timeout_s)
        self._ctx = start_context(preload)
        self._queue = self._ctx.Queue()
        self.channel = RankChannel(self._queue)
        self._store: Any = None
        self._processes: list[Any] | None = None
        self._stopped = False
        self.deadline = float("inf")
        self.results: dict[int, Any] = {}
        self.errors: dict[int, RankError] = {}
        self.died: dict[int, int] = {}
        self.timed_out = False
        self._ended: set[int] = set()
        self._exit_seen: dict[int, float] = {}  # rank -> when it was first seen exited without a report
        self._silent: SilentRanks | None = None  # what stop() saw of the ranks still running without a report

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0.0)  # a no-op after the caller's own stop

    def start(self, fn: Callable[..., Any], args: Sequence[Any] = ()) -> None:
        """Starts the ranks, each running ``fn(*args)``, and sets ``deadline``."""
        if self._processes is not None:
            raise RuntimeError("LocalWorld.start: this world was started already")
        self._store, port = rendezvous_store(self.world_size, self.timeout_s)
        # A spawned rank dies with this process. A rank forked by the fork server dies with the
        # server (its parent), which exits as soon as this process is gone.
        parent = os.getpid() if self._ctx.get_start_method() == "spawn" else None
        self._processes = [
            self._ctx.Process(target=rank_main, name=f"{self.name}{rank}", daemon=True,
                              args=(rank, self.world_size, port, self.device, fn, tuple(args), self._queue,
                                    self.backend, self.pg_timeout_s, parent))
            for rank in range(self.world_size)]
        # Starting a rank is fork + exec, then the parent writes the rank's start-up data into a
        # pipe; a Ctrl-C or SIGTERM raising in between would leave the rank reading an empty pipe
        # (an EOFError traceback). So the parent defers both signals until every rank is started,
        # and the ranks inherit SIGINT blocked until rank_main ignores it for good.
        with signals_deferred((signal.SIGINT, signal.SIGTERM)), sigint_blocked():
            for process in self._processes:
                process.start()
        self.deadline = time.monotonic() + self.timeout_s

    @property
    def all_finished(self) -> bool:
        """Every rank returned from its function."""
        return len(self.results) == self.world_size

    @property
    def exitcodes(self) -> dict[int, int | None]:
        """rank -> exit code (None while running; negative: ended by that signal)."""
        return {rank: process.exitcode for rank, process in enumerate(self._processes or [])}

    def events(self) -> Iterator[RankEvent]:
        """The one poll loop: yields each ``RankEvent`` as it arrives, until every rank has ended
        (finished, raised or died) or ``deadline`` passes.

        A rank that exited without a report is "died" once ``EXIT_REPORT_WAIT_S`` has passed
        (its report may still be in the pipe).  A result or message that cannot be unpickled
        here is that rank's "raised"; nothing it sends afterwards counts.
        """
        if self._processes is None:
            raise RuntimeError("LocalWorld.events: start() the world first")
        while len(self._ended) < self.world_size:
            now = time.monotonic()
            if now >= self.deadline:
                self.timed_out = not self.errors and not self.died
                return
            try:
                kind, rank, payload = self._queue.get(timeout=min(_POLL_S, self.deadline - now))
            except queue_module.Empty:
                pass
            else:
                event = self._receive(kind, rank, payload)
                if event is not None:
                    yield event
            now = time.monotonic()
            for rank, process in enumerate(self._processes):
                if rank not in self._ended and process.exitcode is not None:
                    # Its report may still wait behind other messages: not dead while any are queued.
                    if now - self._exit_seen.setdefault(rank, now) >= EXIT_REPORT_WAIT_S and self._queue.empty():
                        self.died[rank] = process.exitcode
                        self._ended.add(rank)
                        yield RankEvent("died", rank, process.exitcode)

    def _receive(self, kind: str, rank: int, payload: Any) -> RankEvent | None:
        if rank in self._ended:
            return None
        if kind == "error":
            self.errors[rank] = payload
            self._ended.add(rank)
            return RankEvent("raised", rank, payload)
        try:
            value = loads(payload)
        except Exception as exc:  # noqa: BLE001 - a value that does not arrive is that rank's failure
            what = "result" if kind == "ok" else "message"
            self.errors[rank] = RankError(rank, type(exc).__name__, f"{what} could not be unpickled: {exc}",
                                          traceback.format_exc())
            self._ended.add(rank)
            return RankEvent("raised", rank, self.errors[rank])
        if kind == "ok":
            self.results[rank] = value
            self._ended.add(rank)
            return RankEvent("finished", rank, value)
        return RankEvent("message", rank, value)

    def silent_ranks(self) -> SilentRanks:
        """What is known of the ranks still running without a report: which have not joined the
        process group, which never reached the rendezvous store (each rank marks both in it), and
        why a process cannot run (``processes.halted_state``: stopped by a signal or a debugger).
        After ``stop``: as they were when it began."""
        if self._silent is not None:
            return self._silent
        processes = self._processes or []
        silent = [rank for rank, process in enumerate(processes) if rank not in self._ended and process.exitcode is None]
        if not silent:
            return SilentRanks()
        arrived, joined = (rendezvous_progress(self._store, self.world_size) if self._store is not None
                           else (set(range(self.world_size)), set(range(self.world_size))))
        return SilentRanks(not_joined=tuple(r for r in silent if r not in joined),
                           absent=tuple(r for r in silent if r not in arrived),
                           halted={r: why for r in silent if (why := halted_state(processes[r].pid))})

    def failed_to_join_transiently(self) -> bool:
        """The world never formed, and only for a reason a new world does not repeat: some rank
        failed to join the process group with a ``transient_join_failure``, every rank that raised
        did so while joining, none died or finished, and none of those still running had joined.
        The function ran on no rank, so starting a new world of the same ranks runs nothing twice."""
        if self.results or self.died or not self.errors:
            return False
        if not all(err.joining for err in self.errors.values()) \
                or not any(map(transient_join_failure, self.errors.values())):
            return False
        running = {rank for rank in range(self.world_size) if rank not in self._ended}
        return running <= set(self.silent_ranks().not_joined)

    def stop(self, wait_s: float = 0.0) -> None:
        """Gives the ranks up to ``wait_s`` to exit on their own, then terminates and kills the
        rest; returns once every child has exited.  Only the first call does anything."""
        if self._stopped:
            return
        self._stopped = True
        processes = self._processes or []  # _exit_seen only holds ranks of started processes
        for rank in self._exit_seen:
            if rank not in self._ended:
                self.died[rank] = processes[rank].exitcode
        self._silent = self.silent_ranks()
        try:
            stop_processes(processes, exit_wait_s=wait_s)
        finally:
            self._queue.close()
            self._store = None

    def failure(self) -> RankFailure | None:
        """None if every rank finished, else the ``RankFailure`` that says who raised, died or
        did not finish (in time: within ``timeout_s`` unless the caller moved the deadline)."""
        missing = [r for r in range(self.world_size) if r not in self.results and r not in self.errors]
        if not self.errors and not missing:
            return None
        return RankFailure(self.world_size, dict(self.errors), missing, dict(self.died), self.timed_out,
                           self.timeout_s, self.exitcodes, dict(self.results), self.silent_ranks(), self.pg_timeout_s)


def cannot_form(err: RankError) -> bool:
    """Whether a rank's error leaves its world unable to form: it gave up waiting at the
    rendezvous, or setting up the group's connections failed (``transient_join_failure``). Its
    peers are then stopped at once instead of being waited for."""
    return err.rendezvous or transient_join_failure(err)


def spawn(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), device: str = "cpu",
          timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None, pg_timeout_s: float | None = None,
          grace_s: float = 3.0, preload: tuple[str, ...] = ()) -> list[Any]:
    """Runs ``fn(*args)`` on ``world_size`` new local ranks joined in one default process group.

    Args:
      fn: a module-level (picklable) function; inside it use ``torch.distributed.get_rank()``.
        Its return value must be picklable; tensors in it come back as plain CPU tensors.
        The ranks are daemon processes, so ``fn`` cannot start processes of its own.
      world_size: number of ranks, >= 1 (<= visible GPUs for ``device="cuda"``).
      device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank r on cuda device r).
      timeout_s: the most the whole run may take, start-up included.
      backend: override the process-group backend (default gloo for cpu, nccl for cuda).
      pg_timeout_s: the process group's timeout (default ``timeout_s / 2``, so a stuck
        collective fails inside the rank, with its traceback, before the parent's deadline).
      grace_s: after a rank fails, how long to wait for the others to report before stopping them.
      preload: as ``LocalWorld``'s: the ranks fork from a server that imported torch (and these
        modules) once, instead of each starting a fresh interpreter.
    Returns the results in rank order.  Raises ``RankFailure`` if any rank raised, died or did
    not finish in time; all children have exited by the time ``spawn`` returns or raises.

    A world that failed to form for a reason a new world does not repeat
    (``LocalWorld.failed_to_join_transiently``: ``fn`` ran on no rank) is started again, up to
    ``JOIN_ATTEMPTS`` worlds in all, within the same ``timeout_s``; each new start is announced
    by a ``RuntimeWarning`` naming the error.
    """
    timeout("spawn", "timeout_s", timeout_s)
    if not grace_s >= 0:
        raise ValueError(f"spawn.grace_s: must be >= 0, got {grace_s!r}")
    end = time.monotonic() + timeout_s
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        # The first world gets timeout_s exactly; a new start gets what is left of it.
        left = timeout_s if attempt == 1 else end - time.monotonic()
        world = LocalWorld(world_size, device=device, timeout_s=left, backend=backend,
                           pg_timeout_s=pg_timeout_s, preload=preload)
        with world:
            world.start(fn, args)
            for event in world.events():
                if event.kind == "raised" and cannot_form(event.value):
                    world.deadline = time.monotonic()  # this world cannot form: stop it now
                elif event.kind in ("raised", "died"):
                    world.deadline = min(world.deadline, time.monotonic() + grace_s)
            # After a clean run the ranks are only tearing down their process group: let them
            # exit on their own for a while.  After a failure, stop them at once.
            world.stop(CLEAN_EXIT_WAIT_S if world.all_finished else 0.0)
        failure = world.failure()
        if failure is None:
            return [world.results[rank] for rank in range(world_size)]
        if attempt == JOIN_ATTEMPTS or not world.failed_to_join_transiently() \
                or end - time.monotonic() < MIN_RESTART_S:
            raise failure
        warnings.warn(f"spawn(world_size={world_size}): the ranks failed to join the process group "
                      f"({join_failure_line(world.errors)}); starting a new world "
                      f"(attempt {attempt + 1} of {JOIN_ATTEMPTS})", RuntimeWarning, stacklevel=2)
    raise AssertionError("unreachable: the last attempt returns or raises")


def join_failure_line(errors: dict[int, RankError]) -> str:
    """``rank 0: RuntimeError: Gloo connectFullMesh failed ...``: the first line of each error."""
    return "; ".join(f"rank {rank}: {err.type_name}: {err.first_line}" for rank, err in sorted(errors.items()))

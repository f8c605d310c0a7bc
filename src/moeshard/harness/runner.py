"""Running cases: one spawn per world size, all of its cases inside, a watchdog per case.

    parent                                   each rank (moeshard.parallel.spawn._worker)
    ------                                   ---------
    spawn world with the pending cases  -->  for each case: ("start", i, rank)
    progress bar, per-case deadline          run_case(...) -> ("done", i, rank, RankResult)
    a case fails on a rank / hangs /         or ("case_error", i, rank, RankError), then stop
    a rank dies: record it with the case     final ("ok" | "error", rank, ...) from _worker
    id and ranks, stop every rank, respawn
    for the cases after it

World size 1 runs in this process (no collectives can hang there). The process groups' own
timeout is half the case timeout, so ranks blocked in a collective by a stuck peer raise and
report first; the stuck rank is the one that stays silent.
"""

from __future__ import annotations

import pickle
import queue as queue_module
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.multiprocessing as torch_mp

from moeshard.harness.cases import Case
from moeshard.harness.execute import GroupsCache, RankResult, run_case
from moeshard.layer import MoELayer
from moeshard.parallel.spawn import RankError, _dumps, _rendezvous_store, _stop, _worker


@dataclass
class CaseOutcome:
    """Result of one case over all its ranks. status: pass | fail | skip | error."""

    case: Case
    status: str
    reason: str = ""
    max_abs_err: float | None = None
    atol: float | None = None
    rtol: float | None = None
    quant_error: float | None = None
    seconds: float = 0.0
    ranks: list[RankResult] = field(default_factory=list)


def summarize(case: Case, results: list[RankResult], seconds: float) -> CaseOutcome:
    """Every rank's rows must all be present and within tolerance."""
    failing = [r for r in results if not r.ok]
    qerr = next((r.quant_error for r in results if r.quant_error is not None), None)
    return CaseOutcome(case, "fail" if failing else "pass", "; ".join(r.detail for r in failing if r.detail),
                       max(r.max_abs_err for r in results), results[0].atol, results[0].rtol, qerr, seconds,
                       sorted(results, key=lambda r: r.rank))


def _case_loop(cases: list[Case], device: str, events: Any, layer_factory: Callable) -> int:
    """Runs inside each rank: every case in order; stops at the first case that raises."""
    rank = torch.distributed.get_rank()
    # Several ranks share the machine's cores: one thread each avoids oversubscribed spinning.
    torch.set_num_threads(1)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    cache = GroupsCache(side_channel=device == "cuda")
    for i, case in enumerate(cases):
        events.put(("start", i, rank))
        try:
            result = run_case(case, rank, dev, cache.get(case.parallel), layer_factory)
        except BaseException as exc:  # noqa: BLE001 - reported with the case id, then this rank stops
            events.put(("case_error", i, rank, RankError(rank, type(exc).__name__, str(exc), traceback.format_exc())))
            raise
        events.put(("done", i, rank, _dumps(result)))
    return len(cases)


class Runner:
    """Runs cases of one device kind. on_outcome(CaseOutcome) is called as each case ends.

    case_timeout_s: the most one case may take on all its ranks before it is declared hung.
    startup_timeout_s: the most a spawn may take before its first case starts.
    """

    def __init__(self, device: str = "cpu", case_timeout_s: float = 60.0, startup_timeout_s: float = 120.0,
                 layer_factory: Callable[..., MoELayer] = MoELayer,
                 on_outcome: Callable[[CaseOutcome], None] = lambda o: None) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device: {device!r} is not one of ['cpu', 'cuda']")
        self.device, self.case_timeout_s, self.startup_timeout_s = device, case_timeout_s, startup_timeout_s
        self.layer_factory, self.on_outcome = layer_factory, on_outcome

    def run(self, cases: list[Case]) -> list[CaseOutcome]:
        """Outcomes in the order of ``cases``; skipped cases are reported, not run."""
        outcomes: dict[int, CaseOutcome] = {}
        by_world: dict[int, list[int]] = {}
        for i, case in enumerate(cases):
            if case.skipped:
                outcomes[i] = CaseOutcome(case, "skip", case.reason)
                self.on_outcome(outcomes[i])
            else:
                by_world.setdefault(case.world_size, []).append(i)
        for world, indices in sorted(by_world.items()):
            if self.device == "cuda" and world > torch.cuda.device_count():
                for i in indices:
                    outcomes[i] = CaseOutcome(cases[i], "skip", f"world size {world} needs {world} GPUs, "
                                                                f"{torch.cuda.device_count()} visible")
                    self.on_outcome(outcomes[i])
                continue
            run = self._in_process if world == 1 else self._spawned
            for i, outcome in zip(indices, run([cases[i] for i in indices])):
                outcomes[i] = outcome
        return [outcomes[i] for i in range(len(cases))]

    # -- world size 1 ---------------------------------------------------------------------
    def _in_process(self, cases: list[Case]) -> list[CaseOutcome]:
        dev = torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")
        out = []
        for case in cases:
            start = time.monotonic()
            try:
                outcome = summarize(case, [run_case(case, 0, dev, None, self.layer_factory)], time.monotonic() - start)
            except Exception as exc:  # noqa: BLE001 - a case that raises is an error, the run goes on
                outcome = CaseOutcome(case, "error", f"rank 0 raised {type(exc).__name__}: {exc}",
                                      seconds=time.monotonic() - start)
            self.on_outcome(outcome)
            out.append(outcome)
        return out

    # -- world size > 1 -------------------------------------------------------------------
    def _spawned(self, cases: list[Case]) -> list[CaseOutcome]:
        outcomes: list[CaseOutcome] = []
        while len(outcomes) < len(cases):
            batch = self._one_spawn(cases[len(outcomes):])
            outcomes.extend(batch)
            if len(batch) == 1 and batch[0].status == "error" and batch[0].seconds == 0.0:
                # The world failed before its first case started: respawning would fail the same
                # way for every remaining case, so report them all with that reason.
                for case in cases[len(outcomes):]:
                    outcome = CaseOutcome(case, "error", f"not run: the world of {case.world_size} ranks failed "
                                                         f"to start ({batch[0].reason})")
                    self.on_outcome(outcome)
                    outcomes.append(outcome)
        return outcomes

    def _one_spawn(self, cases: list[Case]) -> list[CaseOutcome]:
        """Runs ``cases`` in one world until they are done or one of them fails hard; returns
        the outcomes of the cases it finished (the failed one included)."""
        world = cases[0].world_size
        ctx = torch_mp.get_context("spawn")
        events = ctx.Queue()
        store, port = _rendezvous_store(world, self.startup_timeout_s)
        pg_timeout = max(1.0, self.case_timeout_s / 2)
        procs = [ctx.Process(target=_worker, name=f"moeshard-check-rank{r}", daemon=True,
                             args=(r, world, port, self.device, _case_loop,
                                   (cases, self.device, events, self.layer_factory), events, None, pg_timeout))
                 for r in range(world)]
        outcomes: list[CaseOutcome] = []
        # Ranks run ahead independently: buffer every message by case index.
        done: dict[int, dict[int, RankResult]] = {}
        errors: dict[int, dict[int, RankError]] = {}
        started: dict[int, float] = {}
        failed_ranks: set[int] = set()
        deadline = time.monotonic() + self.startup_timeout_s
        failure: str | None = None
        try:
            for p in procs:
                p.start()
            while len(outcomes) < len(cases) and failure is None:
                i = len(outcomes)
                try:
                    msg = events.get(timeout=0.1)
                except queue_module.Empty:
                    msg = None
                now = time.monotonic()
                if msg is not None:
                    kind = msg[0]
                    if kind == "start":
                        if msg[1] not in started:
                            started[msg[1]] = now
                            if msg[1] == i:
                                deadline = now + self.case_timeout_s
                    elif kind == "done":
                        done.setdefault(msg[1], {})[msg[2]] = pickle.loads(msg[3])
                    elif kind == "case_error":
                        errors.setdefault(msg[1], {})[msg[2]] = msg[3]
                        failed_ranks.add(msg[2])
                        deadline = min(deadline, now + 2.0)  # let the peers report, briefly
                    elif kind == "error" and msg[1] not in failed_ranks:
                        # raised outside any case (start-up, process groups): charge the current case
                        errors.setdefault(i, {})[msg[1]] = msg[2]
                        failed_ranks.add(msg[1])
                        deadline = min(deadline, now + 2.0)
                case_done = done.get(i, {})
                if len(case_done) == world:
                    outcome = summarize(cases[i], list(case_done.values()), now - started.get(i, now))
                    outcomes.append(outcome)
                    self.on_outcome(outcome)
                    nxt = started.get(i + 1)
                    deadline = (nxt if nxt is not None else now) + self.case_timeout_s
                    continue
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in failed_ranks and r not in case_done]
                if dead and deadline > now + 1.0:
                    deadline = now + 1.0  # its last report may still be in the pipe
                if now >= deadline:
                    failure = self._describe_failure(world, case_done, errors.get(i, {}), dead, started.get(i), now, procs)
            if failure is not None:
                i = len(outcomes)
                outcome = CaseOutcome(cases[i], "error", failure,
                                      seconds=time.monotonic() - started[i] if i in started else 0.0)
                outcomes.append(outcome)
                self.on_outcome(outcome)
        finally:
            # After a clean run the ranks are only tearing down their groups: let them exit on
            # their own. After a failure or Ctrl-C (KeyboardInterrupt), stop them at once.
            clean = failure is None and len(outcomes) == len(cases)
            _stop(procs, exit_wait_s=10.0 if clean else 0.0)
            events.close()
            del store
        return outcomes

    def _describe_failure(self, world, done, errors, dead, started_at, now, procs) -> str:
        parts = []
        for rank, err in sorted(errors.items()):
            parts.append(f"rank {rank} raised {err.type_name}: {err.message.splitlines()[0] if err.message else ''}")
        for rank in dead:
            parts.append(f"rank {rank} died (exit code {procs[rank].exitcode})")
        silent = [r for r in range(world) if r not in done and r not in errors and r not in dead]
        if silent:
            if started_at is None:
                parts.append(f"ranks {silent} did not start the case within {self.startup_timeout_s:g} s")
            else:
                parts.append(f"ranks {silent} hung: no result {now - started_at:.1f} s after the case started "
                             f"(case timeout {self.case_timeout_s:g} s)")
        if done:
            parts.append(f"ranks {sorted(done)} finished")
        return "; ".join(parts)

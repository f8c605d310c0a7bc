"""Running cases: one world per world size, all of its cases inside, a watchdog per case.

    parent: Runner._one_spawn, on the           each rank: _case_loop, through world.channel
    events of one LocalWorld                     ---------
    ------                                       for each case: ("start", i)
    start a world with the pending cases   -->   build the layer: ("built", i, accumulation)
    on "built": the case's reference starts      forward -> ("done", i, RankOutput)
      on the reference thread (References)       or ("case_error", i, RankError), then raise
    on every rank's "done": compare every        (LocalWorld reports how each rank ended:
      row with the reference, report             finished, raised or died)
    a case fails on a rank / hangs /
    a rank dies: record it with the case
    id and ranks, stop every rank, respawn
    for the cases after it

The reference of a case is the same for every rank, so it is computed once, in the parent, on
a worker thread while the ranks run the layer (and run ahead to the next cases). Cases run
grouped by weights and scheme (``execution_order``) so that what they share stays cached.
World size 1 runs in this process (no collectives can hang there). The process groups' own
timeout is half the case timeout, so ranks blocked in a collective by a stuck peer raise and
report first; the stuck rank is the one that stays silent. Ctrl-C stops every rank (leaving the
world's ``with`` block does).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from moeshard.errors import TimedOut
from moeshard.harness.cases import Case
from moeshard.harness.execute import CaseReference, GroupsCache, RankOutput, RankResult, case_reference, check_rank, run_layer
from moeshard.harness.explain import StageReport, explain_case
from moeshard.harness.grad_explain import explain_grads
from moeshard.harness.inputs import CaseData, execution_order
from moeshard.layer import MoELayer
from moeshard.parallel.processes import start_fork_server
from moeshard.parallel.rank_failure import SilentRanks, did_not_join, raised_verb, rendezvous_culprits
from moeshard.parallel.signals import in_process_deadline
from moeshard.parallel.spawn import (
    CLEAN_EXIT_WAIT_S,
    JOIN_ATTEMPTS,
    LocalWorld,
    RankChannel,
    RankError,
    cannot_form,
    join_failure_line,
)
from moeshard.parallel.trace import TRACE_CAPACITY, CollectiveTrace, error_headline, explain_divergence

PEER_REPORT_S = 2.0  # after a rank fails a case: how long its peers may take to report theirs
RANK_MODULES = ("moeshard.harness.runner",)  # what the ranks import, once, in the fork server


@dataclass
class CaseOutcome:
    """Result of one case over all its ranks. status: pass | fail | error, not_applicable (the
    matrix refused the combination by construction: ``Case.reason``) or skip (not run here, e.g.
    too few GPUs); err_to_bound: the largest error relative to its bound over every rank's rows."""

    case: Case
    status: str
    reason: str = ""
    max_abs_err: float | None = None
    atol: float | None = None
    rtol: float | None = None
    quant_error: float | None = None
    seconds: float = 0.0
    ranks: list[RankResult] = field(default_factory=list)
    err_to_bound: float | None = None
    explanation: list[str] = field(default_factory=list)
    stages: StageReport | None = None


def summarize(case: Case, results: list[RankResult], seconds: float) -> CaseOutcome:
    """Every rank's rows must all be present and within tolerance."""
    failing = [r for r in results if not r.ok]
    qerr = next((r.quant_error for r in results if r.quant_error is not None), None)
    return CaseOutcome(case, "fail" if failing else "pass", "; ".join(r.detail for r in failing if r.detail),
                       max(r.max_abs_err for r in results), results[0].atol, results[0].rtol, qerr, seconds,
                       sorted(results, key=lambda r: r.rank), max(r.err_to_bound for r in results))


def _case_loop(cases: list[Case], device: str, channel: RankChannel, layer_factory: Callable,
               traces: list, record: bool = False) -> int:
    """Runs inside each rank: every case in order; stops at the first case that raises.
    traces[rank]: this rank's shared buffer for its ``CollectiveTrace``, which the parent reads
    when a case fails; record: send every stage's values too (``--explain``)."""
    rank = torch.distributed.get_rank()
    # Several ranks share the machine's cores: one thread each avoids oversubscribed spinning.
    torch.set_num_threads(1)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    trace = CollectiveTrace(TRACE_CAPACITY, traces[rank])
    cache = GroupsCache(device, trace=trace)
    data = CaseData()
    for i, case in enumerate(cases):
        trace.case = i
        channel.send(("start", i))

        def on_built(accumulation: float, i: int = i) -> None:  # i bound now, for this case
            channel.send(("built", i, accumulation))

        try:
            output = run_layer(case, rank, dev, cache.get(case.parallel), layer_factory, data, on_built=on_built,
                               record=record)
        except BaseException as exc:  # noqa: BLE001 - reported with the case id, then this rank stops
            channel.send(("case_error", i, RankError.of(rank, exc)))
            raise
        channel.send(("done", i, output))
    return len(cases)


class References:
    """The parent's references: one per case, computed on one worker thread, in the order they
    are asked for, while the caller goes on (torch releases the GIL inside its operations)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moeshard-reference")
        self._data = CaseData()
        self._futures: dict[tuple[Case, float], Future] = {}

    def start(self, case: Case, accumulation: float) -> None:
        """Starts the reference of ``case`` for a kernel with ``accumulation`` (once)."""
        key = (case, accumulation)
        if key not in self._futures:
            self._futures[key] = self._pool.submit(case_reference, case, accumulation, self._data)

    def ready(self, case: Case, accumulation: float) -> bool:
        """Whether the reference is computed (or failed), so ``take`` will not wait."""
        future = self._futures.get((case, accumulation))
        return future is not None and future.done()

    def take(self, case: Case, accumulation: float) -> CaseReference:
        """The reference (waits for it, starting it if needed); raises what computing it raised."""
        self.start(case, accumulation)
        return self._futures.pop((case, accumulation)).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _checked(case: Case, refs: References, outputs: list[RankOutput], seconds: float, explain: str = "",
             data: CaseData | None = None) -> CaseOutcome:
    """Every rank's rows compared with the case's reference (computed for rank 0's kernel);
    explain: "all" or "failing" (which cases get a stage report), "" for none."""
    try:
        reference = refs.take(case, outputs[0].accumulation)
    except Exception as exc:  # noqa: BLE001 - the case cannot be judged; the run goes on
        return CaseOutcome(case, "error", f"the reference raised {type(exc).__name__}: {exc}", seconds=seconds)
    outcome = summarize(case, [check_rank(case, reference, o) for o in sorted(outputs, key=lambda o: o.rank)], seconds)
    if explain == "all" or (explain == "failing" and outcome.status == "fail"):
        try:
            explainer = explain_grads if case.grad else explain_case
            report = explainer(case, outputs, outputs[0].accumulation, data)
        except Exception as exc:  # noqa: BLE001 - an explanation that fails must not hide the verdict
            outcome.explanation = [f"--explain failed: {type(exc).__name__}: {exc}"]
        else:
            outcome.stages = report
            outcome.explanation = [report.headline, *report.lines]
    return outcome


class Runner:
    """Runs cases of one device kind. on_outcome(CaseOutcome) is called as each case ends.

    case_timeout_s: the most one case may take on all its ranks before it is declared hung.
    startup_timeout_s: the most a spawn may take before its first case starts.
    explain: "" (no stage recording), "failing" (the ranks record every stage and failing cases
    get a ``StageReport``) or "all" (every case gets one).
    backend: the spawned worlds' process-group backend (default gloo on cpu, nccl on cuda), as
    ``LocalWorld``'s.
    """

    def __init__(self, device: str = "cpu", case_timeout_s: float = 60.0, startup_timeout_s: float = 120.0,
                 layer_factory: Callable[..., MoELayer] = MoELayer,
                 on_outcome: Callable[[CaseOutcome], None] = lambda o: None, explain: str = "",
                 backend: str | None = None) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device: {device!r} is not one of ['cpu', 'cuda']")
        if explain not in ("", "failing", "all"):
            raise ValueError(f"Runner.explain: {explain!r} is not one of ['', 'failing', 'all']")
        self.device, self.case_timeout_s, self.startup_timeout_s = device, case_timeout_s, startup_timeout_s
        self.layer_factory, self.on_outcome, self.explain = layer_factory, on_outcome, explain
        self.backend = backend
        self._explain_data = CaseData()

    def run(self, cases: list[Case]) -> list[CaseOutcome]:
        """Outcomes in the order of ``cases``; cases the matrix refused are reported (not
        applicable), not run. Cases run
        (and ``on_outcome`` hears of them) in ``execution_order`` within each world size."""
        outcomes: dict[int, CaseOutcome] = {}
        by_world: dict[int, list[int]] = {}
        for i, case in enumerate(cases):
            if case.skipped:
                outcomes[i] = CaseOutcome(case, "not_applicable", case.reason)
                self.on_outcome(outcomes[i])
            else:
                by_world.setdefault(case.world_size, []).append(i)
        if any(world > 1 for world in by_world):
            start_fork_server(RANK_MODULES)  # it imports torch while world size 1 runs here
        refs = References()
        threads = torch.get_num_threads()
        # The ranks take the cores; one thread here avoids oversubscribed spinning.
        torch.set_num_threads(1)
        try:
            for world, indices in sorted(by_world.items()):
                if self.device == "cuda" and world > torch.cuda.device_count():
                    for i in indices:
                        outcomes[i] = CaseOutcome(cases[i], "skip", f"world size {world} needs {world} GPUs, "
                                                                    f"{torch.cuda.device_count()} visible")
                        self.on_outcome(outcomes[i])
                    continue
                indices = [indices[j] for j in execution_order([cases[i] for i in indices])]
                run = self._in_process if world == 1 else self._spawned
                for i, outcome in zip(indices, run([cases[i] for i in indices], refs), strict=True):
                    outcomes[i] = outcome
        finally:
            refs.close()
            torch.set_num_threads(threads)
        return [outcomes[i] for i in range(len(cases))]

    # -- world size 1 ---------------------------------------------------------------------
    def _in_process(self, cases: list[Case], refs: References) -> list[CaseOutcome]:
        dev = torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")
        data = CaseData()
        out = []
        for case in cases:
            start = time.monotonic()

            def on_built(accumulation: float, case: Case = case) -> None:  # case bound now, for this case
                refs.start(case, accumulation)

            try:
                # Bounded like a spawned case: the watchdog of a world is its deadline, here a timer.
                with in_process_deadline(self.case_timeout_s, "rank 0 (in this process)"):
                    output = run_layer(case, 0, dev, None, self.layer_factory, data, on_built=on_built,
                                       record=bool(self.explain))
                outcome = _checked(case, refs, [output], time.monotonic() - start, self.explain, self._explain_data)
            except TimedOut as exc:
                outcome = CaseOutcome(case, "error", str(exc), seconds=time.monotonic() - start)
            except Exception as exc:  # noqa: BLE001 - a case that raises is an error, the run goes on
                outcome = CaseOutcome(case, "error", f"rank 0 raised {type(exc).__name__}: {exc}",
                                      seconds=time.monotonic() - start)
            self.on_outcome(outcome)
            out.append(outcome)
        return out

    # -- world size > 1 -------------------------------------------------------------------
    def _spawned(self, cases: list[Case], refs: References) -> list[CaseOutcome]:
        outcomes: list[CaseOutcome] = []
        restarts = JOIN_ATTEMPTS - 1  # for worlds that failed to form transiently, over the whole run
        while len(outcomes) < len(cases):
            batch = self._one_spawn(cases[len(outcomes):], refs, may_restart=restarts > 0)
            if batch is None:
                restarts -= 1
                continue
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

    def _one_spawn(self, cases: list[Case], refs: References, may_restart: bool) -> list[CaseOutcome] | None:
        """Runs ``cases`` in one world until they are done or one of them fails hard; returns
        the outcomes of the cases it finished (the failed one included). With ``may_restart``,
        returns None instead when the world failed to form transiently
        (``LocalWorld.failed_to_join_transiently``: no case started): the caller starts a new one.

        ``w`` is the first case that not every rank has finished: the watchdog's deadline is
        its own. Cases before it are reported in order as soon as their reference is ready;
        this loop never waits for a reference while ranks are running."""
        world_size = cases[0].world_size
        outcomes: list[CaseOutcome] = []
        # Ranks run ahead independently: every report is kept by case index.
        done: dict[int, dict[int, RankOutput]] = {}
        errors: dict[int, dict[int, RankError]] = {}
        started: dict[int, float] = {}
        finished: dict[int, float] = {}
        failed_ranks: set[int] = set()
        died: set[int] = set()
        w = 0

        def report(wait: bool) -> None:
            while len(outcomes) < w:
                i = len(outcomes)
                outputs = list(done[i].values())
                if not wait and not refs.ready(cases[i], outputs[0].accumulation):
                    return
                del done[i]
                outcome = _checked(cases[i], refs, outputs, finished[i] - started.get(i, finished[i]), self.explain,
                                   self._explain_data)
                outcomes.append(outcome)
                self.on_outcome(outcome)

        traces = [CollectiveTrace.shared(TRACE_CAPACITY) for _ in range(world_size)]
        world = LocalWorld(world_size, device=self.device, timeout_s=self.startup_timeout_s, backend=self.backend,
                           pg_timeout_s=max(1.0, self.case_timeout_s / 2), name="moeshard-check-rank",
                           preload=RANK_MODULES)
        with world:  # leaving it, Ctrl-C (KeyboardInterrupt) included, stops every rank
            world.start(_case_loop, (cases, self.device, world.channel, self.layer_factory, traces,
                                     bool(self.explain)))
            for event in world.events():
                now = time.monotonic()
                if event.kind == "message":
                    what, index, *rest = event.value
                    if what == "start" and index not in started:
                        started[index] = now
                        if index == w:
                            world.deadline = now + self.case_timeout_s
                    elif what == "built":
                        refs.start(cases[index], rest[0])
                    elif what == "done":
                        done.setdefault(index, {})[event.rank] = rest[0]
                    elif what == "case_error":
                        errors.setdefault(index, {})[event.rank] = rest[0]
                        failed_ranks.add(event.rank)
                        world.deadline = min(world.deadline, now + PEER_REPORT_S)
                elif event.kind == "raised" and event.rank not in failed_ranks:
                    # raised outside any case (start-up, process groups): charge the current case;
                    # one that gave up waiting at the rendezvous leaves a world that cannot form
                    errors.setdefault(w, {})[event.rank] = event.value
                    failed_ranks.add(event.rank)
                    world.deadline = now if cannot_form(event.value) else min(world.deadline, now + PEER_REPORT_S)
                elif event.kind == "died":
                    died.add(event.rank)
                while w < len(cases) and len(done.get(w, {})) == world_size:
                    finished[w] = now
                    w += 1
                    world.deadline = started.get(w, now) + self.case_timeout_s
                report(wait=False)
                if w == len(cases):
                    break
                if died - done.get(w, {}).keys():
                    world.deadline = now  # a rank of this case is gone: it cannot finish
            report(wait=True)
            clean = len(outcomes) == len(cases)
            if not clean and may_restart and not started and world.failed_to_join_transiently():
                world.stop(0.0)
                warnings.warn(f"the world of {world_size} ranks failed to join its process group "
                              f"({join_failure_line(world.errors)}); starting a new one", RuntimeWarning,
                              stacklevel=2)
                return None
            if not clean:
                i = len(outcomes)
                now = time.monotonic()
                case_done = done.get(i, {})
                dead = {r: code for r, code in world.exitcodes.items()
                        if code is not None and r not in failed_ranks and r not in case_done}
                reason = self._describe_failure(world_size, case_done, errors.get(i, {}), dead, started.get(i), now,
                                                world.silent_ranks(), world.pg_timeout_s)
                diff = _collective_diff(cases[i], i, traces, case_done, errors.get(i, {}), dead, failed_ranks, errors)
                outcome = CaseOutcome(cases[i], "error", reason, seconds=now - started[i] if i in started else 0.0,
                                      explanation=diff)
                outcomes.append(outcome)
                self.on_outcome(outcome)
            # After a clean run the ranks are only tearing down their groups: let them exit on
            # their own. After a failure, stop them at once.
            world.stop(CLEAN_EXIT_WAIT_S if clean else 0.0)
        return outcomes

    def _describe_failure(self, world_size: int, done: dict[int, RankOutput], errors: dict[int, RankError],
                          dead: dict[int, int], started_at: float | None, now: float, silent: SilentRanks,
                          pg_timeout_s: float) -> str:
        """The case's error in one line. Ranks that never joined the process group, while the
        others only gave up waiting for them at the rendezvous, come first: they are the cause
        (``rendezvous_culprits``)."""
        culprits = rendezvous_culprits(silent, errors, dead, timed_out=False)
        parts = [did_not_join(rank, silent, f"{pg_timeout_s:g} s (the process-group timeout)") for rank in culprits]
        verb = raised_verb(culprits)
        for rank, err in sorted(errors.items()):
            parts.append(f"rank {rank} {verb} {err.type_name}: {err.message.splitlines()[0] if err.message else ''}")
        for rank, code in sorted(dead.items()):
            parts.append(f"rank {rank} died (exit code {code})")
        others = [r for r in range(world_size) if r not in done and r not in errors and r not in dead
                  and r not in culprits]
        if others:
            if started_at is None and any(map(cannot_form, errors.values())):
                parts.append(f"ranks {others} were stopped: the world could not form")
            elif started_at is None:
                parts.append(f"ranks {others} did not start the case within {self.startup_timeout_s:g} s")
            else:
                parts.append(f"ranks {others} hung: no result {now - started_at:.1f} s after the case started "
                             f"(case timeout {self.case_timeout_s:g} s)")
        parts += [f"rank {rank}'s process is {why}" for rank, why in sorted(silent.halted.items()) if rank in others]
        if done:
            parts.append(f"ranks {sorted(done)} finished")
        return "; ".join(parts)


def _where(err: RankError) -> str:
    """``file:line function`` of the innermost frame of a rank's traceback that is not torch's
    (from ``moeshard/`` on)."""
    frames = []
    for line in err.traceback.splitlines():
        line = line.strip()
        if line.startswith("File "):
            path, _, rest = line[6:].partition('", line ')
            number, _, func = rest.partition(", in ")
            frames.append((path.replace("\\", "/"), number, func))
    ours = [f for f in frames if "/torch/" not in f[0]] or frames
    if not ours:
        return "?"
    path, number, func = ours[-1]
    path = path.split("moeshard/", 1)[-1] if "moeshard/" in path else path.rsplit("/", 1)[-1]
    return f"{path}:{number} {func}"


def _collective_diff(case: Case, index: int, traces: list, done: dict[int, RankOutput],
                     case_errors: dict[int, RankError], dead: dict[int, int], failed_ranks: set[int],
                     all_errors: dict[int, dict[int, RankError]]) -> list[str]:
    """Where the ranks' collective sequences for case ``index`` part (see
    ``moeshard.parallel.trace.explain_divergence``), from the traces they left in shared memory."""
    outcome: dict[int, str] = {}
    for rank in range(len(traces)):
        if rank in case_errors:
            err = case_errors[rank]
            outcome[rank] = f"it raised {err.type_name} ({error_headline(err.message)}) at {_where(err)}"
        elif rank in done:
            later = [i for i, errs in all_errors.items() if i > index and rank in errs]
            outcome[rank] = "it finished the case" + (f" and went on to case {later[0]}" if later else "")
        elif rank in dead:
            outcome[rank] = f"it died (exit code {dead[rank]})"
        else:
            outcome[rank] = "it sent nothing more (still inside, or stopped)"
    entries = {rank: CollectiveTrace(TRACE_CAPACITY, buffer).entries() for rank, buffer in enumerate(traces)}
    ep = list(range(len(traces))) if case.parallel.enable_ep else None
    return explain_divergence(entries, index, len(traces), outcome, ep)


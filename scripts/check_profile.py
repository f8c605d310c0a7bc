"""Where the seconds of ``moeshard check`` go, per phase of a case (CPU ranks, gloo).

    PYTHONPATH=src python3 scripts/check_profile.py ID [ID ...]     # chosen cases, 3 timed runs each
    PYTHONPATH=src python3 scripts/check_profile.py --all           # every valid case of the default matrix
    PYTHONPATH=src python3 scripts/check_profile.py --run           # the real Runner on the default matrix

Phases, as ``moeshard.harness`` runs them: each rank does

  inputs    the case's weights (shared by the cases of a model: ``CaseData``), tokens and its
            shard of the quantized experts (cached likewise)
  build     ``MoELayer(...)``: configuration exchange, modules, backend
  forward   the layer's forward on this rank's tokens

and the parent, once per case (on its reference thread, while the ranks work):

  reference the fp64 reference of every quantization domain, with its slack, and the
            unquantized one for the quantization error (``case_reference``)
  compare   ``check_rank`` of every rank's rows

Each phase is timed by wall clock (``time.perf_counter``) and by the CPU time of its thread
(``time.thread_time``, which a busy shared machine inflates far less than wall time). With IDs,
the rank phases run in a world of the case's size (3 timed runs after a warm-up, caches cleared
before each so that every phase does its full work) and the parent phases in this process,
under cProfile too. ``--all`` runs every valid case once per world with warm caches, as the
harness does (in ``execution_order``). ``--run`` times ``Runner.run`` itself: wall and CPU of
this process (with its reference thread) and of its ranks.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time

import torch

from moeshard.harness.cases import MatrixOptions, generate, select_ids
from moeshard.harness.execute import GroupsCache, RankOutput, case_reference, check_rank
from moeshard.harness.inputs import CaseData, case_tokens_of, execution_order
from moeshard.harness.runner import Runner
from moeshard.layer import MoELayer
from moeshard.parallel.spawn import spawn
from moeshard.sharding import shard_spec

RANK_PHASES = ("inputs", "build", "forward")
PARENT_PHASES = ("reference", "compare")


class _Timer:
    def __init__(self, names: tuple[str, ...]) -> None:
        self.totals = {name: [0.0, 0.0] for name in names}

    def __call__(self, name, fn):
        t0, c0 = time.perf_counter(), time.thread_time()
        value = fn()
        self.totals[name][0] += time.perf_counter() - t0
        self.totals[name][1] += time.thread_time() - c0
        return value

    def reset(self) -> None:
        for v in self.totals.values():
            v[:] = [0.0, 0.0]


def _rank_case(case, rank: int, groups: GroupsCache, data: CaseData, tick: _Timer) -> RankOutput:
    """One case's phases in this rank, each timed into ``tick``."""
    cfg = case.moe_config()
    weights = tick("inputs", lambda: data.weights(case))
    xs = tick("inputs", lambda: case_tokens_of(case))
    local = tick("inputs", lambda: data.local_experts(case, shard_spec(case.parallel, rank, cfg.num_experts)))
    g = groups.get(case.parallel)
    layer = tick("build", lambda: MoELayer(cfg, quant=case.quant, groups=g, backend=case.backend,
                                           weights=weights, local_experts=local))
    out = tick("forward", lambda: layer(xs[case.parallel.dp_rank(rank)]))
    return RankOutput(rank, out, layer.accumulation)


def _rank_phases(cases: list, reps: int, cold: bool) -> tuple[int, dict, list]:
    """Inside each rank: the rank's phases of every case, ``reps`` timed runs after a warm-up."""
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    groups, data, tick = GroupsCache("cpu"), CaseData(), _Timer(RANK_PHASES)
    outputs = []
    for rep in range(reps + 1):
        if rep == 1:
            tick.reset()
        for case in cases:
            if cold:
                data = CaseData()
            output = _rank_case(case, rank, groups, data, tick)
            if rep == reps:
                outputs.append(output)
    return rank, {k: (w / reps, c / reps) for k, (w, c) in tick.totals.items()}, outputs


def _parent_case(case, i: int, outputs: list[list[RankOutput]], data: CaseData, tick: _Timer) -> None:
    """The parent's phases of case ``i``, each timed into ``tick``."""
    ref = tick("reference", lambda: case_reference(case, outputs[0][i].accumulation, data))
    results = tick("compare", lambda: [check_rank(case, ref, rank_outputs[i]) for rank_outputs in outputs])
    assert all(r.ok for r in results), [r.detail for r in results]


def _parent_phases(cases: list, outputs: list[list[RankOutput]], reps: int, cold: bool, profile: bool):
    """In this process: the parent's phases of every case (outputs[r][i]: rank r's of case i)."""
    torch.set_num_threads(1)
    data, tick, prof = CaseData(), _Timer(PARENT_PHASES), cProfile.Profile()
    for rep in range(reps + 1):
        if rep == 1:
            tick.reset()
            if profile:
                prof.enable()
        for i, case in enumerate(cases):
            if cold:
                data = CaseData()
            _parent_case(case, i, outputs, data, tick)
    prof.disable()
    top = []
    if profile:
        cumulative: dict[str, float] = {}
        for (file, _, name), (_, _, _, ct, _) in pstats.Stats(prof).stats.items():
            if "moeshard" in file:
                key = f"{file.split('moeshard/')[-1]}:{name}"
                cumulative[key] = cumulative.get(key, 0.0) + ct
        top = sorted(((k, v / reps) for k, v in cumulative.items()), key=lambda kv: -kv[1])[:15]
    return {k: (w / reps, c / reps) for k, (w, c) in tick.totals.items()}, top


def _nothing() -> int:
    return 0


def _measure(cases: list, reps: int, cold: bool, profile: bool):
    world = cases[0].world_size
    if world == 1:
        ranks = [_rank_phases(cases, reps, cold)]
    else:
        ranks = spawn(_rank_phases, world, (cases, reps, cold), timeout_s=1800)
    ranks.sort(key=lambda r: r[0])
    parent, top = _parent_phases(cases, [r[2] for r in ranks], reps, cold, profile)
    print(f"  {'':>6}  " + "  ".join(f"{name:>15}" for name in RANK_PHASES + PARENT_PHASES) + "   (wall / CPU ms)")
    for rank, phases, _ in ranks:
        print(f"  rank {rank}  " + "  ".join(f"{phases[n][0] * 1e3:6.0f}/{phases[n][1] * 1e3:<6.0f}".rjust(15)
                                            for n in RANK_PHASES))
    print("  parent  " + " " * 17 * len(RANK_PHASES) + "  ".join(
        f"{parent[n][0] * 1e3:6.0f}/{parent[n][1] * 1e3:<6.0f}".rjust(15) for n in PARENT_PHASES))
    cpu = {n: sum(r[1][n][1] for r in ranks) for n in RANK_PHASES} | {n: parent[n][1] for n in PARENT_PHASES}
    print("  CPU s, all ranks + parent: " + ", ".join(f"{n} {cpu[n]:.2f}" for n in cpu)
          + f"; total {sum(cpu.values()):.2f}")
    return top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="case ids of the default matrix (moeshard check --list)")
    parser.add_argument("--all", action="store_true", help="every valid case of the default matrix, warm caches")
    parser.add_argument("--run", action="store_true", help="time Runner.run on the default matrix")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    matrix = generate(MatrixOptions())
    valid = [c for c in matrix if not c.skipped]
    if args.run:
        start = time.perf_counter()
        outcomes = Runner().run(valid)
        usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        print(f"Runner.run: {len(outcomes)} cases, {sum(o.status == 'pass' for o in outcomes)} passed, "
              f"{time.perf_counter() - start:.1f} s wall; CPU: this process {usage[0].ru_utime + usage[0].ru_stime:.1f} s, "
              f"ranks {usage[1].ru_utime + usage[1].ru_stime:.1f} s")
        return
    for world in (2, 4):
        start = time.perf_counter()
        spawn(_nothing, world)
        print(f"spawn: a world of {world} ranks started and stopped in {time.perf_counter() - start:.2f} s wall")
    if args.all:
        for world in sorted({c.world_size for c in valid}):
            cases = [c for c in valid if c.world_size == world]
            cases = [cases[i] for i in execution_order(cases)]
            start = time.perf_counter()
            print(f"world size {world}: {len(cases)} cases (2 runs: warm-up, timed)")
            _measure(cases, 1, False, False)
            print(f"  {time.perf_counter() - start:.1f} s wall")
    for case in select_ids(matrix, args.ids):
        print(f"== {case.id} (caches cleared before every run)")
        top = _measure([case], args.reps, True, True)
        print("  parent, cProfile cumulative ms per run (profiler overhead included):")
        for name, seconds in top:
            print(f"    {seconds * 1e3:8.1f}  {name}")
    usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"CPU of this script and its ranks: {sum(u.ru_utime + u.ru_stime for u in usage):.1f} s")


if __name__ == "__main__":
    main()

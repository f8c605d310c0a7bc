"""Where the seconds of ``moeshard check`` go, per phase of a case (CPU ranks, gloo).

    PYTHONPATH=src python3 scripts/check_profile.py ID [ID ...]     # chosen cases, 3 timed runs each
    PYTHONPATH=src python3 scripts/check_profile.py --all           # every valid case of the default matrix

Each rank repeats what ``moeshard.harness.execute.run_case`` does for a case, one phase at a time,
and measures each phase's wall time (``time.perf_counter``) and the CPU time of its thread
(``time.thread_time``, which a busy shared machine inflates far less than wall time):

  inputs    the case's weights and tokens (``harness.inputs``)
  build     ``MoELayer(...)``: configuration exchange, sharding, weight quantization
  forward   the layer's forward on this rank's tokens
  reference the fp64 reference of the rank's quantization domain, with its slack
  qerr      rank 0 only: the unquantized reference, for the quantization error
  compare   ``tolerances.compare`` of the rank's rows

With IDs, rank 0 also runs the timed repetitions under cProfile and prints the functions with
the largest cumulative time (inflated by the profiler's overhead; use them for proportions).
``spawn`` is the wall time of starting the world and tearing it down (a world that runs nothing).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time

import torch

from moeshard.config import QuantConfig
from moeshard.harness.cases import MatrixOptions, generate, select_ids
from moeshard.harness.execute import GroupsCache
from moeshard.harness.inputs import case_tokens, case_weights
from moeshard.layer import MoELayer
from moeshard.parallel.spawn import spawn
from moeshard.reference import reference_forward
from moeshard.tolerances import compare

PHASES = ("inputs", "build", "forward", "reference", "qerr", "compare")


def _phases(cases: list, reps: int, profile: bool) -> tuple[int, dict, list]:
    """Runs inside each rank: every case ``reps`` times after one warm-up run."""
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    cache = GroupsCache(side_channel=False)
    totals = {name: [0.0, 0.0] for name in PHASES}
    prof = cProfile.Profile()

    def tick(name, fn):
        t0, c0 = time.perf_counter(), time.thread_time()
        value = fn()
        totals[name][0] += time.perf_counter() - t0
        totals[name][1] += time.thread_time() - c0
        return value

    for rep in range(reps + 1):
        if rep == 1:
            for v in totals.values():
                v[:] = [0.0, 0.0]
            if profile:
                prof.enable()
        for case in cases:
            p, cfg = case.parallel, case.moe_config()
            groups = cache.get(p)
            weights = tick("inputs", lambda: case_weights(cfg, case.seed))
            xs = tick("inputs", lambda: case_tokens(cfg, case.seed, case.tokens))
            d = p.dp_rank(rank)
            layer = tick("build", lambda: MoELayer(cfg, quant=case.quant, groups=groups, backend=case.backend,
                                                   weights=weights))
            out = tick("forward", lambda: layer(xs[d]))
            domain, offset = (torch.cat(xs), sum(case.tokens[:d])) if p.enable_ep else (xs[d], 0)
            shards = 1 if p.enable_ep else p.tp
            ref = tick("reference", lambda: reference_forward(domain, weights, cfg, case.quant, shards,
                                                              accumulation=layer.accumulation))
            if rank == 0 and case.quant.quantized:
                tick("qerr", lambda: reference_forward(domain, weights, cfg, QuantConfig(), shards))
            tick("compare", lambda: compare(out, ref.rows(offset, offset + case.tokens[d]), cfg.dtype,
                                            case.quant.scheme))
    prof.disable()
    top = []
    if profile:
        cumulative: dict[str, float] = {}
        for (file, _, name), (_, _, _, ct, _) in pstats.Stats(prof).stats.items():
            if "moeshard" in file:
                key = f"{file.split('moeshard/')[-1]}:{name}"
                cumulative[key] = cumulative.get(key, 0.0) + ct
        top = sorted(((k, v / reps) for k, v in cumulative.items()), key=lambda kv: -kv[1])[:20]
    return rank, {k: (w / reps, c / reps) for k, (w, c) in totals.items()}, top


def _nothing() -> int:
    return 0


def _print_phases(results: list) -> None:
    print(f"  {'rank':>4}  " + "  ".join(f"{name:>16}" for name in PHASES) + "   (wall / CPU ms)")
    for rank, phases, _ in sorted(results, key=lambda r: r[0]):
        print(f"  {rank:>4}  " + "  ".join(f"{phases[n][0] * 1e3:7.0f}/{phases[n][1] * 1e3:<7.0f}"
                                           .rjust(16) for n in PHASES))
    cpu = {n: sum(r[1][n][1] for r in results) for n in PHASES}
    print("  all ranks, CPU ms: " + ", ".join(f"{n} {cpu[n] * 1e3:.0f}" for n in PHASES)
          + f"; total {sum(cpu.values()) * 1e3:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="case ids of the default matrix (moeshard check --list)")
    parser.add_argument("--all", action="store_true", help="every valid case of the default matrix, once")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    matrix = generate(MatrixOptions())
    for world in (2, 4):
        start = time.perf_counter()
        spawn(_nothing, world)
        print(f"spawn: a world of {world} ranks started and stopped in {time.perf_counter() - start:.2f} s wall")
    if args.all:
        valid = [c for c in matrix if not c.skipped]
        for world in sorted({c.world_size for c in valid}):
            cases = [c for c in valid if c.world_size == world]
            start = time.perf_counter()
            if world == 1:
                results = [_phases(cases, 1, False)]
            else:
                results = spawn(_phases, world, (cases, 1, False), timeout_s=1800)
            print(f"world size {world}: {len(cases)} cases, {time.perf_counter() - start:.1f} s wall "
                  "(2 runs: warm-up, timed)")
            _print_phases(results)
    for case in select_ids(matrix, args.ids):
        print(f"== {case.id}")
        results = spawn(_phases, case.world_size, ([case], args.reps, True))
        _print_phases(results)
        print("  rank 0, cProfile cumulative ms per run (profiler overhead included):")
        for name, seconds in results[0][2] if results[0][0] == 0 else next(r for r in results if r[0] == 0)[2]:
            print(f"    {seconds * 1e3:8.1f}  {name}")
    usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"CPU of this script and its ranks: {sum(u.ru_utime + u.ru_stime for u in usage):.1f} s")


if __name__ == "__main__":
    main()

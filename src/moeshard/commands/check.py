"""``moeshard check``: the verification matrix (see ``moeshard.harness``).

Exit codes (``moeshard.errors``): 0 every valid case passed; 1 a case failed or errored; 2 a bad
option; 3 nothing was verified (no valid case, or none could run here); 130 / 143 interrupted
by SIGINT / SIGTERM, after the table, the summary and ``--json`` of the cases that ran.
Text that is not ours (ids, reasons, a rank's error message) is printed without markup.
"""

from __future__ import annotations

import argparse
import collections
import signal
import time

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moeshard.commands.args import case_ids, ints, layouts, names, refuse_unread_flags, seed, timeout
from moeshard.errors import NothingVerified, Terminated
from moeshard.harness import cases as matrix
from moeshard.harness import report
from moeshard.harness.runner import CaseOutcome, Runner
from moeshard.outputs import check_output_path
from moeshard.parallel.capacity import available_memory, check_local_world
from moeshard.presets import SIZES


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="run the verification matrix against the single-device reference",
                       description="Run every layout x backend x quantization against the single-device "
                                   "reference. Exit code 0 only if no case failed or errored.")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: gloo ranks; cuda: NCCL, one process per GPU")
    p.add_argument("--world-sizes", default=None, help="comma list (default 1,2,4; --full adds 8)")
    p.add_argument("--layouts", default=None, help="e.g. dp2-tp2-ep,dp1-tp2-noep or 2,2,on;1,2,off (';' between layouts)")
    p.add_argument("--backends", default=None, help="comma list of backend names")
    p.add_argument("--quants", default=None, help="comma list: none, fp8_tensor, fp8_token, fp8_block, nvfp4, and <q>+defer")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma list of float32, bfloat16, float16")
    p.add_argument("--presets", default=None, help="comma list of model shape presets")
    p.add_argument("--tokens-per-rank", default=None, help="pin token counts per DP rank, e.g. 0,5 or 1,0,3,2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full", action="store_true", help="add world size 8, every preset for each combination and "
                                                       "larger shapes (medium on cpu, full size on cuda); implies --eplb")
    p.add_argument("--eplb", action="store_true", help="every EP layout x EP backend x redundant slots per rank (0, 1, "
                                                       "2) x skew (one, zipf) with expert-parallel load balancing "
                                                       "(default: a few such cases)")
    p.add_argument("--no-eplb", action="store_true", help="leave out the load-balancing cases")
    p.add_argument("--backward", action="store_true", help="add the gradient cases: every layout x backend x dtype's "
                                                           "input, parameter and norm gradients against the fp64 "
                                                           "single-device reference (ids ending /grad)")
    p.add_argument("--size", default=None, choices=list(SIZES), help="preset size (default small; --full: medium on "
                                                                    "cpu, full on cuda)")
    p.add_argument("--only", default=None, action="append", metavar="ID",
                   help="case ids to run, as --list prints them; repeat the option or separate ids by commas or "
                        "spaces (the commas inside an id's token counts, t0,5, stay part of it)")
    p.add_argument("--list", action="store_true", help="list the cases (and skip reasons) without running")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds one case may take before it counts as hung (finite, > 0)")
    p.add_argument("--explain", action="store_true", help="record every stage on every rank and name the first stage, "
                                                          "rank, token and expert that leave the bound (every case "
                                                          "with --only, else the failing ones)")
    p.add_argument("--verbose", "-v", action="store_true", help="print every case in the table (default: one row "
                                                                "per layout x backend)")
    p.add_argument("--show-skipped", action="store_true", dest="verbose", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def options(args) -> matrix.MatrixOptions:
    if args.eplb and args.no_eplb:
        raise ValueError("--eplb and --no-eplb contradict each other; give one of the two")
    if args.world_sizes is not None and not ints(args.world_sizes, "--world-sizes"):
        raise ValueError(f"--world-sizes {args.world_sizes!r}: no world size given (leave the option out for the "
                         f"default 1,2,4)")
    world_sizes = ints(args.world_sizes, "--world-sizes") if args.world_sizes else ((1, 2, 4, 8) if args.full else (1, 2, 4))
    chosen = None
    if args.layouts:
        chosen = layouts(args.layouts)
        if args.world_sizes is None:
            world_sizes = tuple(sorted({p.world_size for p in chosen}))
    dtypes = names(args.dtypes)
    assert dtypes is not None  # --dtypes has a default (float32,bfloat16): the parser never leaves it None
    return matrix.MatrixOptions(
        world_sizes=world_sizes, layouts=chosen, backends=names(args.backends), quants=names(args.quants),
        dtypes=dtypes, presets=names(args.presets),
        size=args.size or (("full" if args.device == "cuda" else "medium") if args.full else "small"),
        tokens_per_rank=ints(args.tokens_per_rank, "--tokens-per-rank") if args.tokens_per_rank else None,
        all_presets=args.full, seed=seed(args.seed),
        eplb="off" if args.no_eplb else ("full" if args.eplb or args.full else "default"),
        backward=args.backward)


def wide_console() -> Console:
    """A console at least 200 columns wide when output is not a terminal (logs, CI), where rich
    would otherwise squeeze the table into 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _not_run(case: matrix.Case, why: str) -> CaseOutcome:
    return CaseOutcome(case, "error", f"not run: {why}")


def _nothing_valid(cases: list[matrix.Case]) -> NothingVerified:
    reasons = collections.Counter(c.reason for c in cases)
    top = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(2))
    return NothingVerified(f"nothing to verify: 0 of {len(cases)} selected cases are valid ({top})")


def _check_memory(valid: list[matrix.Case], available: int | None) -> None:
    """Refuses, before anything runs, a selection whose largest case cannot fit in memory
    (``--size full`` on a CPU, say: every rank would make DeepSeek-V3's full weights)."""
    if available is None:
        return
    worst = max(valid, key=lambda c: c.memory_bytes())
    need = worst.memory_bytes()
    if need > available:
        raise ValueError(f"case {worst.id} needs about {need / 2**30:.1f} GiB of memory on its {worst.world_size} "
                         f"rank(s) but {available / 2**30:.1f} GiB is available; choose a smaller --size or fewer "
                         f"--presets / --world-sizes")


# --list prints the cases and runs none: the flags that shape a run are refused with it, not
# dropped (``--list --json F`` wrote no file, exit 0).
_MODE_FLAGS = (
    ("--json", "json", None, ("run",)),
    ("--explain", "explain", False, ("run",)),
    ("--timeout", "timeout", 120.0, ("run",)),
)
_MODE_NAMES = {"list": "--list", "run": "a run (without --list)"}


def run(args) -> int:
    refuse_unread_flags(args, "list" if args.list else "run", _MODE_FLAGS, _MODE_NAMES)
    console = wide_console()
    opts = options(args)
    case_timeout = timeout(args.timeout)
    if args.json is not None:
        check_output_path(args.json, "--json")
    cases = matrix.generate(opts)
    if args.only:
        only = case_ids(args.only)
        assert only is not None  # args.only was given
        cases = matrix.select_ids(cases, list(only), opts.seed)
    valid = [c for c in cases if not c.skipped]
    if args.list:
        for c in cases:
            # One line per case, never wrapped: the id must come back whole to --only.
            console.print(escape(c.id) + (f"  [dim]not applicable: {escape(c.reason)}[/]" if c.skipped else ""),
                          highlight=False, soft_wrap=True)
        console.print(f"{len(valid)} of {len(cases)} cases valid ({len(cases) - len(valid)} not applicable by construction)")
        return 0
    if not cases:
        raise ValueError("the filters select no case (see --list)")
    if not valid:
        raise _nothing_valid(cases)
    _check_memory(valid, available_memory())
    if args.device == "cpu":  # CUDA worlds larger than the GPUs are skipped, with the reason
        for world in sorted({c.world_size for c in valid}):
            check_local_world(world, "cpu", what="--world-sizes")
    if args.device == "cuda" and torch.cuda.device_count() == 0:
        raise NothingVerified(f"--device cuda: no CUDA device is visible, so none of the {len(valid)} valid cases "
                              f"can run")
    console.print(f"moeshard check: {len(valid)} of {len(cases)} cases valid on {args.device} (the others not "
                  f"applicable by construction), world sizes {sorted({c.world_size for c in cases})}")
    start = time.monotonic()
    finished: dict[str, CaseOutcome] = {}  # case id -> outcome, as the cases end
    interrupted: KeyboardInterrupt | None = None
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[last]}"), console=console, transient=True) as progress:
            task = progress.add_task("checking", total=len(cases), last="")

            def on_outcome(o) -> None:
                finished[o.case.id] = o
                progress.update(task, advance=1, last=escape(f"{o.status} {o.case.id}"))
                if o.status in ("fail", "error"):
                    progress.console.print(f"[bold red]{o.status}[/] {escape(o.case.id)}: {escape(o.reason)}",
                                           highlight=False)

            explain = ("all" if args.only else "failing") if args.explain else ""
            outcomes = Runner(args.device, case_timeout_s=case_timeout, on_outcome=on_outcome,
                              explain=explain).run(cases)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the ranks are stopped; report what ran
        interrupted = exc
        name = signal.Signals(exc.signum).name if isinstance(exc, Terminated) else "SIGINT"
        outcomes = [finished.get(c.id) or _not_run(c, f"interrupted by {name}") for c in cases]
    wall = time.monotonic() - start
    if args.verbose:
        report.print_table(console, outcomes)
    else:
        report.print_summary_table(console, outcomes)
    report.print_skips(console, outcomes)
    report.print_problems(console, outcomes)
    report.print_summary(console, outcomes, wall, args.device)
    if interrupted is not None:
        not_run = sum(o.reason.startswith("not run: interrupted") for o in outcomes)
        console.print(f"[bold red]interrupted[/]: {not_run} valid cases not run", highlight=False)
    if args.json is not None:
        report.write_json(args.json, outcomes, wall, args.device)
        console.print(f"wrote {escape(args.json)}", highlight=False)
    if interrupted is not None:
        raise interrupted
    if not any(o.status in ("pass", "fail", "error") for o in outcomes):
        reasons = collections.Counter(o.reason for o, c in zip(outcomes, cases, strict=True) if not c.skipped)
        raise NothingVerified(f"nothing was verified: every case was skipped on this machine "
                              f"({reasons.most_common(1)[0][0]})")
    return 0 if all(o.status in ("pass", "skip", "not_applicable") for o in outcomes) else 1

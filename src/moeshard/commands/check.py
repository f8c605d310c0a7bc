"""``moeshard check``: the verification matrix (see ``moeshard.harness``)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moeshard.commands.args import ints, layouts, names
from moeshard.harness import cases as matrix
from moeshard.harness import report
from moeshard.harness.runner import Runner
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
    p.add_argument("--size", default=None, choices=list(SIZES), help="preset size (default small; --full: medium on "
                                                                    "cpu, full on cuda)")
    p.add_argument("--only", default=None, help="comma list of case ids to run")
    p.add_argument("--list", action="store_true", help="list the cases (and skip reasons) without running")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one case may take before it counts as hung")
    p.add_argument("--show-skipped", action="store_true", help="list skipped cases in the table too")
    p.set_defaults(func=run)


def options(args) -> matrix.MatrixOptions:
    world_sizes = ints(args.world_sizes, "--world-sizes") if args.world_sizes else ((1, 2, 4, 8) if args.full else (1, 2, 4))
    chosen = None
    if args.layouts:
        chosen = layouts(args.layouts)
        if args.world_sizes is None:
            world_sizes = tuple(sorted({p.world_size for p in chosen}))
    return matrix.MatrixOptions(
        world_sizes=world_sizes, layouts=chosen, backends=names(args.backends), quants=names(args.quants),
        dtypes=names(args.dtypes), presets=names(args.presets),
        size=args.size or (("full" if args.device == "cuda" else "medium") if args.full else "small"),
        tokens_per_rank=ints(args.tokens_per_rank, "--tokens-per-rank") if args.tokens_per_rank else None,
        all_presets=args.full, seed=args.seed,
        # --only accepts any listed id, so it selects from every load-balancing case.
        eplb="off" if args.no_eplb else ("full" if args.eplb or args.full or args.only else "default"))


def wide_console() -> Console:
    """A console at least 200 columns wide when output is not a terminal (logs, CI), where rich
    would otherwise squeeze the table into 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def run(args) -> int:
    console = wide_console()
    opts = options(args)
    cases = matrix.generate(opts)
    if args.only:
        cases = matrix.select_ids(cases, list(names(args.only)))
    valid = [c for c in cases if not c.skipped]
    if args.list:
        for c in cases:
            console.print(c.id + (f"  [yellow]skip: {c.reason}[/]" if c.skipped else ""), highlight=False)
        console.print(f"{len(valid)} of {len(cases)} cases valid")
        return 0
    if not cases:
        raise ValueError("the filters select no case (see --list)")
    console.print(f"moeshard check: {len(valid)} of {len(cases)} cases valid on {args.device}, "
                  f"world sizes {sorted({c.world_size for c in cases})}")
    start = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[last]}"), console=console, transient=True) as progress:
        task = progress.add_task("checking", total=len(cases), last="")

        def on_outcome(o) -> None:
            progress.update(task, advance=1, last=f"{o.status} {o.case.id}")
            if o.status in ("fail", "error"):
                progress.console.print(f"[bold red]{o.status}[/] {o.case.id}: {o.reason}", highlight=False)

        outcomes = Runner(args.device, case_timeout_s=args.timeout, on_outcome=on_outcome).run(cases)
    wall = time.monotonic() - start
    report.print_table(console, outcomes, args.show_skipped)
    report.print_skips(console, outcomes)
    report.print_problems(console, outcomes)
    report.print_summary(console, outcomes, wall, args.device)
    if args.json:
        report.write_json(args.json, outcomes, wall, args.device)
        console.print(f"wrote {args.json}")
    return 0 if all(o.status in ("pass", "skip") for o in outcomes) else 1

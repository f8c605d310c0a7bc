"""Plant one of the test suite's faults (tests/faults.py) into a real case and show what
`moeshard check --explain` says about it: the run docs/explain.md quotes.

    .venv/bin/python scripts/explain_fault.py scales-reversed     # one fault
    .venv/bin/python scripts/explain_fault.py --list              # the faults and their cases

The case runs on CPU ranks exactly as `moeshard check --explain --only ID` runs it; only the
layer class differs (the faulty subclass). The faults are test-only code, so they stay in tests/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import faults  # noqa: E402  (tests/faults.py, found through the path above)

from moeshard.harness import report  # noqa: E402
from moeshard.harness.cases import MatrixOptions, generate  # noqa: E402
from moeshard.harness.runner import Runner  # noqa: E402
from moeshard.parallel.config import ParallelConfig  # noqa: E402

# name -> (layer class, layout, quant, backend, tokens per DP rank, preset, dtype, what it plants)
FAULTS = {
    "drops-row-under-sp": (faults.DropsRowUnderSP, "dp1-tp2-ep", "none", "allgather_reducescatter", (7,),
                           "deepseek-v3", "bfloat16", "rank 1 loses the last row it dispatches, under SP only"),
    "skips-combine": (faults.SkipsCombineWhenEmpty, "dp2-tp1-ep", "none", "all2all", (0, 5), "mixtral-8x7b",
                      "float32", "a rank with no tokens skips the combine all-to-all (its peer hangs)"),
    "mis-scaled-tp-slice": (faults.MisScaledTPSlice, "dp1-tp2-noep", "none", "local", (64,), "deepseek-v3",
                            "float32", "expert 1's slice on TP rank 1 is 3% too large"),
    "scales-reversed": (faults.ScalesReversedInDispatch, "dp2-tp1-ep", "fp8_token", "all2all", (5, 7),
                        "deepseek-v3", "bfloat16", "rank 0 packs its rows with the scales in reverse token order"),
    "shared-twice": (faults.SharedTwiceUnderSP, "dp1-tp2-ep", "none", "allgather_reducescatter", (7,),
                     "deepseek-v3", "bfloat16", "the shared experts are added twice under SP"),
    "ties-broken-high": (faults.TiesBrokenHighOnRank1, "dp2-tp1-ep", "none", "all2all", (64, 64), "mixtral-8x7b",
                         "bfloat16", "rank 1 breaks near-ties towards the higher expert index"),
    "miscounts": (faults.MiscountsOnRank1, "dp2-tp1-ep", "none", "allgather_reducescatter", (3, 5),
                  "mixtral-8x7b", "float32", "rank 1 believes it holds one row more than it does"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fault", nargs="?", choices=sorted(FAULTS))
    parser.add_argument("--list", action="store_true", help="list the faults and their cases")
    args = parser.parse_args()
    console = Console(highlight=False, width=200)
    if args.list or args.fault is None:
        for name, entry in FAULTS.items():
            console.print(f"{name:20s} {entry[1]} {entry[3]} {entry[2]}: {entry[-1]}")
        return 0
    layer, layout, quant, backend, tokens, preset, dtype, what = FAULTS[args.fault]
    p = ParallelConfig.parse(layout)
    opts = MatrixOptions(world_sizes=(p.world_size,), layouts=(p,), quants=(quant,), dtypes=(dtype,),
                         tokens_per_rank=tokens, backends=(backend,), presets=(preset,), eplb="off")
    (case,) = [c for c in generate(opts) if not c.skipped]
    console.print(f"planted: {what}\ncase: {case.id}")
    (outcome,) = Runner(layer_factory=layer, case_timeout_s=30, explain="all").run([case])
    report.print_problems(console, [outcome])
    return 0 if outcome.status in ("fail", "error") else 1  # the fault must be caught


if __name__ == "__main__":
    sys.exit(main())

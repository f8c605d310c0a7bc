"""The performance targets over several runs of ``moeshard bench`` on one machine: each target's
count in every run, and each missed case with its spread over the runs.

    PYTHONPATH=src python3 scripts/fp8_targets.py [--rounds 2] [--out DIR] [--timeout-s 300] \\
        [-- BENCH-ARGS...]
    PYTHONPATH=src python3 scripts/fp8_targets.py --report RUN.json [RUN.json ...]

The first form runs, in each round, bench A then bench B, each in its own process:

- A: ``moeshard bench --quants fp8_tensor,fp8_token,fp8_block --decode-tokens 1,16,128
  --reps 10 --no-baselines``;
- B: the same with ``--quants none,fp8_tensor,fp8_token,fp8_block`` (bf16 beside fp8, for the
  targets that compare them).

So two rounds give the runs A1, B1, A2, B2, in that order. ``BENCH-ARGS`` are added to both (for
example ``--models deepseek-v3``); the script sets ``--quants``, ``--json`` and ``--quiet``. It
writes, under ``--out`` (default ``results/<machine>/fp8-targets``): ``a-<r>.json``,
``b-<r>.json`` (each run's bench JSON) and ``.txt`` (its output); ``targets.txt`` and
``targets.json`` (the evaluation); then packs the folder into ``<out>.tar.gz`` (a device call
brings back at most 8 files).

The second form evaluates bench JSONs already written, named after their files, in the order
given, and prints the same text.

Each run is evaluated with this code's ``moeshard.bench.targets.evaluate`` (not the ``targets``
its JSON carries), so runs of older code are judged by today's definitions. The fused-MoE
targets are evaluated only for runs on the GPU their figures were timed on (an H200); on any
other the header says so, and the other targets, each a ratio within one run, are evaluated. Exit code 0 when every
run finished, 1 when one failed or timed out (``targets.txt`` says which), 2 for an argument it
refuses (before any run).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_ab import rounds_and_out, run_bench  # noqa: E402

from moeshard.bench.targets import FUSED_MOE_GPU, evaluate, fused_moe_applies  # noqa: E402

COMMON = ["--decode-tokens", "1,16,128", "--reps", "10", "--no-baselines"]
QUANTS = {"a": "fp8_tensor,fp8_token,fp8_block", "b": "none,fp8_tensor,fp8_token,fp8_block"}


def bench_args(kind: str, extra: list[str]) -> list[str]:
    """Bench A's or B's arguments (``kind`` "a" or "b"), with ``extra`` after them."""
    return ["--quants", QUANTS[kind], *COMMON, *extra]


def fmt(value: float, threshold: float) -> str:
    """A ratio with three decimals, or four where three would print a miss as the threshold
    (1.4996 against 1.5)."""
    text = f"{value:.3f}"
    return f"{value:.4f}" if value < threshold and text == f"{threshold:.3f}" else text


def per_run(names: list[str], runs: list[list[dict]]) -> str:
    """Each run's evaluation as text: a block per run, a line per target it covers, with its count
    and its misses (``runs[i]`` is ``evaluate``'s answer for the run ``names[i]``)."""
    lines = []
    for name, targets in zip(names, runs, strict=True):
        lines.append(f"== {name}")
        for t in targets:
            if t["met"] is None:
                continue
            misses = "; ".join(f"{c['case']} {fmt(c['value'], t['threshold'])}" for c in t["cases"] if not c["met"])
            lines.append(f"  {t['name']}: {sum(c['met'] for c in t['cases'])}/{len(t['cases'])}; misses: {misses}")
    return "\n".join(lines)


def across_runs(names: list[str], runs: list[list[dict]]) -> list[dict]:
    """One row per target: its count in each run (None where the run does not cover it) and each
    case missed in at least one run, with its values over every run that has it and how many of
    them missed."""
    rows = []
    for i, (target_name, threshold) in enumerate((t["name"], t["threshold"]) for t in runs[0]):
        counts: list[tuple[int, int] | None] = []
        cases: dict[str, list[float]] = {}
        for targets in runs:
            t = targets[i]
            assert t["name"] == target_name, "every run is evaluated with the same target list"
            counts.append((sum(c["met"] for c in t["cases"]), len(t["cases"])) if t["cases"] else None)
            for c in t["cases"]:
                cases.setdefault(c["case"], []).append(c["value"])
        if all(c is None for c in counts):
            continue
        misses = [{"case": case, "values": values, "missed_in": sum(v < threshold for v in values)}
                  for case, values in cases.items() if min(values) < threshold]
        rows.append({"name": target_name, "threshold": threshold, "runs": names, "counts": counts, "misses": misses})
    return rows


def table(rows: list[dict]) -> str:
    """``across_runs``'s rows as a Markdown table: target, met in each run, misses."""
    lines = [f"| target | met ({' / '.join(rows[0]['runs'])}) | misses: range over the runs (runs missed) |",
             "|---|---|---|"] if rows else []
    for row in rows:
        totals = {c[1] for c in row["counts"] if c}  # cases per run; said once where every run has as many
        met = " / ".join("-" if c is None else str(c[0]) for c in row["counts"])
        met += f" of {totals.pop()}" if len(totals) == 1 else ""
        th = row["threshold"]
        misses = "; ".join(
            f"{m['case']} {fmt(min(m['values']), th)}" + (f"-{fmt(max(m['values']), th)}" if len(m["values"]) > 1 else "")
            + f" ({m['missed_in']} of {len(m['values'])})" for m in row["misses"])
        lines.append(f"| `{row['name']}` (>= {row['threshold']:.3g}) | {met} | {misses or '-'} |")
    return "\n".join(lines)


def device_line(device: dict) -> str:
    """A bench JSON's ``device`` as one line ("name NVIDIA H200, capability 9.0, ..."; "?" if none)."""
    return ", ".join(f"{k} {v}" for k, v in device.items()) or "?"


def report(names: list[str], results: list[dict], header: list[str]) -> tuple[str, dict]:
    """The text and the JSON of an evaluation of the bench results ``results`` (their JSONs, in
    the order run), named ``names``."""
    gpus = [(r.get("device") or {}).get("name") for r in results]
    runs = [evaluate(r.get("records", []), gpu) for r, gpu in zip(results, gpus, strict=True)]
    rows = across_runs(names, runs)
    elsewhere = sorted({str(gpu) for gpu in gpus if not fused_moe_applies(gpu)})
    if elsewhere:  # say why the fused-MoE targets have no row rather than leave them out silently
        header = [*header, f"# fused-MoE targets: not evaluated on {', '.join(elsewhere)}; their figures are "
                           f"an {FUSED_MOE_GPU}'s (moeshard.bench.targets.FUSED_MOE_MS)"]
    text = "\n".join([*header, "", table(rows), "", per_run(names, runs)]) + "\n"
    return text, {"runs": names, "targets": rows, "per_run": dict(zip(names, runs, strict=True))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", nargs="+", type=Path, metavar="RUN.json",
                   help="evaluate these bench JSONs instead of running the bench")
    p.add_argument("--rounds", type=int, default=2, help="rounds of A then B (default 2)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default results/<machine>/fp8-targets)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="seconds one bench run may take (default 300)")
    args = p.parse_args(own)

    if args.report:
        if extra:
            p.error(f"--report evaluates runs already made; bench arguments {' '.join(extra)} have no use there")
        results = []
        for path in args.report:
            try:
                results.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                p.error(f"--report {path}: not a readable bench JSON: {exc}")
            if not isinstance(results[-1], dict) or not isinstance(results[-1].get("records"), list):
                p.error(f"--report {path}: no 'records' list; is it a moeshard bench JSON?")
        devices = sorted({device_line(r.get("device") or {}) for r in results})
        text, _ = report([path.stem for path in args.report], results,
                         ["# moeshard bench targets (moeshard.bench.targets.evaluate) of "
                          + ", ".join(str(path) for path in args.report), *(f"# device: {d}" for d in devices)])
        print(text, end="")
        return 0

    for name in ("--quants", "--json", "--quiet"):
        if name in extra:
            p.error(f"bench argument {name}: fp8_targets sets it itself")
    out = rounds_and_out(p, args, "fp8-targets")

    names, results, failed = [], [], []
    for r in range(1, args.rounds + 1):
        for kind in ("a", "b"):
            name = f"{kind}-{r}"
            print(f"fp8_targets: {name}", flush=True)
            run = run_bench(ROOT / "src", bench_args(kind, extra), out / f"{name}.json", out / f"{name}.txt",
                            args.timeout_s)
            names.append(name)
            results.append(run)
            if run["rc"] != 0:
                failed.append(f"{name}: rc={run['rc']} after {run['seconds']} s (see {name}.txt)")
    device = next((run["device"] for run in results if run.get("device")), {})
    header = ["# moeshard bench targets (moeshard.bench.targets.evaluate), runs in the order run: " + ", ".join(names),
              f"# a: moeshard bench {' '.join(bench_args('a', extra))}",
              f"# b: moeshard bench {' '.join(bench_args('b', extra))}",
              f"# device: {device_line(device)}",
              *(f"# FAILED {line}" for line in failed)]
    text, summary = report(names, results, header)
    (out / "targets.txt").write_text(text)
    (out / "targets.json").write_text(json.dumps({**summary, "device": device, "failed": failed,
                                                  "bench_args": {k: bench_args(k, extra) for k in QUANTS}}, indent=1))
    with tarfile.open(f"{out}.tar.gz", "w:gz") as tar:
        tar.add(out, arcname=out.name)
    print(text, end="")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

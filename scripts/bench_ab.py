"""Two codes' ``moeshard bench``, alternating on one machine: which is faster, by how much, and
how far one code's rounds spread.

    PYTHONPATH=src python3 scripts/bench_ab.py --base-src DIR [--new-src src] [--rounds 2] \\
        [--out DIR] [--timeout-s 240] -- BENCH-ARGS...

``BENCH-ARGS`` are ``moeshard bench``'s own (for example ``--quants fp8_tensor --prefill-tokens
4096 --decode-tokens 1 --no-baselines --reps 10``); the script adds ``--json`` and ``--quiet``.
Each round runs the bench once per code, each in its own process with ``PYTHONPATH`` at that
code's ``src``; the order alternates (base then new, then new then base, ...), so that a drift of
the machine over the run (clocks, power cap, a warming room) falls on both codes alike. The base
code is a source tree: on a machine without the repository's history, make it where the history
is and carry it, for example ``git archive BASE src | tar -x -C .device/base`` and then
``--base-src .device/base/src``.

Writes, under ``--out`` (default ``results/<machine>/ab``):
- ``base-<r>.json``, ``new-<r>.json``: each run's bench JSON; ``base-<r>.txt``, ``new-<r>.txt``:
  its output;
- ``summary.txt``, ``summary.json``: per case (the record's text fields and token count: model,
  regime, quant, ...) and per time it carries (``experts_ms``, ``layer_ms``, the backward's
  ``*_fwdbwd_ms``, ...), each round's milliseconds of either code, the medians, new / base (below
  1: new is faster) and whether every round of one code beat every round of the other;
then packs the folder into ``<out>.tar.gz`` (a device call brings back at most 8 files). Exit
code 0 when every run finished, 1 when one failed or timed out (the summary says which), 2 for
an argument it refuses (before any run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODES = ("base", "new")


def case_key(record: dict) -> tuple:
    """What identifies one measured case in a bench record, of any of the bench's modes: its
    text fields (model, regime, quant, run, ...) and its token count, as (name, value) pairs."""
    return tuple(sorted((k, v) for k, v in record.items() if isinstance(v, str) or k == "tokens"))


def times(record: dict) -> dict[str, float]:
    """A bench record's times: its number fields named ``*_ms`` (experts_ms, layer_ms,
    experts_fwdbwd_ms, ...)."""
    return {k: float(v) for k, v in record.items()
            if k.endswith("_ms") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def order(round_index: int) -> tuple[str, str]:
    """The codes' order in a round: base first in even rounds, new first in odd ones."""
    return CODES if round_index % 2 == 0 else CODES[::-1]


def verdict(rounds: dict[str, list[float]]) -> str:
    """How the two codes' rounds compare: ``faster`` when every round of the new code beat every
    round of the base, ``slower`` when every one lost, ``within spread`` when they overlap, ``-``
    when a code has none (a ratio of medians alone does not say whether the spread covers it)."""
    base, new = rounds.get("base", []), rounds.get("new", [])
    if not base or not new:
        return "-"
    if max(new) < min(base):
        return "faster"
    if min(new) > max(base):
        return "slower"
    return "within spread"


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per case from the bench JSONs of each code (``runs["base"]``, ``runs["new"]``, one
    dict per round): for each time the records carry, each round's value, the medians and new /
    base. A case or a time missing from one code's runs is kept with what there is (its ratio is
    None)."""
    cases: dict[tuple, dict[str, dict[str, list[float]]]] = {}
    for code in CODES:
        for run in runs.get(code, []):
            for record in run.get("records", []):
                row = cases.setdefault(case_key(record), {})
                for name, value in times(record).items():
                    row.setdefault(name, {c: [] for c in CODES})[code].append(value)
    rows = []
    for key in sorted(cases, key=repr):
        row: dict = {"case": dict(key), "times": {}}
        for name, rounds in cases[key].items():
            medians = {c: statistics.median(rounds[c]) if rounds[c] else None for c in CODES}
            ratio = medians["new"] / medians["base"] if medians["new"] and medians["base"] else None
            row["times"][name] = {"rounds": rounds, "median": medians, "new_over_base": ratio,
                                  "verdict": verdict(rounds)}
        rows.append(row)
    return rows


def render(rows: list[dict], header: list[str]) -> str:
    """The summary as text: one line per case and time, base rounds -> new rounds (new / base,
    ``verdict``)."""
    lines = [*header, ""]
    for row in rows:
        case = " ".join(f"{k}={v}" for k, v in row["case"].items())
        for name, t in row["times"].items():
            rounds = {c: "/".join(f"{v:.4f}" for v in t["rounds"][c]) or "-" for c in CODES}
            ratio = f"{t['new_over_base']:.3f}" if t["new_over_base"] is not None else "-"
            lines.append(f"{case} {name}: {rounds['base']} -> {rounds['new']} ({ratio}, {t['verdict']})")
    return "\n".join(lines) + "\n"


def run_bench(src: Path, bench_args: list[str], json_path: Path, log_path: Path, timeout_s: float) -> dict:
    """One ``moeshard bench`` with ``PYTHONPATH=src``; its JSON, or why there is none."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "moeshard", "bench", *bench_args, "--quiet", "--json", str(json_path)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        log_path.write_text(proc.stdout + proc.stderr)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log_path.write_text(out + f"\nbench_ab: timed out after {timeout_s:.0f} s\n")
        rc = "timeout"
    seconds = round(time.monotonic() - start, 1)
    if rc != 0 or not json_path.exists():
        return {"src": str(src), "rc": rc, "seconds": seconds, "records": []}
    return {**json.loads(json_path.read_text()), "src": str(src), "rc": rc, "seconds": seconds}


def rounds_and_out(p: argparse.ArgumentParser, args: argparse.Namespace, default: str) -> Path:
    """Checks ``args.rounds`` (at least 1) and ``args.timeout_s`` (finite, above 0), then makes
    the output folder ``args.out`` (default ``results/<machine>/<default>``) and returns it; a
    refusal is ``p.error`` naming the option and its value (exit code 2, before any run)."""
    if args.rounds < 1:
        p.error(f"--rounds: must be at least 1, got {args.rounds}")
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        p.error(f"--timeout-s: must be a finite number of seconds above 0, got {args.timeout_s}")
    if args.out is None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from gpu_gate import machine_name  # the GPU gate's folder naming: h200, h200x2, ...

        args.out = ROOT / "results" / machine_name() / default
    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # an existing file there, a read-only or virtual file system, ...
        p.error(f"--out {out}: cannot make the folder: {exc.strerror or exc}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-src", required=True, type=Path, help="the base code's src folder")
    p.add_argument("--new-src", type=Path, default=ROOT / "src", help="the new code's src folder (default: this src)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each code (default 2)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default results/<machine>/ab)")
    p.add_argument("--timeout-s", type=float, default=240.0, help="seconds one bench run may take (default 240)")
    args = p.parse_args(own)
    for name in ("--json", "--quiet"):
        if name in bench_args:
            p.error(f"bench argument {name}: bench_ab sets it itself")
    for flag, src in (("--base-src", args.base_src), ("--new-src", args.new_src)):
        if not (src / "moeshard" / "__init__.py").is_file():
            p.error(f"{flag}: {src} has no moeshard package (expected {src}/moeshard/__init__.py)")
    out = rounds_and_out(p, args, "ab")

    srcs = {"base": args.base_src.resolve(), "new": args.new_src.resolve()}
    runs: dict[str, list[dict]] = {c: [] for c in CODES}
    failed = []
    for r in range(1, args.rounds + 1):
        for code in order(r - 1):
            print(f"bench_ab: round {r}, {code} ({srcs[code]})", flush=True)
            run = run_bench(srcs[code], bench_args, out / f"{code}-{r}.json", out / f"{code}-{r}.txt", args.timeout_s)
            runs[code].append(run)
            if run["rc"] != 0:
                failed.append(f"{code}-{r}: rc={run['rc']} after {run['seconds']} s (see {code}-{r}.txt)")

    rows = summarize(runs)
    device = next((run["device"] for c in CODES for run in runs[c] if run.get("device")), {})
    header = [f"bench_ab: {args.rounds} rounds, alternating; each cell's times are base rounds -> new rounds "
              f"(new / base of the medians; faster or slower: in every round, else within spread)",
              f"bench arguments: {' '.join(bench_args) or '(none)'}",
              f"base: {srcs['base']}", f"new: {srcs['new']}",
              "device: " + (", ".join(f"{k} {v}" for k, v in device.items()) or "?"),
              *(f"FAILED {line}" for line in failed)]
    (out / "summary.txt").write_text(render(rows, header))
    (out / "summary.json").write_text(json.dumps({"bench_args": bench_args, "rounds": args.rounds,
                                                  "src": {c: str(s) for c, s in srcs.items()}, "device": device,
                                                  "failed": failed, "cases": rows}, indent=1))
    with tarfile.open(f"{out}.tar.gz", "w:gz") as tar:
        tar.add(out, arcname=out.name)
    print((out / "summary.txt").read_text(), end="")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

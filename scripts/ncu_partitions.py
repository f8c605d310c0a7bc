"""Where a warp-specialized Gluon GEMM's warps spend their time, per partition, from Nsight Compute's
stall sampling.

Nsight Compute samples each warp's program counter; its source page, written as CSV with the
SASS (``--section SourceCounters --page source --print-source sass --csv``), holds one row per
instruction with its address and sample count. In ``kernels.persistent_gate_up`` (and
``persistent_block_down``) each partition is its own stretch of code: the default partition (the
first MMA warpgroup) from the start, the other partitions after it, each entered through a
``USETMAXREG`` register hand-over, the loader's without warpgroup MMAs. This splits the samples
of one kernel into those partitions and, in each MMA partition, into its K loop (from the
mbarrier wait before its first warpgroup MMA to the wait for the last one, ``WARPGROUP.DEPBAR.LE
gsb0, 0x0``), the tile's start before it and the epilogue after it. Each partition has as many
warps, so each holds a third of the samples; within one, the shares are its warps' time.

    ncu --nvtx --nvtx-include "gluon/" --section SourceCounters --page source --print-source sass \\
        --csv python3 scripts/gate_up_profile.py --model qwen3-30b-a3b --tokens 4096 \\
        --scheme fp8_tensor > sass.csv
    python3 scripts/ncu_partitions.py sass.csv [--kernel persistent_gate_up_kernel] [--json out.json]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import sys
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass(frozen=True)
class Instruction:
    address: int  # bytes from the kernel's first instruction
    source: str  # the SASS text
    samples: float


def read_kernel(text: str, kernel: str) -> list[Instruction]:
    """The instructions of the first table whose "Kernel Name" line names ``kernel``, in address
    order. Raises ValueError when no table does, or when the table has no address or sample
    column."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"') and kernel in line]
    if not starts:
        raise ValueError(f"no source table of a kernel named {kernel!r} in the CSV")
    end = next((i for i in range(starts[0] + 1, len(lines)) if lines[i].startswith('"Kernel Name"')), len(lines))
    rows = list(csv.reader(io.StringIO("\n".join(lines[starts[0] + 1:end]))))
    header = rows[0]
    for column in ("Address", "Source", SAMPLES):
        if column not in header:
            raise ValueError(f"the {kernel!r} table has no {column!r} column; columns: {header[:6]} ...")
    at = {name: header.index(name) for name in ("Address", "Source", SAMPLES)}
    parsed = [(int(r[at["Address"]], 16), r[at["Source"]], float(r[at[SAMPLES]].replace(",", "") or 0))
              for r in rows[1:] if len(r) == len(header)]
    base = min(address for address, _, _ in parsed)
    return sorted((Instruction(address - base, source, samples) for address, source, samples in parsed),
                  key=lambda i: i.address)


def partitions(code: list[Instruction]) -> list[tuple[int, int]]:
    """[start, end) address ranges: the default partition from the start, each other partition
    from its entry (a ``USETMAXREG.DEALLOC`` after the first ``EXIT``: the default partition's
    own hand-over comes before it), the last ending after the last ``EXIT``; the code after that
    (waits' retry loops placed out of line, shared by the partitions) is a range of its own."""
    exits = [i.address for i in code if "EXIT" in i.source.split()]
    if not exits:
        raise ValueError("no EXIT in the kernel's code: not a kernel's source page")
    entries = [i.address for i in code if i.source.split()[0].startswith("USETMAXREG.DEALLOC") and i.address > exits[0]]
    bounds = [0, *entries, exits[-1] + 16, code[-1].address + 16]
    return [(lo, hi) for lo, hi in pairwise(bounds) if any(lo <= i.address < hi for i in code)]


def kind(code: list[Instruction]) -> str:
    """"mma" (warpgroup MMAs), "loader" (TMA loads or cp.async copies, no MMA) or "other"."""
    ops = {i.source.split()[0].split(".")[0] for i in code if i.source.split()}
    ops |= {i.source.split()[1].split(".")[0] for i in code if len(i.source.split()) > 1 and i.source.startswith("@")}
    if "QGMMA" in ops or "HGMMA" in ops:
        return "mma"
    return "loader" if ops & {"UTMALDG", "LDGSTS"} else "other"


def split(code: list[Instruction]) -> dict:
    """Each range's share of the kernel's samples (percent of all), and for MMA partitions the
    shares of their tile start, K loop and epilogue."""
    total = sum(i.samples for i in code) or 1.0
    share = lambda lo, hi: round(100 * sum(i.samples for i in code if lo <= i.address < hi) / total, 2)  # noqa: E731
    parts = []
    for lo, hi in partitions(code):
        inside = [i for i in code if lo <= i.address < hi]
        entry = {"start": lo, "end": hi, "kind": kind(inside), "samples": share(lo, hi)}
        if entry["kind"] == "mma":
            mmas = [i.address for i in inside if "GMMA." in i.source]
            waits = [i.address for i in inside if i.address < mmas[0] and "SYNCS.PHASECHK" in i.source]
            drains = [i.address for i in inside if i.address > mmas[-1] and "DEPBAR.LE gsb0, 0x0" in i.source]
            loop_lo = waits[-1] if waits else mmas[0]
            loop_hi = (drains[0] if drains else mmas[-1]) + 16
            entry.update(tile_start=share(lo, loop_lo), k_loop=share(loop_lo, loop_hi), epilogue=share(loop_hi, hi))
        parts.append(entry)
    return {"total_samples": total, "partitions": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu's source page as CSV (.gz read too)")
    ap.add_argument("--kernel", default="persistent_gate_up_kernel")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = Path(args.csv)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    try:
        result = split(read_kernel(text, args.kernel))
    except ValueError as err:
        sys.exit(f"ncu_partitions: {path}: {err}")
    for part in result["partitions"]:
        line = f"[{part['start']:#x}, {part['end']:#x}) {part['kind']:6s} {part['samples']:6.2f}%"
        if part["kind"] == "mma":
            line += f"  tile start {part['tile_start']:.2f}%  K loop {part['k_loop']:.2f}%  epilogue {part['epilogue']:.2f}%"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"csv": str(path), "kernel": args.kernel, **result}, indent=1))


if __name__ == "__main__":
    main()


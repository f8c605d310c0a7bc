"""How far two saved checkpoints' tensors are apart: the largest |a - b| of every tensor both hold.

    python3 scripts/checkpoint_diff.py DIR_A DIR_B [--atol 1e-4] [--json FILE]

Reads every ``*.safetensors`` file of each directory (a checkpoint's shards, or its optimizer
state under ``optimizer/`` when given that directory). The two must hold the same tensor names
and shapes; the largest absolute difference over all of them is judged against ``--atol``. Exit
code 0 when within it, 1 when beyond it or when the names or shapes differ, 2 on unreadable
input. The GPU gate uses it to check that an AdamW run saved after two steps and resumed for a
third gives the model three steps in one run give.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_tensors(directory: Path) -> dict:
    """name -> tensor (CPU, as stored) over every ``*.safetensors`` file directly in ``directory``."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors file")
    tensors: dict = {}
    for path in files:
        for name, tensor in load_file(path).items():
            if name in tensors:
                raise ValueError(f"{directory}: tensor {name!r} is in more than one file")
            tensors[name] = tensor
    return tensors


def diff(a: dict, b: dict) -> dict:
    """The comparison of two name -> tensor maps: names only one holds, shape mismatches, and the
    largest |a - b| (in float64) with the tensor that holds it."""
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    shapes = sorted(n for n in set(a) & set(b) if tuple(a[n].shape) != tuple(b[n].shape))
    worst, where = 0.0, None
    for name in sorted(set(a) & set(b)):
        if name in shapes or a[name].numel() == 0:
            continue
        d = float((a[name].double() - b[name].double()).abs().max())
        if d != d:  # NaN on either side is as far apart as it gets
            d = float("inf")
        if d > worst or where is None:
            worst, where = d, name
    return {"tensors": len(set(a) & set(b)), "only_in_a": only_a, "only_in_b": only_b, "shape_differs": shapes,
            "max_abs_diff": worst, "at": where}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--atol", type=float, default=1e-4, help="the largest |a - b| allowed (default 1e-4)")
    p.add_argument("--json", type=Path, default=None, help="also write the comparison here")
    args = p.parse_args(argv)
    if not args.atol >= 0:
        p.error(f"--atol must be >= 0, got {args.atol}")
    try:
        result = diff(read_tensors(args.a), read_tensors(args.b))
    except (OSError, ValueError) as exc:
        print(f"checkpoint_diff: {exc}", file=sys.stderr)
        return 2
    same_names = not (result["only_in_a"] or result["only_in_b"] or result["shape_differs"])
    result.update(atol=args.atol, within=same_names and result["max_abs_diff"] <= args.atol)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if not same_names:
        print(f"checkpoint_diff: the tensors differ: only in {args.a}: {result['only_in_a'][:6]}, only in {args.b}: "
              f"{result['only_in_b'][:6]}, shapes differ: {result['shape_differs'][:6]}")
    print(f"{result['tensors']} tensors in both; largest |a - b| {result['max_abs_diff']:.3g} at {result['at']} "
          f"(atol {args.atol:g}): {'within' if result['within'] else 'BEYOND'}")
    return 0 if result["within"] else 1


if __name__ == "__main__":
    sys.exit(main())

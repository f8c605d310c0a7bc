"""The router's one-pass top-k (``kernels.topk``) at tile variants: rows per program and warps,
at the bench models' expert counts, every variant's ids and weights checked against the
package's launch.

    PYTHONPATH=src python3 scripts/topk_study.py [--tokens 1,128,4096,16384] [--json FILE]

Cases, as the layer routes: Qwen3-30B-A3B and Mixtral softmax routing from bf16 logits
(``softmax_topk``: 128 experts top-8 renormalized, 8 experts top-2), DeepSeek-V3's selection on
fp32 scores with weights gathered from a second tensor (``topk_with_weights``: 256 experts,
top-8, renormalized, scaled). Each call is captured in a CUDA graph and timed after the bench's
L2 flush (``bench.timing``, median of --reps), the variants alternating over --rounds.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from moeshard.bench.timing import L2Flush, alternating_medians
from moeshard.kernels import topk

# (rows per program, warps): the narrow rows' tile first (the package's launch at every expert
# count when this study was run, code 697169e; the variants' bits are checked against it).
TILES = ((topk.ROWS, topk.WARPS), (8, 2), (4, 1), (8, 4), (16, 2), (32, 4), (32, 8), (2, 1))
CASES = {"qwen3-30b-a3b": (128, 8, "softmax"), "mixtral-8x7b": (8, 2, "softmax"), "deepseek-v3": (256, 8, "gather")}


def _call(launch_args: tuple, tile: tuple[int, int]):
    """The package's launch on ``launch_args`` (``topk._launch``'s) with ``tile``."""
    return lambda: topk._launch(*launch_args, rows_warps=tile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(CASES))
    ap.add_argument("--tokens", default="1,128,4096,16384")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    flush = L2Flush(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for model in args.models.split(","):
        E, k, kind = CASES[model]
        for T in map(int, args.tokens.split(",")):
            if kind == "softmax":
                logits = torch.randn(T, E, generator=gen, device="cuda").to(torch.bfloat16)
                args_of = (logits, k, None, True, 1e-20, 1.0, True)
            else:
                scores = torch.rand(T, E, generator=gen, device="cuda")
                choice = scores + torch.rand(E, generator=gen, device="cuda") * 0.1
                args_of = (choice, k, scores, True, 1e-20, 2.5, False)
            calls = {f"rows {r:2d} warps {w}": _call(args_of, (r, w)) for r, w in TILES}
            want = next(iter(calls.values()))()
            same = {name: all(torch.equal(a, b) for a, b in zip(fn(), want, strict=True)) for name, fn in calls.items()}
            times, medians = alternating_medians(calls, rounds=args.rounds, reps=args.reps, flush=flush)
            for name, ms in medians.items():
                results.append({"model": model, "tokens": T, "experts": E, "k": k, "call": name, "ms": ms,
                                "rounds_ms": times[name], "same_as_package": same[name]})
                print(f"{model:14} T={T:6d} {name:18} {1000 * ms:7.2f} us  rounds "
                      f"{' '.join(f'{1000 * v:.2f}' for v in times[name])}"
                      f"{'' if same[name] else '  DIFFERENT ids or weights'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 scripts/topk_study.py " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if k != "json"), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "triton": triton.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

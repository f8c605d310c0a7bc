"""Runs the per-row fp8 gate_up GEMM variants of ``scripts/gluon_gate_up_study.py`` once each, for a
profiler to attach to.

On the bench's workload for one model, token count and scheme, this launches gate_up with the
Triton kernel's selected tile, with its whole tiles, and with the Gluon kernel (``--stages``),
each ``--runs`` times after one warm-up launch, each variant inside an NVTX range of its name.
``--row-max`` (fp8_token) adds the Gluon kernel max-reducing each row's |h| into row maxima
(``moe_gemm(row_amax=...)``, "gluon_row_max"), to see what that epilogue costs.
Under Nsight Compute:

    ncu --nvtx --nvtx-include "gluon/" --set full -o gluon python3 scripts/gate_up_profile.py \\
        --model deepseek-v3 --tokens 4096 --scheme fp8_token
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from moeshard.bench.study import routed_case
from moeshard.bench.workload import make_model
from moeshard.kernels.align import align_rows
from moeshard.kernels.configs import multiprocessors, select_config
from moeshard.kernels.grouped_gemm import moe_gemm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--scheme", default="fp8_token", choices=("fp8_tensor", "fp8_token"))
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--row-max", action="store_true")
    args = ap.parse_args()
    if args.row_max and args.scheme != "fp8_token":
        raise SystemExit(f"--row-max: the row maxima are fp8_token's, got --scheme {args.scheme}")
    device = torch.device("cuda")
    case = routed_case(make_model(args.model, device), args.tokens, args.scheme)
    sms = multiprocessors(device.index)
    # The Triton kernel's tile as select_config picks it without the Gluon kernels, and variants of it.
    tile = select_config(case.M, case.E, case.H, case.I, args.scheme, sms, gluon=False).gate_up
    plan = align_rows(case.inp.expert_ids, case.E, tile.block_m)
    variants = {"triton": tile, "triton_whole": dataclasses.replace(tile, half_tiles=False),
                "gluon": dataclasses.replace(tile, engine="gluon", half_tiles=False, num_stages=args.stages)}
    h = torch.empty(plan.padded_rows, case.I, dtype=case.cfg.dtype, device=device)
    amax = torch.zeros(case.E, dtype=torch.float32, device=device) if case.spec.per_tensor_activation else None
    # Zeroed once: later launches max-reduce the same values into it.
    rows = torch.zeros(plan.padded_rows, dtype=torch.float32, device=device)
    runs = [(name, gemm, None) for name, gemm in variants.items()]
    if args.row_max:
        runs.append(("gluon_row_max", variants["gluon"], rows))
    for name, gemm, row_amax in runs:
        def run(gemm=gemm, row_amax=row_amax):
            moe_gemm(case.inp.x, case.experts.gate_up, plan, h, gemm, activation=case.cfg.activation, gather=True,
                     amax=amax, a_row_div=case.inp.repeat, row_amax=row_amax)
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        for _ in range(args.runs):
            run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"{name}: {gemm}")


if __name__ == "__main__":
    main()

"""Runs the experts at decode with the tiles ``select_config`` picks and with variants of
``scripts/decode_tile_study.py``, once each, for Nsight Compute to attach to.

The study measured that 256-column K steps stream an fp8 decode GEMM's weights faster than
128-column ones, whatever the tile width and depth; this script lets a profiler say why. On the
bench's workload for one model, token count and scheme, it calls ``TritonExperts`` with each named
variant (default: the chosen tiles, the deep-K pair, the narrow deep-pipeline pair and the widest
128-column pair, those of them that differ from the chosen tiles) ``--runs``
times after one warm-up call, each variant inside an NVTX range ``variant/<name>``, so that every
kernel of the call (plan, gate_up, down) is attributed to its variant. For example, the DRAM
throughput, the sectors per request and the warps' stall reasons of both GEMMs:

    ncu --nvtx --nvtx-include "variant/" --set full -o decode_tiles \\
        python3 scripts/decode_tile_profile.py --model deepseek-v3 --tokens 16 --scheme fp8_tensor
    ncu --import decode_tiles.ncu-rep --page details --print-nvtx-rename kernel > decode_tiles.txt

A name that the study does not define for the chosen tile height is refused, listing those it
does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_tile_study import variants  # noqa: E402

from moeshard.bench.study import routed_case  # noqa: E402
from moeshard.bench.workload import make_model  # noqa: E402
from moeshard.kernels.configs import gpu_kind, multiprocessors, select_config  # noqa: E402
from moeshard.kernels.experts import TritonExperts, gluon_supported  # noqa: E402
from moeshard.kernels.pdl import supported as pdl_supported  # noqa: E402

# The chosen tiles, the deep-K pair, the narrow deep-pipeline pair and the widest 128-column pair:
# those of them that differ from the chosen tiles.
DEFAULT = ("chosen", "g32x256s4+d64x256s3", "g32x128s6+d64x128s6", "g128x128s4+d128x128s4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--scheme", default="fp8_tensor", choices=("fp8_tensor", "fp8_token", "fp8_block"))
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated study variant names (default: those of {','.join(DEFAULT)} the chosen "
                         "tiles have)")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs: must be at least 1, got {args.runs}")
    device = torch.device("cuda")
    case = routed_case(make_model(args.model, device), args.tokens, args.scheme)
    chosen = select_config(case.M, case.E, case.H, case.I, args.scheme, multiprocessors(device.index),
                           pdl=pdl_supported(device), gluon=gluon_supported(device), gpu=gpu_kind(device.index))
    known = variants(chosen, args.scheme, case.I)
    names = [n for n in args.variants.split(",") if n] if args.variants else [n for n in DEFAULT if n in known]
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"--variants {','.join(unknown)}: not a variant of the chosen {chosen.block_m}-row tiles "
                 f"({args.model}, {args.tokens} tokens, {case.M} rows); the study has {', '.join(known)}")
    for name in names:
        cfg = known[name]
        kernel = TritonExperts(case.cfg.activation, case.cfg.dtype, cfg)
        kernel(case.inp, case.experts)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"variant/{name}")
        for _ in range(args.runs):
            kernel(case.inp, case.experts)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"{name}: gate_up {cfg.gate_up}; down {cfg.down}; h_quant {cfg.h_quant}")


if __name__ == "__main__":
    main()

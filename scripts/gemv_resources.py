"""Registers, spills and the loads and arithmetic of the one-token GEMVs, without a GPU.

Compiles ``moeshard.kernels.gemv``'s ``_gate_up_gemv_kernel`` and ``_down_gemv_kernel`` for
Hopper (sm_90a) with the installed Triton, for the fp8 schemes and the block shapes of the decode
tile study (``scripts/decode_tile_study.py``'s ``GEMV``), under PDL, and reads the cubin as
``scripts/kernel_resources.py`` does: registers and stack (``cuobjdump --dump-resource-usage``),
local-memory loads and stores (``LDL`` / ``STL``: spills), the weights' 16-byte loads
(``LDG.E.128``), fp32 FMAs (``FFMA``), e4m3 pair conversions (``F2FP.F16.E4M3.UNPACK_B``) and fp16
to fp32 ones (``HADD2.F32``), and cross-thread reductions (``SHFL.BFLY``).

    python scripts/gemv_resources.py            # the table
    python scripts/gemv_resources.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_resources import SM90, cuobjdump  # noqa: E402

from moeshard.kernels.gemv import _down_gemv_kernel, _gate_up_gemv_kernel  # noqa: E402

GATE_UP_POINTERS = {"x_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                    "ids_ptr": "*i64", "h_ptr": "*bf16", "amax_ptr": "*fp32", "bias_ptr": "*bf16"}
GATE_UP_INTS = ("N", "K", "up_offset", "x_row_div", "stride_xm", "stride_xsm", "stride_xsk", "stride_we",
                "stride_wn", "stride_wse", "stride_wsn", "stride_wsk", "stride_hm", "stride_be")
DOWN_POINTERS = {"h_ptr": "*bf16", "h_amax_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                 "ids_ptr": "*i64", "y_ptr": "*bf16", "bias_ptr": "*bf16"}
DOWN_INTS = ("N", "K", "stride_hm", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_wsk", "stride_ym",
             "stride_be")
# As at run time: unit strides specialised to 1; pointers, sizes and row strides that are
# multiples of 16 carry that divisibility (vectorised, aligned loads).
ALIGNED = ("N", "K", "up_offset", "stride_xm", "stride_we", "stride_wn", "stride_hm", "stride_ym")
OPS = ("LDG.E.128", "FFMA", "F2FP.F16.E4M3.UNPACK_B", "HADD2.F32", "SHFL.BFLY")
# (quant mode, block_n, block_k, warps) compiled for each kernel.
SHAPES = tuple((quant, *shape) for quant in (1, 2, 3)
               for shape in ((16, 512, 4), (16, 256, 4), (32, 256, 4), (16, 256, 2), (64, 256, 8)))


def _compile(fn, pointers: dict, ints: tuple, consts: dict, warps: int):
    sig = {**pointers, **{name: "i32" for name in ints}, **{name: "constexpr" for name in consts}}
    names = list(fn.arg_names)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in (*pointers, *ALIGNED) if name in names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=SM90,
                          options={"num_warps": warps, "num_stages": 1})


def compile_gate_up(quant: int, block_n: int, block_k: int, warps: int, pdl: bool = True):
    """``_gate_up_gemv_kernel`` for a gated SwiGLU, the scheme's amax tracking as the experts ask."""
    consts = {"stride_xk": 1, "stride_wk": 1, "QUANT": quant, "ACT": 0, "ACT_P0": 0.0, "ACT_P1": 0.0, "UP": True,
              "BIAS": False, "H_TY": tl.bfloat16, "TRACK_AMAX": {1: 1, 2: 2}.get(quant, 0), "EVEN_K": True, "PDL": pdl,
              "BLOCK_N": block_n, "BLOCK_K": block_k}
    return _compile(_gate_up_gemv_kernel, GATE_UP_POINTERS, GATE_UP_INTS, consts, warps)


def compile_down(quant: int, block_n: int, block_k: int, warps: int, pdl: bool = True):
    consts = {"stride_wk": 1, "QUANT": quant, "BIAS": False, "EVEN_K": True, "PDL": pdl, "BLOCK_N": block_n,
              "BLOCK_K": block_k}
    return _compile(_down_gemv_kernel, DOWN_POINTERS, DOWN_INTS, consts, warps)


def resources(kernel) -> dict:
    usage = cuobjdump(kernel, "--dump-resource-usage")
    sass = cuobjdump(kernel, "--dump-sass")
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return {"registers": int(regs.group(1)) if regs else -1, "stack_bytes": int(stack.group(1)) if stack else -1,
            "spill_loads": len(re.findall(r"\bLDL\b", sass)), "spill_stores": len(re.findall(r"\bSTL\b", sass)),
            **{op: len(re.findall(re.escape(op) + r"(?![.\w])", sass)) for op in OPS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for kernel, build in (("gate_up", compile_gate_up), ("down", compile_down)):
        for quant, block_n, block_k, warps in SHAPES:
            r = {"kernel": kernel, "quant": quant, "block_n": block_n, "block_k": block_k, "warps": warps,
                 **resources(build(quant, block_n, block_k, warps))}
            rows.append(r)
            print(f"{kernel:8s} mode {quant} {block_n:3d} x {block_k:4d} w{warps}  regs {r['registers']:3d} "
                  f"LDL {r['spill_loads']:3d} STL {r['spill_stores']:3d}  "
                  + "  ".join(f"{op} {r[op]}" for op in OPS), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Registers, spills, shared memory and the instructions of the Gluon down GEMM, without a GPU.

Compiles ``moeshard.kernels.persistent_down.persistent_down_kernel`` for Hopper (sm_90a) with the
installed Triton, at 2-4 stages of its ring of loads, and reads the cubin as
``scripts/kernel_resources.py`` does: registers (``cuobjdump --dump-resource-usage``), local-memory
loads and stores (``LDL`` / ``STL``: spills), fp8 warpgroup MMAs (``QGMMA``) and TMA loads
(``UTMALDG``) in the SASS, and the shared memory it asks for. Gluon is Triton's experimental
layer, whose names move between releases; this is also the check that the kernel still compiles.

    python scripts/gluon_resources.py            # the table
    python scripts/gluon_resources.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_resources import SM90, cuobjdump  # noqa: E402

from moeshard.kernels.persistent_down import persistent_down_kernel  # noqa: E402

INTS = ("num_experts", "N", "K", "stride_asm", "stride_wse", "stride_wsn", "stride_om")
POINTERS = {"out_ptr": "*bf16", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "sorted_rows_ptr": "*i32",
            "tile_expert_ptr": "*i32", "start_ptr": "*i32", "count_ptr": "*i32"}


def compile_down(stages: int, block_m: int = 128, block_n: int = 256, block_k: int = 128, warps: int = 8):
    """The kernel compiled for sm_90a (a Triton ``CompiledKernel``) with fp8 h and weights
    through TMA descriptors of [block_m, block_k] and [block_n, block_k] blocks."""
    descs = {}
    for name, rows in (("a_desc", block_m), ("w_desc", block_n)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, block_k], gl.float8e4nv)
        descs[name] = f"tensordesc<fp8e4nv[{rows}, {block_k}],{layout!r}>"
    consts = {"STAGES": stages, "GROUP_M": 8, "num_warps": warps}
    sig = {**descs, **POINTERS, **{name: "i32" for name in INTS}, **{name: "constexpr" for name in consts}}
    names = list(persistent_down_kernel.arg_names)
    src = GluonASTSource(fn=persistent_down_kernel, signature=sig,
                         constexprs={(names.index(name),): value for name, value in consts.items()})
    return triton.compile(src, target=SM90, options={"num_warps": warps})


def resources(stages: int) -> dict:
    kernel = compile_down(stages)
    usage = cuobjdump(kernel, "--dump-resource-usage")
    sass = cuobjdump(kernel, "--dump-sass")
    regs = re.search(r"REG:(\d+)", usage)
    return {"stages": stages, "registers": int(regs.group(1)) if regs else -1, "shared": kernel.metadata.shared,
            "spill_loads": len(re.findall(r"\bLDL\b", sass)), "spill_stores": len(re.findall(r"\bSTL\b", sass)),
            "QGMMA": sass.count("QGMMA"), "UTMALDG": sass.count("UTMALDG")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [resources(stages) for stages in (2, 3, 4)]
    for r in rows:
        print(" ".join(f"{k} {v}" for k, v in r.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Registers, spills, shared memory and the instructions of the Gluon GEMMs, without a GPU.

Compiles ``moeshard.kernels.persistent_down.persistent_down_kernel`` at 2-4 stages of its ring of
loads, ``moeshard.kernels.persistent_gate_up.persistent_gate_up_kernel`` at 3 and 4 (and with
fp8_block's block scales in 64- and 128-column tiles) and
``moeshard.kernels.persistent_block_down.persistent_block_down_kernel`` at 4 and 6 for Hopper
(sm_90a) with the installed Triton, and reads the cubin as ``scripts/kernel_resources.py`` does:
registers (``cuobjdump --dump-resource-usage``; the gate_up kernel's is what each thread starts
with, before its partitions trade them), local-memory loads and stores (``LDL`` / ``STL``:
spills), fp8 warpgroup MMAs (``QGMMA``), TMA loads (``UTMALDG``), cp.async copies (``LDGSTS``) and
their mbarrier arrivals (``ARRIVES``), register hand-overs between partitions (``USETMAXREG``) in
the SASS, and the shared memory it asks for. Gluon is Triton's experimental layer, whose names
move between releases; this is also the check that the kernels still compile.

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

from moeshard.kernels.persistent_block_down import persistent_block_down_kernel  # noqa: E402
from moeshard.kernels.persistent_down import persistent_down_kernel  # noqa: E402
from moeshard.kernels.persistent_gate_up import _MAXNREG, PARTITION_WARPS, persistent_gate_up_kernel  # noqa: E402

INTS = ("num_experts", "N", "K", "stride_asm", "stride_wse", "stride_wsn", "stride_om")
POINTERS = {"out_ptr": "*bf16", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "sorted_rows_ptr": "*i32",
            "tile_expert_ptr": "*i32", "start_ptr": "*i32", "count_ptr": "*i32"}


def compile_down(stages: int, block_m: int = 128, block_n: int = 256, block_k: int = 128, warps: int = 8,
                 col_scales: bool = False):
    """The kernel compiled for sm_90a (a Triton ``CompiledKernel``) with fp8 h and weights
    through TMA descriptors of [block_m, block_k] and [block_n, block_k] blocks; col_scales: one
    weight scale per output column (fp8_token), else one per expert (fp8_tensor)."""
    descs = {}
    for name, rows in (("a_desc", block_m), ("w_desc", block_n)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, block_k], gl.float8e4nv)
        descs[name] = f"tensordesc<fp8e4nv[{rows}, {block_k}],{layout!r}>"
    consts = {"W_COL_SCALES": col_scales, "STAGES": stages, "GROUP_M": 8, "num_warps": warps}
    if col_scales:
        consts["stride_wsn"] = 1  # fp8_token's [E, H] scales: a constant at launch
    sig = {**descs, **POINTERS, **{name: "i32" for name in INTS}, **{name: "constexpr" for name in consts}}
    names = list(persistent_down_kernel.arg_names)
    src = GluonASTSource(fn=persistent_down_kernel, signature={name: sig[name] for name in names},
                         constexprs={(names.index(name),): value for name, value in consts.items()})
    return triton.compile(src, target=SM90, options={"num_warps": warps})


def compile_gate_up(stages: int, block: int = 128, track_amax: int = 1, block_n: int = 128,
                    block_scales: bool = False):
    """The gate_up kernel compiled for sm_90a with fp8 weights through a TMA descriptor of
    [block_n, block] blocks (``persistent_gate_up``'s 128 x block_n x 128 tile); track_amax 1:
    the per-expert amax (fp8_tensor), 2: the row maxima (fp8_token); block_scales: fp8_block."""
    layout = gl.NVMMASharedLayout.get_default_for([block_n, block], gl.float8e4nv)
    sig = {"a_ptr": "*fp8e4nv", "w_desc": f"tensordesc<fp8e4nv[{block_n}, {block}],{layout!r}>",
           "amax_ptr": "*fp32", "counter_ptr": "*i32", **POINTERS}
    sig.update({name: "i32" for name in ("num_experts", "N", "K", "a_row_div", "stride_am", "stride_asm",
                                         "stride_ask", "stride_wse", "stride_wsn", "stride_wsk", "stride_om")})
    consts = {"ACT": 0, "TRACK_AMAX": track_amax, "BLOCK_SCALES": block_scales, "W_COL_SCALES": track_amax == 2,
              "BLOCK_M": block, "BLOCK_K": block, "STAGES": stages, "GROUP_M": 8, "num_warps": PARTITION_WARPS.value}
    if track_amax == 2:
        # fp8_token's [E, 2I] weight scales: their column stride is 1, which the launch makes a constant.
        consts["stride_wsn"] = 1
    sig.update({name: "constexpr" for name in consts})
    names = list(persistent_gate_up_kernel.arg_names)
    # As at run time: pointers, sizes and strides that are multiples of 16 carry that divisibility.
    aligned = ["a_ptr", "out_ptr", "w_scale_ptr", "N", "K", "stride_am", "stride_om"] + \
        (["stride_wse"] if track_amax == 2 else [])  # fp8_token's 2I
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = GluonASTSource(fn=persistent_gate_up_kernel, signature={name: sig[name] for name in names},
                         constexprs={(names.index(name),): value for name, value in consts.items()}, attrs=attrs)
    return triton.compile(src, target=SM90, options={"num_warps": PARTITION_WARPS.value, "maxnreg": _MAXNREG})


# The gate_up variants: (track_amax, block_n, block_scales).
GATE_UP = {"gate_up": (1, 128, False), "gate_up_rows": (2, 128, False),
           "gate_up_block64": (0, 64, True), "gate_up_block128": (0, 128, True)}


def compile_block_down(stages: int, block: int = 128):
    """fp8_block's warp-specialized down kernel compiled for sm_90a with h and the weights through
    TMA descriptors of [block, block] blocks."""
    layout = gl.NVMMASharedLayout.get_default_for([block, block], gl.float8e4nv)
    desc = f"tensordesc<fp8e4nv[{block}, {block}],{layout!r}>"
    sig = {"a_desc": desc, "w_desc": desc, "counter_ptr": "*i32", **POINTERS}
    sig.update({name: "i32" for name in ("num_experts", "N", "K", "stride_asm", "stride_ask", "stride_wse",
                                         "stride_wsn", "stride_wsk", "stride_om")})
    consts = {"STAGES": stages, "GROUP_M": 8, "num_warps": PARTITION_WARPS.value}
    sig.update({name: "constexpr" for name in consts})
    names = list(persistent_block_down_kernel.arg_names)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ("out_ptr", "N", "K", "stride_om")}
    src = GluonASTSource(fn=persistent_block_down_kernel, signature={name: sig[name] for name in names},
                         constexprs={(names.index(name),): value for name, value in consts.items()}, attrs=attrs)
    return triton.compile(src, target=SM90, options={"num_warps": PARTITION_WARPS.value, "maxnreg": _MAXNREG})


def resources(kernel_name: str, stages: int) -> dict:
    """kernel_name: "down" (fp8_tensor's weight scales), "down_rows" (fp8_token's), "block_down",
    or one of ``GATE_UP``: "gate_up" (the per-expert amax), "gate_up_rows" (the row maxima),
    "gate_up_block64" / "gate_up_block128" (fp8_block's block scales, 64- and 128-column
    tiles)."""
    if kernel_name in ("down", "down_rows"):
        kernel = compile_down(stages, col_scales=kernel_name == "down_rows")
    elif kernel_name == "block_down":
        kernel = compile_block_down(stages)
    else:
        track_amax, block_n, block_scales = GATE_UP[kernel_name]
        kernel = compile_gate_up(stages, track_amax=track_amax, block_n=block_n, block_scales=block_scales)
    usage = cuobjdump(kernel, "--dump-resource-usage")
    sass = cuobjdump(kernel, "--dump-sass")
    regs = re.search(r"REG:(\d+)", usage)
    return {"kernel": kernel_name, "stages": stages, "registers": int(regs.group(1)) if regs else -1,
            "shared": kernel.metadata.shared, "spill_loads": len(re.findall(r"\bLDL\b", sass)),
            "spill_stores": len(re.findall(r"\bSTL\b", sass)), "global_loads": len(re.findall(r"\bLDG\.E", sass)),
            **{op: sass.count(op) for op in ("QGMMA", "UTMALDG", "LDGSTS", "ARRIVES", "USETMAXREG")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [resources("down", stages) for stages in (2, 3, 4)] + [resources("down_rows", 3)] + \
        [resources("gate_up", stages) for stages in (3, 4)] + \
        [resources("gate_up_rows", 3)] + [resources("gate_up_block64", stages) for stages in (4, 6)] + \
        [resources("gate_up_block128", stages) for stages in (3, 4)] + \
        [resources("block_down", stages) for stages in (4, 6)]
    for r in rows:
        print(" ".join(f"{k} {v}" for k, v in r.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()

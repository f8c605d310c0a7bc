"""Registers, spills and tensor-core instructions of the grouped GEMM's variants, without a GPU.

Compiles ``moeshard.kernels.grouped_gemm.moe_gemm_kernel`` for Hopper (sm_90a) with the installed
Triton, reads registers and stack frame of the cubin (``cuobjdump --dump-resource-usage``), counts local
memory loads and stores (``LDL`` / ``STL``: spills) and the matrix instructions in its SASS
(``HGMMA``: bf16/fp16 wgmma; ``QGMMA``: fp8 wgmma; ``HMMA``: mma.sync), for each tile shape and
fp8 accumulation mode given below. Pointer-loaded weights only (TMA descriptors need a device).
The Triton here may be newer than the GPU machine's, so treat small differences as noise.

    python scripts/kernel_resources.py            # the table
    python scripts/kernel_resources.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moeshard.kernels.grouped_gemm import FP8_ACC_MODES, k_sub_step, moe_gemm_kernel
from moeshard.kernels.modes import one_w_scale_per_tile

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SM90 = GPUTarget("cuda", 90, 32)
POINTERS = ("a_ptr", "a_half_ptr", "a_scale_ptr", "a_global_ptr", "w_ptr", "w_scale_ptr", "w_global_ptr", "out_ptr",
            "out_scale_ptr", "amax_ptr", "bias_ptr", "sorted_rows_ptr", "tile_expert_ptr", "start_ptr", "count_ptr")
INTS = ("num_tiles", "expert_lo", "expert_hi", "N", "K", "N_w", "up_offset", "a_row_div", "stride_am", "stride_ak",
        "stride_asm", "stride_ask", "stride_ag", "stride_we", "stride_wn", "stride_wk", "stride_wse", "stride_wsn",
        "stride_wsk", "stride_om", "stride_on", "stride_osm", "stride_be")
# (name, quant mode, a/w element, fused gate_up, compile_gemm's other options: quant_out, h
# quantized as gate_up stores it; act, bias: gpt-oss's clamped SwiGLU (mode 3) and expert biases)
CLAMPED_BIASED = {"act": 3, "bias": True}
PROBLEMS = (("bf16 gate_up", 0, "bf16", True, {}), ("bf16 down", 0, "bf16", False, {}),
            ("fp8_tensor gate_up", 1, "fp8e4nv", True, {}), ("fp8_tensor down", 1, "fp8e4nv", False, {}),
            ("fp8_block gate_up", 3, "fp8e4nv", True, {}), ("fp8_block down", 3, "fp8e4nv", False, {}),
            ("fp8_block gate_up, h quantized", 3, "fp8e4nv", True, {"quant_out": True}),
            ("bf16 gate_up, clamped, biased", 0, "bf16", True, CLAMPED_BIASED),
            ("fp8_tensor gate_up, clamped, biased", 1, "fp8e4nv", True, CLAMPED_BIASED),
            ("fp8_tensor down, biased", 1, "fp8e4nv", False, {"bias": True}),
            # gpt-oss's intermediate size (2880, not a multiple of 128): a vector of weight scales
            ("fp8_block gate_up, N 2880", 3, "fp8e4nv", True, {"n": 2880}),
            ("fp8_block gate_up, N 2880, clamped, biased", 3, "fp8e4nv", True, {**CLAMPED_BIASED, "n": 2880}),
            # one token's down GEMM on the direct plan, quantizing h's one row as it loads it
            ("fp8_tensor down, direct", 1, "fp8e4nv", False, {"direct": True}),
            ("fp8_tensor down, direct, h quantized", 1, "fp8e4nv", False, {"direct": True, "quant_a": True}),
            ("fp8_token down, direct, h quantized", 2, "fp8e4nv", False, {"direct": True, "quant_a": True}),
            ("fp8_block down, direct, h quantized", 3, "fp8e4nv", False, {"direct": True, "quant_a": True}))
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = ((16, 32, 128, 4, 6), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (32, 64, 128, 4, 4),
         (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 128, 8, 3), (128, 64, 128, 8, 4), (128, 128, 64, 8, 4),
         (128, 128, 128, 8, 3))


def compile_gemm(quant: int, elt: str, fused: bool, tile: tuple, fp8_acc: str, half_tiles: bool = False,
                 pdl: bool = False, quant_out: bool = False, track_amax: int = 0, direct: bool = False,
                 act: int = 0, bias: bool = False, n: int = 128, quant_a: bool = False, prefetch_bytes: int = 0):
    """``moe_gemm_kernel`` compiled for sm_90a (a Triton ``CompiledKernel``) with the given
    constexprs: tile = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); quant_out: gate_up
    stores h as fp8_block values and scales (``moe_gemm``'s out_scale); track_amax: 1 per-expert
    amax, 2 per-position row maxima (``moe_gemm``'s amax, row_amax), 0 neither; direct: on a
    direct plan (``align.direct_rows``: the tiles' experts are the int64 expert ids); act: the
    activation's kernel mode, with gpt-oss's constants for mode 3; bias: expert biases; n: the
    GEMM's N, which decides fp8_block's scalar weight scale (128 stands for any multiple of it);
    quant_a: the down GEMM of a direct plan reads h in bf16 and quantizes it as it loads it
    (``moe_gemm``'s quantize_a); prefetch_bytes: the bytes of each weight row a program asks L2
    for before its wait on the kernel ahead (``moe_gemm``'s prefetch_w)."""
    bm, bn, bk, warps, stages = tile
    sig = {name: f"*{elt}" if name in ("a_ptr", "a_half_ptr", "w_ptr") else "*fp32" for name in POINTERS}
    sig["out_ptr"] = "*fp8e4nv" if quant_out else "*bf16"
    sig["sorted_rows_ptr"] = sig["tile_expert_ptr"] = sig["start_ptr"] = sig["count_ptr"] = "*i32"
    if direct:  # a direct plan hands the int64 expert ids as both (sorted_rows unread)
        sig["tile_expert_ptr"] = sig["sorted_rows_ptr"] = "*i64"
    if quant in (1, 2, 3):
        sig["a_ptr"] = sig["a_half_ptr"] = sig["w_ptr"] = "*fp8e4nv"
    if quant_a:
        sig["a_ptr"] = sig["a_half_ptr"] = "*bf16"
    sig.update({name: "i32" for name in INTS})
    # As at run time: unit strides are specialised to the constant 1, and pointers and the sizes
    # and strides that are multiples of 16 carry that divisibility (vectorised, aligned loads).
    unit = {"stride_ak": 1, "stride_wk": 1, "stride_on": 1, "stride_ask": 1}
    aligned = [*POINTERS, "N", "K", "N_w", "up_offset", "stride_am", "stride_we", "stride_wn", "stride_om"]
    consts = {**unit, "QUANT": quant, "FUSE_ACT": fused, "ACT": act, "ACT_P0": 1.702 if act == 3 else 0.0,
              "ACT_P1": 7.0 if act == 3 else 0.0, "BIAS": bias,
              "QUANT_OUT": quant_out, "QUANT_A": quant_a, "H_TY": tl.bfloat16,
              "GATHER_A": fused, "SCATTER_OUT": not fused,
              "TRACK_AMAX": track_amax, "EVEN_K": True, "TMA_A": False, "TMA_W": False, "FP8_EXACT": False,
              "FP8_ACC": FP8_ACC_MODES[fp8_acc],
              # as moe_gemm sets it
              "WS_SCALAR": one_w_scale_per_tile(quant, bn, n, fused), "HALF_TILES": half_tiles,
              "A_VALUES": False, "W_VALUES": False, "PDL": pdl, "DIRECT": direct, "PREFETCH_BYTES": prefetch_bytes,
              "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SUB_K": k_sub_step(quant, bk), "GROUP_M": 1}
    sig.update({name: "constexpr" for name in consts})
    names = list(moe_gemm_kernel.arg_names)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = ASTSource(fn=moe_gemm_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=SM90, options={"num_warps": warps, "num_stages": stages})


def cuobjdump(kernel, flag: str) -> str:
    """``cuobjdump <flag>`` of a compiled kernel's cubin (``--dump-sass``, ``--dump-resource-usage``)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(BIN / "cuobjdump"), flag, str(cubin)], capture_output=True, text=True).stdout


def compile_one(quant: int, elt: str, fused: bool, tile: tuple, fp8_acc: str, **options) -> dict:
    kernel = compile_gemm(quant, elt, fused, tile, fp8_acc, **options)
    usage = cuobjdump(kernel, "--dump-resource-usage")
    sass = cuobjdump(kernel, "--dump-sass")
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {"registers": int(regs.group(1)) if regs else -1, "stack_bytes": int(stack.group(1)) if stack else -1,
            "shared": kernel.metadata.shared, "HGMMA": sass.count("HGMMA"), "QGMMA": sass.count("QGMMA"),
            "HMMA": sass.count("HMMA"), "spill_loads": len(re.findall(r"\bLDL\b", sass)),
            "spill_stores": len(re.findall(r"\bSTL\b", sass))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name, quant, elt, fused, options in PROBLEMS:
        for tile in TILES:
            if options.get("quant_out") and tile[1] != 128:
                continue  # h is quantized in 128-column tiles only
            for fp8_acc in (("split", "promote", "imprecise") if quant == 1 else ("split",)):
                try:
                    r = compile_one(quant, elt, fused, tile, fp8_acc, **options)
                except Exception as exc:  # a tile the compiler refuses is a finding too
                    r = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
                rows.append({"gemm": name, "tile": "x".join(map(str, tile[:3])), "warps": tile[3], "stages": tile[4],
                             "fp8_acc": fp8_acc, **r})
                print(f"{name:20s} {rows[-1]['tile']:12s} w{tile[3]} s{tile[4]} {fp8_acc:9s} "
                      + (r.get("error") or f"regs {r['registers']:3d} stack {r['stack_bytes']:5d} smem {r['shared']:6d} "
                                           f"HGMMA {r['HGMMA']:3d} QGMMA {r['QGMMA']:3d} HMMA {r['HMMA']:3d} "
                                           f"LDL {r['spill_loads']:4d} STL {r['spill_stores']:4d}"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

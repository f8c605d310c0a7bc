"""Where each kernel launched under programmatic dependent launch waits, read from its machine code.

``moeshard.kernels.pdl``'s contract: a kernel launched with PDL may start before the kernel ahead of
it finishes, so each of its programs must wait (``griddepcontrol.wait``, SASS ``ACQBULK``) before
its first global memory access and before any exit, and signal the next kernel
(``griddepcontrol.launch_dependents``, SASS ``PREEXIT``) only after that wait. This compiles every
Triton kernel that the experts launch with PDL for Hopper (sm_90a, no GPU needed) with ``PDL=True``,
in the variants listed below, and checks that order in its SASS. A kernel that misses its wait
reads what the kernel ahead has not written yet: on the GPU the results differ from run to run.

    python scripts/pdl_order.py            # the table; exit status 1 if any kernel breaks the order
    python scripts/pdl_order.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import triton
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_resources import compile_down, compile_gate_up  # noqa: E402
from kernel_resources import SM90, compile_gemm, cuobjdump  # noqa: E402

from moeshard.kernels import align, quant  # noqa: E402

# Global memory instructions (loads, stores, atomics, reductions, TMA and bulk copies); shared
# memory (LDS / STS) and constant loads (LDC) are not the kernel ahead's.
GLOBAL_MEMORY = re.compile(r"^(LDG|STG|ATOMG|ATOM|RED|REDG|LD|ST|LDGSTS|UTMALDG|UTMASTG|UTMAPF|UBLKCP|UBLKRED|UBLKPF)\b")


def instructions(sass: str) -> list[str]:
    """The mnemonics of a cubin's SASS in program order (predicates dropped)."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            out.append(m.group(1))
    return out


def order(sass: str, early_loads: int = 0) -> dict:
    """Positions of the first wait, global memory access, exit and signal, and whether they
    keep the contract: a wait, before any global access and any exit, and any signal after it.

    early_loads: how many global loads (``LDG``) a kernel may issue before its wait, and then
    also L2 prefetches (``UBLKPF``, which change no value): the down GEMM's weight prefetch
    (``moe_gemm``'s prefetch_w) reads its tile's expert from a plan written before the kernel
    ahead started. Any other access before the wait, or one load more, still breaks the order."""
    ops = [op.split(".")[0] for op in instructions(sass)]

    def first(pred) -> int | None:
        return next((i for i, op in enumerate(ops) if pred(op)), None)

    wait = first(lambda op: op == "ACQBULK")
    allowed = {"UBLKPF"} if early_loads else set()
    loads_before = [i for i, op in enumerate(ops[:wait]) if op == "LDG"] if wait is not None else []
    skip = set(loads_before[:early_loads])
    memory = next((i for i, op in enumerate(ops) if GLOBAL_MEMORY.match(op) and op not in allowed and i not in skip),
                  None)
    exit_ = first(lambda op: op == "EXIT")
    signal = first(lambda op: op == "PREEXIT")
    ok = (wait is not None and (memory is None or wait < memory) and (exit_ is None or wait < exit_)
          and (signal is None or wait < signal))
    return {"wait": wait, "first_global_memory": memory, "first_exit": exit_, "signal": signal, "ok": ok}


def _compile(fn, sig: dict, consts: dict, warps: int = 4):
    sig = {**sig, **{name: "constexpr" for name in consts}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=SM90, options={"num_warps": warps})


def _quantize_h(mode: int, row_max: int, direct: bool = False):
    sig = {"h_ptr": "*bf16", "q_ptr": "*u8" if mode == 4 else "*fp8e4nv", "s_ptr": "*fp8e4nv" if mode == 4 else "*fp32",
           "g_ptr": "*fp32", "amax_ptr": "*fp32", "part_ptr": "*fp32", "tile_expert_ptr": "*i64" if direct else "*i32",
           "start_ptr": "*i32", "count_ptr": "*i32", "K": "i32",
           "span": "i32", "num_spans": "i32", "stride_hm": "i32", "stride_qm": "i32", "stride_sm": "i32"}
    consts = {"MODE": mode, "ROWS": quant.ROWS, "BLOCK_M": 16, "CHUNK": quant.CHUNK, "ROW_MAX": row_max,
              "PART_BLOCK": quant.PART_BLOCK, "AMAX_FLOOR": 1e-12, "FP8_MAX": 448.0, "PDL": True, "DIRECT": direct}
    return _compile(quant._quantize_h_kernel, sig, consts)


def _row_max(direct: bool = False):
    sig = {"h_ptr": "*bf16", "part_ptr": "*fp32", "tile_expert_ptr": "*i64" if direct else "*i32", "start_ptr": "*i32",
           "count_ptr": "*i32", "K": "i32", "span": "i32", "num_spans": "i32", "stride_hm": "i32"}
    return _compile(quant._row_max_kernel, sig, {"ROWS": quant.ROWS, "BLOCK_M": 16, "CHUNK": quant.CHUNK, "PDL": True,
                                                 "DIRECT": direct})


def _small_plan():
    sig = {"ids_ptr": "*i64", "M": "i32", "E": "i32", "num_tiles": "i32", "count_ptr": "*i32", "start_ptr": "*i32",
           "sorted_rows_ptr": "*i32", "tile_expert_ptr": "*i32", "amax_ptr": "*fp32", "row_amax_ptr": "*fp32"}
    consts = {"BLOCK_M": 16, "NUM_BINS": 256, "ROWS": 64, "TILES": 64, "ZERO_AMAX": True, "ZERO_ROWS": True,
              "PDL": True}
    return _compile(align._small_plan_kernel, sig, consts)


def _histogram():
    sig = {"ids_ptr": "*i64", "M": "i32", "E": "i32", "per_program": "i32", "partial_ptr": "*i32"}
    return _compile(align._histogram_kernel, sig, {"NUM_BINS": 256, "CHUNK": align.HIST_CHUNK, "PDL": True})


def _plan():
    sig = {"partial_ptr": "*i32", "num_parts": "i32", "E": "i32", "count_ptr": "*i32", "start_ptr": "*i32",
           "base_ptr": "*i32", "amax_ptr": "*fp32"}
    consts = {"BLOCK_M": 128, "NUM_BINS": 256, "PART_BLOCK": 32, "ZERO_AMAX": True, "PDL": True}
    return _compile(align._plan_kernel, sig, consts)


def _scatter():
    sig = {"ids_ptr": "*i64", "M": "i32", "E": "i32", "per_program": "i32", "num_tiles": "i32",
           "start_ptr": "*i32", "count_ptr": "*i32", "base_ptr": "*i32", "sorted_rows_ptr": "*i32",
           "tile_expert_ptr": "*i32", "row_amax_ptr": "*fp32", "fill_span": "i32", "zero_span": "i32"}
    consts = {"NUM_BINS": 256, "RANK": align.RANK_BLOCK, "CHUNK": align.HIST_CHUNK, "BLOCK_M": 128, "TILE_BLOCK": 128,
              "FILL_BLOCK": align.TILE_FILL_BLOCK, "ZERO_ROWS": True, "PDL": True}
    return _compile(align._scatter_kernel, sig, consts)


# (name, the kernel function's name in its module, builder). Every kernel the experts launch with
# PDL appears at least once (tests/test_pdl_order.py counts them against the sources).
# EARLY_LOADS: the kernels that may load before their wait, and how many loads (``order``).
KERNELS = (
    ("tile plan, one program", "_small_plan_kernel", _small_plan),
    ("tile plan: histogram", "_histogram_kernel", _histogram),
    ("tile plan: counts", "_plan_kernel", _plan),
    ("tile plan: scatter", "_scatter_kernel", _scatter),
    ("gate_up bf16, decode tile", "moe_gemm_kernel", lambda: compile_gemm(0, "bf16", True, (16, 64, 128, 4, 4), "split",
                                                                         pdl=True)),
    ("down fp8_tensor, decode tile", "moe_gemm_kernel", lambda: compile_gemm(1, "fp8e4nv", False, (16, 32, 128, 4, 6),
                                                                            "split", pdl=True)),
    ("gate_up fp8_tensor, prefill tile, half tiles", "moe_gemm_kernel",
     lambda: compile_gemm(1, "fp8e4nv", True, (128, 128, 128, 8, 4), "imprecise", half_tiles=True, pdl=True)),
    ("down fp8_block, mid tile", "moe_gemm_kernel", lambda: compile_gemm(3, "fp8e4nv", False, (64, 128, 128, 4, 3),
                                                                        "split", pdl=True)),
    ("gate_up fp8_token, decode tile, row maxima", "moe_gemm_kernel",
     lambda: compile_gemm(2, "fp8e4nv", True, (16, 64, 128, 4, 4), "split", pdl=True, track_amax=2)),
    ("gate_up fp8_tensor, decode tile, direct plan", "moe_gemm_kernel",
     lambda: compile_gemm(1, "fp8e4nv", True, (16, 64, 128, 4, 4), "split", pdl=True, track_amax=1, direct=True)),
    ("down fp8_tensor, one token, h quantized, weights prefetched", "moe_gemm_kernel",
     lambda: compile_gemm(1, "fp8e4nv", False, (16, 64, 256, 4, 3), "split", pdl=True, direct=True, quant_a=True,
                          prefetch_bytes=1024)),
    ("gate_up GEMV fp8_tensor, one token", "_gate_up_gemv_kernel", lambda: compile_gate_up(1, 16, 512, 4)),
    ("gate_up GEMV fp8_block, one token", "_gate_up_gemv_kernel", lambda: compile_gate_up(3, 16, 512, 4)),
    ("down GEMV fp8_token, one token", "_down_gemv_kernel", lambda: compile_down(2, 16, 512, 4)),
    ("down GEMV fp8_block, one token", "_down_gemv_kernel", lambda: compile_down(3, 16, 512, 4)),
    ("quantize_h fp8_tensor", "_quantize_h_kernel", lambda: _quantize_h(1, 0)),
    ("quantize_h fp8_tensor, direct plan", "_quantize_h_kernel", lambda: _quantize_h(1, 0, direct=True)),
    ("quantize_h fp8_token, whole rows", "_quantize_h_kernel", lambda: _quantize_h(2, 0)),
    ("quantize_h fp8_token, partial maxima", "_quantize_h_kernel", lambda: _quantize_h(2, 1)),
    ("quantize_h fp8_token, the gate_up GEMM's row maxima", "_quantize_h_kernel", lambda: _quantize_h(2, 2)),
    ("quantize_h fp8_block", "_quantize_h_kernel", lambda: _quantize_h(3, 0)),
    ("quantize_h nvfp4", "_quantize_h_kernel", lambda: _quantize_h(4, 0)),
    ("row max (fp8_token)", "_row_max_kernel", _row_max),
    ("row max (fp8_token), direct plan", "_row_max_kernel", lambda: _row_max(direct=True)),
)

EARLY_LOADS = {"down fp8_tensor, one token, h quantized, weights prefetched": 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name, fn_name, build in KERNELS:
        r = {"kernel": name, "function": fn_name,
             **order(cuobjdump(build(), "--dump-sass"), EARLY_LOADS.get(name, 0))}
        rows.append(r)
        print(f"{name:45s} wait {r['wait']!s:>5} first global memory {r['first_global_memory']!s:>5} "
              f"exit {r['first_exit']!s:>5} signal {r['signal']!s:>5} {'ok' if r['ok'] else 'BROKEN'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "kernels": rows}, indent=1) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

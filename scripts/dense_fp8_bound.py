"""How fast the experts' fp8 FLOPs could run as dense GEMMs, against the 1.2x fused-MoE target (one H200).

For each model and prefill token count, the two expert GEMMs of all M = T * top_k routed rows
run as single dense row-wise-scaled fp8 GEMMs (``torch._scaled_mm``: cuBLAS / CUTLASS, e4m3
operands, fp32 scales per row and per column, bf16 out): gate_up [M, H] x [H, 2I] and down
[M, I] x [I, H]. That is the same FLOP count as the routed experts with no grouping, no padding
to tiles, no gather or scatter, no activation and no quantization of h, so no grouped kernel
of the same arithmetic is expected below it. Beside it: the fused-MoE figure
(``FUSED_MOE_MS``, fp8_tensor) and that figure / 1.2, the prefill target's time. Also a square
8192^3 fp8 GEMM, the dense fp8 rate of the run. Each GEMM is captured in a CUDA graph and timed
with an L2 flush before every repetition (median of ``--reps``).

    PYTHONPATH=src python3 scripts/dense_fp8_bound.py --json results/h200/dense_fp8_bound.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moeshard.bench.targets import FUSED_MOE_MS
from moeshard.bench.timing import L2Flush, graphed, time_cuda
from moeshard.presets import get_preset

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
TOKENS = (4096, 16384)


def dense_ms(m: int, n: int, k: int, flush: L2Flush, reps: int, device: torch.device) -> float:
    """Median ms of one row-wise-scaled fp8 GEMM [m, k] x [k, n] -> bf16 [m, n]."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=gen, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=gen, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS takes it
    sa = torch.rand(m, 1, generator=gen, device=device) + 0.5
    sb = torch.rand(1, n, generator=gen, device=device) + 0.5
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)

    def fn() -> None:
        torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, out=out)

    g = graphed(fn)
    try:
        return time_cuda(g, warmup=2, reps=reps, flush=flush).median_ms
    finally:
        g.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    flush = L2Flush(device)
    n = 8192
    square = dense_ms(n, n, n, flush, args.reps, device)
    out = {"square_8192": {"ms": square, "tflops": 2 * n**3 / (square * 1e-3) / 1e12}, "cases": []}
    print(f"dense fp8 8192^3: {square:.3f} ms, {out['square_8192']['tflops']:.0f} TFLOP/s", file=sys.stderr)
    for name in MODELS:
        cfg = get_preset(name).config("full", torch.bfloat16)
        H, I = cfg.hidden_size, cfg.intermediate_size
        for tokens in TOKENS:
            m = tokens * cfg.top_k
            gate_up = dense_ms(m, 2 * I, H, flush, args.reps, device)
            down = dense_ms(m, H, I, flush, args.reps, device)
            fused = FUSED_MOE_MS[(name, tokens, "fp8_tensor")]
            flops = 6 * m * H * I
            rec = {"model": name, "tokens": tokens, "rows": m, "dense_gate_up_ms": gate_up, "dense_down_ms": down,
                   "dense_sum_ms": gate_up + down, "dense_tflops": flops / ((gate_up + down) * 1e-3) / 1e12,
                   "fused_moe_ms": fused, "target_ms": fused / 1.2}
            out["cases"].append(rec)
            print(f"{name} T={tokens}: dense gate_up {gate_up:.3f} + down {down:.3f} = {gate_up + down:.3f} ms "
                  f"({rec['dense_tflops']:.0f} TFLOP/s); fused-MoE {fused} ms, 1.2x target {fused / 1.2:.3f} ms",
                  file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

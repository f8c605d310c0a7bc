"""How fast torch's CUTLASS grouped fp8 GEMM runs the experts, against the Triton kernels (one H200).

For each model, token count and per-row fp8 scheme (fp8_tensor, fp8_token): the experts through
``TritonExperts`` and through a pipeline built on ``torch._scaled_grouped_mm`` (rowwise scales:
fp8_token's row and channel scales as they are, fp8_tensor's scales broadcast to rows and
channels, which is the same arithmetic), stage by stage:

    sort + gather of the quantized rows -> gate_up GEMM -> activation and quantization of h
        -> down GEMM -> unsort

each captured in a CUDA graph with an L2 flush before every repetition, with the vLLM fused-MoE
figure of the same shape (``FUSED_MOE_MS``) beside it. Both outputs are compared with the fp32
product of the dequantized operands (``GroupedExperts``), as max |diff| / max |ref|, so a fast
wrong path cannot win. Last, whether ``torch.nn.functional.scaled_grouped_mm`` takes 1 x 128 /
128 x 128 block scales (fp8_block) on this GPU, and ``_scaled_grouped_mm``'s alignment rules.

    PYTHONPATH=src python3 scripts/scaled_mm_study.py --json results/h200/scaled_mm_study.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# The study scripts share their timing and comparison helpers (scripts/ is on sys.path when run).
from fp8_study import _ms, _rel

from moeshard.bench.targets import FUSED_MOE_MS
from moeshard.bench.timing import L2Flush
from moeshard.bench.workload import experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.experts.base import activate
from moeshard.experts.grouped import GroupedExperts, expert_amax, group_sizes
from moeshard.kernels.experts import TritonExperts
from moeshard.quant import quantize_activations

CASES = (("mixtral-8x7b", (1, 16, 128, 4096, 16384)), ("qwen3-30b-a3b", (16, 128, 4096, 16384)),
         ("deepseek-v3", (16, 128, 4096, 16384)))
SCHEMES = ("fp8_tensor", "fp8_token")
REFERENCE_MAX_ROWS = 40_000  # the fp32 reference dequantizes every weight; skip it above this


def _row_scales(q, rows: int) -> torch.Tensor:
    """fp32 [rows]: each row's dequantization scale (fp8_token's own, fp8_tensor's broadcast)."""
    s = q.row_scale if q.row_scale is not None else q.tensor_scale
    return s.reshape(-1).expand(rows).contiguous() if s.numel() == 1 else s.reshape(-1).contiguous()


def _channel_scales(w) -> torch.Tensor:
    """fp32 [E, N]: each output channel's dequantization scale."""
    e, n, _ = w.shape
    return w.scale.reshape(e, -1).expand(e, n).contiguous()


class ScaledGroupedExperts:
    """The experts' pipeline on ``torch._scaled_grouped_mm`` (per-row fp8 schemes), in stages."""

    def __init__(self, inp, experts, activation: str, dtype: torch.dtype) -> None:
        self.inp, self.w, self.activation, self.dtype = inp, experts, activation, dtype
        self.scheme = experts.scheme
        self.E = experts.num_experts
        self.b_gate_up = experts.gate_up.data.transpose(-2, -1)
        self.b_down = experts.down.data.transpose(-2, -1)
        self.s_gate_up = _channel_scales(experts.gate_up)
        self.s_down = _channel_scales(experts.down)

    def sort(self):
        ids = self.inp.expert_ids
        order = torch.argsort(ids, stable=True)
        offsets = torch.cumsum(group_sizes(ids, self.E), 0).to(torch.int32)
        x = self.inp.x.index_rows(order // self.inp.repeat)
        return order, ids[order], offsets, x

    def gate_up(self, x, offsets):
        return torch._scaled_grouped_mm(x.data, self.b_gate_up, _row_scales(x, x.data.shape[0]), self.s_gate_up,
                                        offs=offsets, out_dtype=self.dtype)

    def act_quant(self, g, sorted_ids):
        h = activate(g, self.activation, self.dtype)
        amax = expert_amax(h, sorted_ids, self.E) if self.scheme == "fp8_tensor" else None
        return quantize_activations(h, self.scheme, amax=amax)

    def down(self, hq, offsets):
        return torch._scaled_grouped_mm(hq.data, self.b_down, _row_scales(hq, hq.data.shape[0]), self.s_down,
                                        offs=offsets, out_dtype=self.dtype)

    def __call__(self) -> torch.Tensor:
        order, sorted_ids, offsets, x = self.sort()
        y_sorted = self.down(self.act_quant(self.gate_up(x, offsets), sorted_ids), offsets)
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        return y


def study(name: str, tokens: int, scheme: str, model, flush, out: list, log) -> None:
    cfg = model.cfg
    experts = experts_for(model, scheme)
    inp, _ = routed_input(model, hidden_states(model, tokens, tokens), QuantConfig(scheme))
    reps = 10 if tokens >= 1024 else 40
    triton_kernel = TritonExperts(cfg.activation, cfg.dtype)
    sg = ScaledGroupedExperts(inp, experts, cfg.activation, cfg.dtype)
    rec: dict = {"model": name, "tokens": tokens, "scheme": scheme, "rows": inp.num_rows,
                 "fused_moe_ms": FUSED_MOE_MS.get((name, tokens, scheme))}
    rec["triton_ms"] = _ms(lambda: triton_kernel(inp, experts), flush, reps)
    try:
        order, sorted_ids, offsets, x = sg.sort()
        g = sg.gate_up(x, offsets)
        hq = sg.act_quant(g, sorted_ids)
        sg.down(hq, offsets)
    except Exception as exc:  # noqa: BLE001 - recorded: the shape or layout it refuses
        rec["scaled_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        log(f"{name} T={tokens} {scheme}: _scaled_grouped_mm refused: {rec['scaled_error']}")
        out.append(rec)
        return
    rec["scaled_ms"] = _ms(sg, flush, reps)
    rec["stages_ms"] = {"sort": _ms(sg.sort, flush, reps), "gate_up": _ms(lambda: sg.gate_up(x, offsets), flush, reps),
                        "act_quant": _ms(lambda: sg.act_quant(g, sorted_ids), flush, reps),
                        "down": _ms(lambda: sg.down(hq, offsets), flush, reps)}
    y_triton, y_scaled = triton_kernel(inp, experts), sg()
    rec["scaled_vs_triton"] = _rel(y_scaled, y_triton)
    if inp.num_rows <= REFERENCE_MAX_ROWS:
        y_ref = GroupedExperts(cfg.activation, torch.float32)(inp, experts)
        rec["triton_vs_ref"], rec["scaled_vs_ref"] = _rel(y_triton, y_ref), _rel(y_scaled, y_ref)
        del y_ref
    log(f"{name} T={tokens} {scheme}: vLLM {rec['fused_moe_ms']} triton {rec['triton_ms']} scaled {rec['scaled_ms']} "
        f"stages {rec['stages_ms']} rel(scaled, triton) {rec['scaled_vs_triton']:.3g} "
        f"rel to ref: triton {rec.get('triton_vs_ref')} scaled {rec.get('scaled_vs_ref')}")
    out.append(rec)


def probes(log) -> dict:
    """What the grouped fp8 GEMMs of this torch accept: block scales, offsets off 16, K and N."""
    dev = torch.device("cuda", 0)
    res: dict = {"torch": torch.__version__}
    E, N, K, M = 4, 256, 512, 96
    a = torch.randn(M, K, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(E, N, K, device=dev).to(torch.float8_e4m3fn).transpose(-2, -1)
    for label, offs in (("offsets_mult16", [16, 48, 64, 96]), ("offsets_odd", [5, 33, 34, 96]),
                        ("offsets_empty_groups", [0, 0, 50, 96])):
        try:
            torch._scaled_grouped_mm(a, b, torch.ones(M, device=dev), torch.ones(E, N, device=dev),
                                     offs=torch.tensor(offs, dtype=torch.int32, device=dev), out_dtype=torch.bfloat16)
            torch.cuda.synchronize()
            res[label] = "ok"
        except Exception as exc:  # noqa: BLE001
            res[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    fn = getattr(torch.nn.functional, "scaled_grouped_mm", None)
    if fn is None:
        res["blockwise"] = "torch.nn.functional.scaled_grouped_mm does not exist"
    else:
        try:
            from torch.nn.functional import ScalingType, SwizzleType
            sa = torch.ones(M, K // 128, device=dev)
            sb = torch.ones(E, N // 128, K // 128, device=dev)
            fn(a, b, sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
               swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE,
               offs=torch.tensor([16, 48, 64, 96], dtype=torch.int32, device=dev), output_dtype=torch.bfloat16)
            torch.cuda.synchronize()
            res["blockwise"] = "ok"
        except Exception as exc:  # noqa: BLE001
            res["blockwise"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    log(f"probes: {res}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default=None)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    flush = L2Flush(device)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result: dict = {"probes": probes(log), "cases": []}
    for name, token_counts in CASES:
        if args.models and name not in args.models.split(","):
            continue
        model = make_model(name, device)
        for tokens in token_counts:
            for scheme in SCHEMES:
                study(name, tokens, scheme, model, flush, result["cases"], log)
                if args.json:
                    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

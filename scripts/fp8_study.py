"""Where the fp8 expert kernels' time goes, and which variants move it (one H200).

For each model, token count and scheme: every stage of ``TritonExperts`` timed alone (tile plan,
gate_up GEMM, quantization of h, down GEMM) next to the whole call, each captured in a CUDA
graph with an L2 flush before every repetition, with the weight bytes each GEMM reads. Then
variants of the two GEMMs (tile shapes, warps, stages, and for the per-tensor / per-row schemes
how the fp8 tensor cores accumulate: ``split``, ``promote``, ``imprecise``), each checked
against the default variant's output (max relative difference) so that a fast wrong variant
cannot win. Last, ``quantize_h`` alone for every quantized scheme (fp8_token and nvfp4 too), at
every column span from 128 columns to whole rows (one program per row block), the one
``column_span`` picks marked, each result checked equal bit for bit to the whole-row one.

    PYTHONPATH=src python3 scripts/fp8_study.py --json results/h200/fp8_study.json

Stages run as ``moe_gemm`` runs them, without expert biases; ``--models`` takes any preset (at
``--tokens``, 4096 if not given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

from moeshard.bench.timing import L2Flush, graph_median_ms
from moeshard.bench.workload import bytes_per_expert, experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels.align import align_rows, split_tiles
from moeshard.kernels.configs import GemmConfig as C
from moeshard.kernels.configs import multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.quant import CHUNK, ROWS, column_span, quantize_h, quantized_positions
from moeshard.quant import get_scheme

CASES = (("mixtral-8x7b", (1, 16, 128, 4096, 16384)), ("deepseek-v3", (1, 16, 128, 4096, 16384)),
         ("qwen3-30b-a3b", (1, 4096, 16384)))
SCHEMES = ("none", "fp8_tensor", "fp8_token", "fp8_block")
DECODE = [C(16, 32, 128, 1, 4, 6), C(16, 64, 128, 1, 4, 4), C(64, 64, 128, 1, 4, 4), C(16, 64, 128, 1, 8, 4),
          C(16, 32, 256, 1, 4, 4), C(64, 128, 128, 1, 4, 3), C(64, 128, 128, 1, 4, 4), C(64, 128, 128, 1, 8, 4),
          C(32, 128, 128, 1, 4, 4),
          # one token: 16-row tiles, narrower or shallower (two programs per SM where shared memory allows)
          C(16, 128, 128, 1, 4, 2), C(16, 128, 128, 1, 4, 3), C(16, 64, 128, 1, 4, 3), C(16, 64, 128, 1, 4, 6),
          C(16, 32, 128, 1, 4, 3), C(16, 32, 128, 1, 4, 8), C(16, 16, 128, 1, 4, 6)]
PREFILL = [C(128, 64, 128, 8, 8, 4, tma=True), C(64, 128, 128, 8, 4, 3), C(64, 128, 128, 8, 8, 3, tma=True),
           C(128, 128, 64, 8, 8, 4, tma=True), C(128, 128, 64, 8, 8, 3, tma=True), C(128, 128, 128, 8, 8, 3, tma=True),
           C(128, 128, 64, 4, 8, 4, tma=True), C(128, 128, 128, 8, 8, 2, tma=True), C(128, 128, 128, 8, 8, 4, tma=True),
           C(128, 128, 128, 4, 8, 3, tma=True), C(128, 128, 128, 16, 8, 3, tma=True)]
# Down alone at prefill, on gate_up's tile plan (split into shorter tiles where block_m is
# smaller, as TritonExperts runs it); fp8_acc is the scheme's prefill mode (imprecise for the
# per-tensor / per-row schemes, per-block scaling for fp8_block). None spill on sm_90a
# (scripts/kernel_resources.py).
DOWN_PREFILL = [C(128, 128, 128, 8, 8, 3, tma=True), C(128, 256, 128, 8, 8, 3, tma=True),
                C(128, 256, 64, 8, 8, 4, tma=True), C(64, 128, 128, 8, 4, 3), C(64, 128, 128, 8, 4, 4),
                C(64, 128, 128, 8, 8, 3), C(64, 256, 128, 8, 8, 3), C(64, 256, 128, 8, 4, 3),
                C(64, 128, 128, 8, 4, 4, tma=True), C(64, 256, 128, 8, 8, 3, tma=True)]
# gate_up alone at prefill (its own tile plan where block_m differs), at the scheme's prefill fp8_acc.
GATE_UP_PREFILL = [C(128, 128, 64, 8, 8, 4, tma=True), C(128, 128, 128, 8, 8, 3, tma=True),
                   C(128, 128, 128, 8, 8, 4, tma=True), C(128, 128, 128, 4, 8, 3, tma=True),
                   C(128, 128, 128, 16, 8, 3, tma=True), C(64, 128, 128, 8, 4, 4), C(64, 128, 128, 8, 4, 4, tma=True),
                   C(64, 128, 128, 8, 8, 3, tma=True)]
# Variants are swept where the gaps to the fused-MoE kernel users run are largest; every case gets the stage attribution.
SWEEP = {("mixtral-8x7b", 1), ("mixtral-8x7b", 16), ("mixtral-8x7b", 128), ("deepseek-v3", 1), ("deepseek-v3", 128),
         ("qwen3-30b-a3b", 1), ("mixtral-8x7b", 4096), ("deepseek-v3", 4096), ("qwen3-30b-a3b", 4096)}
ACCS = ("split", "promote", "imprecise")
QUANT_H_SCHEMES = ("fp8_tensor", "fp8_token", "fp8_block", "nvfp4")


def _ms(fn, flush, reps: int) -> float | str:
    try:
        return graph_median_ms(fn, reps=reps, flush=flush)
    except Exception as exc:  # a variant that does not compile or launch is a finding, not the end
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def study(name: str, tokens: int, scheme: str, model, flush, out: list, log, sweep_variants: bool = True,
          down_sweep: bool = False) -> None:
    device = model.gate_up.device
    cfg = model.cfg
    spec = get_scheme(scheme)
    experts = experts_for(model, scheme)
    x = hidden_states(model, tokens, tokens)
    inp, _ = routed_input(model, x, QuantConfig(scheme))
    M, E, H, I = inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    reps = 10 if tokens >= 1024 else 40
    sel = select_config(M, E, H, I, scheme, multiprocessors(device.index))
    amax = torch.empty(E, dtype=torch.float32, device=device) if spec.per_tensor_activation else None
    plan = align_rows(inp.expert_ids, E, sel.block_m, amax=amax)
    h = torch.empty(plan.padded_rows, I, dtype=cfg.dtype, device=device)
    moe_gemm(inp.x, experts.gate_up, plan, h, sel.gate_up, activation=cfg.activation, gather=True, amax=amax,
             a_row_div=inp.repeat)
    hq = quantize_h(h, scheme, plan, amax) if spec.quantized else h
    y = torch.empty(M, H, dtype=cfg.dtype, device=device)
    down_plan = split_tiles(plan, sel.down.block_m)  # as TritonExperts runs down (shorter tiles, same plan)
    moe_gemm(hq, experts.down, down_plan, y, sel.down, activation=None, gather=False)
    active = int((torch.bincount(inp.expert_ids, minlength=E) > 0).sum())
    w_bytes = bytes_per_expert(experts) * active
    kernel = TritonExperts(cfg.activation, cfg.dtype)
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M, "active": active, "weight_bytes": w_bytes,
           "config": {"gate_up": sel.gate_up.as_dict(), "down": sel.down.as_dict()},
           "experts_ms": _ms(lambda: kernel(inp, experts), flush, reps),
           "align_ms": _ms(lambda: align_rows(inp.expert_ids, E, sel.block_m, amax=amax), flush, reps),
           "gate_up_ms": _ms(lambda: moe_gemm(inp.x, experts.gate_up, plan, h, sel.gate_up, activation=cfg.activation,
                                              gather=True, amax=amax, a_row_div=inp.repeat), flush, reps),
           "quant_h_ms": _ms(lambda: quantize_h(h, scheme, plan, amax), flush, reps) if spec.quantized else 0.0,
           "down_ms": _ms(lambda: moe_gemm(hq, experts.down, down_plan, y, sel.down, activation=None, gather=False),
                          flush, reps),
           "variants": []}
    log(f"{name} T={tokens} {scheme}: experts {rec['experts_ms']} align {rec['align_ms']} gate_up {rec['gate_up_ms']} "
        f"quant_h {rec['quant_h_ms']} down {rec['down_ms']} (GB {w_bytes / 1e9:.2f})")
    y_ref = y.clone()
    if down_sweep and tokens > 128 and spec.quantized:
        acc = "split" if spec.kernel_mode not in (1, 2) else "imprecise"
        rec["gate_up_variants"] = []
        for c in GATE_UP_PREFILL:
            plan_g = plan if c.block_m == sel.block_m else align_rows(inp.expert_ids, E, c.block_m, amax=amax)
            hv = torch.empty(plan_g.padded_rows, I, dtype=cfg.dtype, device=device)
            ms_g = _ms(lambda plan_g=plan_g, hv=hv, c=c: moe_gemm(
                inp.x, experts.gate_up, plan_g, hv, c, activation=cfg.activation, gather=True, amax=amax,
                a_row_div=inp.repeat, fp8_acc=acc), flush, reps)
            rec["gate_up_variants"].append({"config": c.as_dict(), "fp8_acc": acc, "gate_up_ms": ms_g})
            log(f"   gate_up {c.block_m}x{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages} "
                f"tma={c.tma} {acc}: {ms_g}")
        rec["down_variants"] = []
        for c in DOWN_PREFILL:
            if sel.block_m % c.block_m or (c.block_n > 128 and spec.kernel_mode not in (1, 2, 3)):
                continue
            yv = torch.empty(M, H, dtype=cfg.dtype, device=device)
            plan_d = split_tiles(plan, c.block_m)
            ms_d = _ms(lambda plan_d=plan_d, yv=yv, c=c: moe_gemm(hq, experts.down, plan_d, yv, c, activation=None,
                                                                   gather=False, fp8_acc=acc), flush, reps)
            rel_y = _rel(yv, y_ref) if not isinstance(ms_d, str) else None
            rec["down_variants"].append({"config": c.as_dict(), "fp8_acc": acc, "down_ms": ms_d, "y_rel_diff": rel_y})
            log(f"   down {c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} tma={c.tma} {acc}: "
                f"{ms_d} rel {rel_y}")
    accs = (ACCS if tokens > 128 else ("split", "imprecise")) if spec.kernel_mode in (1, 2) else ("split",)
    sweep = sweep_variants and (name, tokens) in SWEEP and spec.quantized
    for c in (DECODE if tokens <= 128 else PREFILL) if sweep else ():
        if tokens < 16 and c.block_m != sel.block_m:  # a few rows: taller tiles only compute padding
            continue
        if c.block_m != sel.block_m:  # the plan (and h's padding) belongs to one BLOCK_M
            plan_c = align_rows(inp.expert_ids, E, c.block_m, amax=amax)
        else:
            plan_c = plan
        for acc in accs:
            hv = torch.empty(plan_c.padded_rows, I, dtype=cfg.dtype, device=device)
            yv = torch.empty(M, H, dtype=cfg.dtype, device=device)
            # _ms calls (captures) each closure before the loop moves on; the defaults bind this pass's values.
            ms_g = _ms(lambda plan_c=plan_c, hv=hv, c=c, acc=acc: moe_gemm(
                inp.x, experts.gate_up, plan_c, hv, c, activation=cfg.activation, gather=True, amax=amax,
                a_row_div=inp.repeat, fp8_acc=acc), flush, reps)
            hqv = quantize_h(hv, scheme, plan_c, amax) if spec.quantized else hv
            ms_d = _ms(lambda hqv=hqv, plan_c=plan_c, yv=yv, c=c, acc=acc: moe_gemm(
                hqv, experts.down, plan_c, yv, c, activation=None, gather=False, fp8_acc=acc), flush, reps)
            rel_y = _rel(yv, y_ref) if not isinstance(ms_d, str) else None
            v = {"config": c.as_dict(), "fp8_acc": acc, "gate_up_ms": ms_g, "down_ms": ms_d, "y_rel_diff": rel_y}
            rec["variants"].append(v)
            log(f"   {c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} tma={c.tma} {acc:9s}: "
                f"gate_up {ms_g} down {ms_d} rel {rel_y}")
    out.append(rec)


def _bits(q, live: torch.Tensor) -> list[torch.Tensor]:
    """The quantization's tensors at the rows ``live`` marks (``quantized_positions``: the rest is
    left unwritten), fp8 as bytes."""
    return [(t.view(torch.uint8) if t.element_size() == 1 else t)[live]
            for t in (q.data, q.row_scale, q.tensor_scale) if t is not None]


def quant_h_stage(name: str, tokens: int, model, flush, out: list, log) -> None:
    """quantize_h alone on h [P, I] of this case's tile plan (random bf16 values; the cost does
    not depend on them), every quantized scheme, at ``column_span``'s split and at every other
    power-of-two span from 128 columns to whole rows (one program per row block), each result
    checked bit-equal to the whole-row one."""
    device = model.gate_up.device
    cfg = model.cfg
    E, I = cfg.num_experts, cfg.intermediate_size
    inp, _ = routed_input(model, hidden_states(model, tokens, tokens), QuantConfig())
    M = inp.num_rows
    reps = 10 if tokens >= 1024 else 40
    whole = CHUNK * triton.next_power_of_2(triton.cdiv(I, CHUNK))
    spans = [CHUNK << i for i in range((whole // CHUNK).bit_length())]
    for scheme in QUANT_H_SCHEMES:
        sel = select_config(M, E, cfg.hidden_size, I, scheme, multiprocessors(device.index))
        plan = align_rows(inp.expert_ids, E, sel.block_m)
        h = torch.randn(plan.padded_rows, I, device=device).to(cfg.dtype)
        amax = torch.full((E,), float(h.abs().amax()), device=device) if get_scheme(scheme).per_tensor_activation \
            else None
        live = quantized_positions(plan)
        want = _bits(quantize_h(h, scheme, plan, amax, span=whole), live)
        chosen = column_span(plan.padded_rows, I)
        rec = {"model": name, "tokens": tokens, "scheme": scheme, "stage": "quantize_h", "rows": M,
               "padded_rows": plan.padded_rows, "span": chosen, "spans": {}}
        for span in spans:
            got = _bits(quantize_h(h, scheme, plan, amax, span=span), live)
            # _ms captures the closure before the loop moves on; the defaults bind this pass's values.
            ms = _ms(lambda h=h, scheme=scheme, plan=plan, amax=amax, span=span: quantize_h(
                h, scheme, plan, amax, span=span), flush, reps)
            rec["spans"][span] = {"programs": plan.padded_rows // ROWS * triton.cdiv(I, span), "ms": ms,
                                  "bit_equal": all(torch.equal(a, b) for a, b in zip(got, want, strict=True))}
        rec["quant_h_ms"] = rec["spans"][chosen]["ms"]
        log(f"{name} T={tokens} {scheme} quantize_h: P {plan.padded_rows}, chosen span {chosen}; "
            + ", ".join(f"{k}: {v['ms']} ms ({v['programs']} programs{'' if v['bit_equal'] else ', NOT BIT-EQUAL'})"
                        for k, v in rec["spans"].items()))
        out.append(rec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default=None)
    ap.add_argument("--tokens", default=None, help="comma list: only these token counts")
    ap.add_argument("--schemes", default=None, help="comma list: only these schemes")
    ap.add_argument("--no-sweep", action="store_true", help="stage times only: no tile variants, no quantize_h spans")
    ap.add_argument("--down-sweep", action="store_true",
                    help="at prefill, time gate_up alone at every GATE_UP_PREFILL tile and down alone at every "
                         "DOWN_PREFILL tile on gate_up's plan")
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    flush = L2Flush(device)
    out: list = []

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    cases = list(CASES)
    if args.models:  # any other preset too, at the token counts --tokens names
        wanted = args.models.split(",")
        cases = [c for c in cases if c[0] in wanted]
        cases += [(m, tuple(int(t) for t in (args.tokens or "4096").split(","))) for m in wanted
                  if m not in dict(CASES)]
    for name, token_counts in cases:
        model = make_model(name, device)
        if args.tokens:
            token_counts = tuple(t for t in token_counts if str(t) in args.tokens.split(","))
        for tokens in token_counts:
            for scheme in SCHEMES:
                if args.schemes and scheme not in args.schemes.split(","):
                    continue
                study(name, tokens, scheme, model, flush, out, log, sweep_variants=not args.no_sweep,
                      down_sweep=args.down_sweep)
                if args.json:
                    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        for tokens in () if args.no_sweep else token_counts:
            quant_h_stage(name, tokens, model, flush, out, log)
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

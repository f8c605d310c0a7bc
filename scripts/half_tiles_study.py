"""Half tiles against whole tiles at prefill: what an expert's padding costs the grouped GEMMs.

With 128-row tiles each expert's last tile holds count % 128 rows; the rest is padding that the
tensor cores compute anyway. ``GemmConfig.half_tiles`` lets a tile whose rows fit in its first
half compute a 64-row tile instead. For each model, token count and scheme this times, on the
bench's workload (``moeshard.bench.workload``, CUDA graphs, an L2 flush before every
repetition), the gate_up GEMM alone, the down GEMM alone and the whole ``TritonExperts`` call
with the tiles ``select_config`` picks, once with half tiles and once without (everything else
equal), in alternating rounds so that drift between them is not read as a difference. It checks
that both give the same bits (h at every padded position, and y), and counts the positions each
computes against the routed rows. ``--layer`` also times the whole ``MoELayer`` (one GPU, local
backend, as ``moeshard bench`` builds it) with either experts' tiles, and with half tiles but
without its shared experts (the layer's stage that the routed experts' time leaves out).

    PYTHONPATH=src python3 scripts/half_tiles_study.py --json results/h200/half_tiles_study.json
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import routed_case, run_on_gpu, study_parser
from moeshard.bench.timing import alternating_medians
from moeshard.config import QuantConfig
from moeshard.kernels.align import align_rows, split_tiles
from moeshard.kernels.configs import ExpertsConfig, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.quant import quantize_h
from moeshard.layer import MoELayer

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (4096, 16384)
SCHEMES = ("none", "fp8_tensor", "fp8_block")


def computed_rows(counts: torch.Tensor, block_m: int, half: bool) -> int:
    """Positions the tensor cores compute for experts of ``counts`` rows in ``block_m``-row tiles."""
    full, rest = counts // block_m, counts % block_m
    last = torch.where(rest == 0, 0, torch.where((rest <= block_m // 2) & half, block_m // 2, block_m))
    return int((full * block_m + last).sum())


def layer_calls(model, scheme: str, experts, x: torch.Tensor, variants: dict) -> dict:
    """Callables of the whole layer: one per experts' config (``TritonExperts`` with it as the
    layer's kernel) and, with the half tiles, one without the shared experts."""
    layer = MoELayer(model.cfg, QuantConfig(scheme), weights=model.shell, local_experts=experts,
                     device=model.gate_up.device)
    kernels = {key: TritonExperts(model.cfg.activation, model.cfg.dtype, ec) for key, ec in variants.items()}
    shared = layer.shared_experts

    def run(key: str, with_shared: bool = True):
        def call():
            layer.kernel = kernels[key]
            layer.shared_experts = shared if with_shared else None
            return layer(x)
        return call

    calls = {f"layer_{key}_ms": run(key) for key in variants}
    if shared is not None:
        calls["layer_half_no_shared_ms"] = run("half", with_shared=False)
    return calls


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    case = routed_case(model, tokens, scheme)
    cfg, device, spec, experts, x, inp = case.cfg, case.device, case.spec, case.experts, case.x, case.inp
    M, E, H, I = case.M, case.E, case.H, case.I
    sel = select_config(M, E, H, I, scheme, multiprocessors(device.index))
    variants = {}
    for half in (False, True):
        variants["half" if half else "whole"] = ExpertsConfig(
            dataclasses.replace(sel.gate_up, half_tiles=half and sel.gate_up.block_m >= 128),
            dataclasses.replace(sel.down, half_tiles=half and sel.down.block_m >= 128))
    counts = torch.bincount(inp.expert_ids, minlength=E).cpu()
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M,
           "config": {"gate_up": sel.gate_up.as_dict(), "down": sel.down.as_dict()},
           "gate_up_computed_per_row": {k: computed_rows(counts, sel.gate_up.block_m, v.gate_up.half_tiles) / M
                                        for k, v in variants.items()},
           "down_computed_per_row": {k: computed_rows(counts, sel.down.block_m, v.down.half_tiles) / M
                                     for k, v in variants.items()}}
    calls, outs = {}, {}
    # One plan for both variants: rows land in an expert's positions in the order of the plan's
    # atomics, so two plans could hold the same h at different positions.
    plan = align_rows(inp.expert_ids, E, sel.block_m)
    for key, ec in variants.items():
        amax = torch.zeros(E, dtype=torch.float32, device=device) if spec.per_tensor_activation else None
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=cfg.dtype, device=device)
        moe_gemm(inp.x, experts.gate_up, plan, h, ec.gate_up, activation=cfg.activation, gather=True, amax=amax,
                 a_row_div=inp.repeat)
        hq = quantize_h(h, scheme, plan, amax) if spec.quantized else h
        y = torch.empty(M, H, dtype=cfg.dtype, device=device)
        down_plan = split_tiles(plan, ec.down.block_m)
        moe_gemm(hq, experts.down, down_plan, y, ec.down, activation=None, gather=False)
        outs[key] = (h.clone(), y.clone())
        kernel = TritonExperts(cfg.activation, cfg.dtype, ec)
        calls[key] = {
            "gate_up_ms": lambda ec=ec, h=h, amax=amax: moe_gemm(
                inp.x, experts.gate_up, plan, h, ec.gate_up, activation=cfg.activation, gather=True, amax=amax,
                a_row_div=inp.repeat),
            "down_ms": lambda ec=ec, hq=hq, down_plan=down_plan, y=y: moe_gemm(
                hq, experts.down, down_plan, y, ec.down, activation=None, gather=False),
            "experts_ms": lambda kernel=kernel: kernel(inp, experts)}
    (h0, y0), (h1, y1) = outs["whole"], outs["half"]
    rec["same_h"] = bool(torch.equal(h0.isnan(), h1.isnan()) and torch.equal(h0.nan_to_num(), h1.nan_to_num()))
    rec["same_y"] = bool(torch.equal(y0, y1))
    whole_layer = layer_calls(model, scheme, experts, x, variants) if args.layer else {}
    # Each round times every stage of every variant, then the layers; keys "variant/stage".
    flat = {f"{key}/{stage}": fn for key in variants for stage, fn in calls[key].items()}
    times, medians = alternating_medians({**flat, **{f"layer/{k}": fn for k, fn in whole_layer.items()}},
                                         rounds=args.rounds, reps=args.reps, flush=flush)
    for out, source in (("rounds", times), ("median_ms", medians)):
        rec[out] = {key: {stage: source[f"{key}/{stage}"] for stage in calls[key]} for key in variants}
        rec[f"layer_{out}"] = {k: source[f"layer/{k}"] for k in whole_layer}
    return rec


def summary(rec: dict) -> str:
    """One case's line: rows computed per routed row, each GEMM's and the experts' median ms whole
    -> half, whether h and y are the same bits, and the layer's times with --layer."""
    m = rec["median_ms"]
    return (f"{rec['model']:14s} T={rec['tokens']:<6d} {rec['scheme']:10s} computed/row gate_up "
            f"{rec['gate_up_computed_per_row']['whole']:.3f} -> {rec['gate_up_computed_per_row']['half']:.3f}"
            f" | gate_up {m['whole']['gate_up_ms']:.3f} -> {m['half']['gate_up_ms']:.3f}"
            f" down {m['whole']['down_ms']:.3f} -> {m['half']['down_ms']:.3f}"
            f" experts {m['whole']['experts_ms']:.3f} -> {m['half']['experts_ms']:.3f} ms"
            f" | same h {rec['same_h']} y {rec['same_y']}"
            + "".join(f" | {k} {v:.3f}" for k, v in rec["layer_median_ms"].items()))


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10)
    ap.add_argument("--layer", action="store_true", help="also time the whole layer (see the module doc)")
    run_on_gpu(ap.parse_args(), "scripts/half_tiles_study.py", study, summary)


if __name__ == "__main__":
    main()

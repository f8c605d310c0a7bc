"""Persistent grouped GEMMs at prefill: one program per multiprocessor walking the tiles, with
and without Triton's flattened tile and K loops, against one program per tile.

The prefill tiles fill a multiprocessor's shared memory, so one program runs per SM and nothing
overlaps a tile's epilogue and the next tile's first loads. ``GemmConfig.persistent`` launches
one program per SM that walks the tiles in use: "loop" computes them one after another,
"flatten" lets Triton fuse the tile and K loops into one software pipeline (the next tile's
loads in flight during this tile's epilogue). A persistent program computes whole tiles only, so
the variants are, for each GEMM: the tiles ``select_config`` picks ("selected", with half tiles
where it takes them), the same without half tiles ("whole"), and "loop" and "flatten" on the
whole tiles. For each model, token count and scheme this times, on the bench's workload
(``moeshard.bench.workload``, CUDA graphs, an L2 flush before every repetition), the gate_up
GEMM alone, the down GEMM alone and the whole ``TritonExperts`` call of every variant, in
alternating rounds, and checks that every variant gives the selected tiles' bits (h at every
used position, the amax, and y).

    PYTHONPATH=src python3 scripts/persistent_study.py --json results/h200/persistent_study.json
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import run_on_gpu, study_parser
from moeshard.bench.timing import alternating_medians
from moeshard.bench.workload import experts_for, hidden_states, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels.align import align_rows, split_tiles
from moeshard.kernels.configs import ExpertsConfig, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.quant import quantize_h
from moeshard.quant import get_scheme

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (4096, 16384)
SCHEMES = ("none", "fp8_tensor", "fp8_block")
VARIANTS = ("selected", "whole", "loop", "flatten")


def variants_of(sel: ExpertsConfig) -> dict[str, ExpertsConfig]:
    """The selected tiles, and the same tiles whole, in a loop and flattened (both GEMMs). A
    persistent 4-warp tile runs two programs per SM, as two such tiles fit one SM's registers
    and shared memory (``scripts/kernel_resources.py``), an 8-warp tile one."""
    def whole(persistent: str) -> ExpertsConfig:
        def gemm(c):
            return dataclasses.replace(c, half_tiles=False, persistent=persistent,
                                       programs_per_sm=2 if c.num_warps == 4 else 1)
        return dataclasses.replace(sel, gate_up=gemm(sel.gate_up), down=gemm(sel.down))
    return {"selected": sel, "whole": whole("off"), "loop": whole("loop"), "flatten": whole("flatten")}


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    cfg = model.cfg
    device = model.gate_up.device
    spec = get_scheme(scheme)
    experts = experts_for(model, scheme)
    x = hidden_states(model, tokens, tokens)
    inp, _ = routed_input(model, x, QuantConfig(scheme))
    M, E, H, I = inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    sel = select_config(M, E, H, I, scheme, multiprocessors(device.index))
    variants = variants_of(sel)
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M,
           "config": {key: {"gate_up": ec.gate_up.as_dict(), "down": ec.down.as_dict()} for key, ec in variants.items()}}
    # One plan for every variant: rows land in an expert's positions in the order of the plan's
    # atomics, so two plans could hold the same h at different positions.
    plan = align_rows(inp.expert_ids, E, sel.block_m)
    used = int(plan.start[-1]) + -(-int(plan.count[-1]) // sel.block_m) * sel.block_m
    calls, outs = {}, {}
    for key, ec in variants.items():
        amax = torch.zeros(E, dtype=torch.float32, device=device) if spec.per_tensor_activation else None
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=cfg.dtype, device=device)
        moe_gemm(inp.x, experts.gate_up, plan, h, ec.gate_up, activation=cfg.activation, gather=True, amax=amax,
                 a_row_div=inp.repeat)
        hq = quantize_h(h, scheme, plan, amax) if spec.quantized else h
        y = torch.full((M, H), float("nan"), dtype=cfg.dtype, device=device)
        down_plan = split_tiles(plan, ec.down.block_m)
        moe_gemm(hq, experts.down, down_plan, y, ec.down, activation=None, gather=False)
        outs[key] = (h[:used].clone(), None if amax is None else amax.clone(), y.clone())
        kernel = TritonExperts(cfg.activation, cfg.dtype, ec)
        calls[key] = {
            "gate_up_ms": lambda ec=ec, h=h, amax=amax: moe_gemm(
                inp.x, experts.gate_up, plan, h, ec.gate_up, activation=cfg.activation, gather=True, amax=amax,
                a_row_div=inp.repeat),
            "down_ms": lambda ec=ec, hq=hq, down_plan=down_plan, y=y: moe_gemm(
                hq, experts.down, down_plan, y, ec.down, activation=None, gather=False),
            "experts_ms": lambda kernel=kernel: kernel(inp, experts)}
    h0, a0, y0 = outs["selected"]
    rec["same_bits"] = {}
    for key, (h1, a1, y1) in outs.items():
        same_h = torch.equal(h0.isnan(), h1.isnan()) and torch.equal(h0.nan_to_num(), h1.nan_to_num())
        rec["same_bits"][key] = bool(same_h and (a0 is None or torch.equal(a0, a1)) and torch.equal(y0, y1)
                                     and not y1.isnan().any())
    flat = {f"{key}/{stage}": fn for key in variants for stage, fn in calls[key].items()}
    times, medians = alternating_medians(flat, rounds=args.rounds, reps=args.reps, flush=flush)
    for out, source in (("rounds", times), ("median_ms", medians)):
        rec[out] = {key: {stage: source[f"{key}/{stage}"] for stage in calls[key]} for key in variants}
    return rec


def summary(rec: dict) -> str:
    """One case's line: each variant's gate_up / down / experts median ms, and whether its bits
    are the selected tiles'."""
    m = rec["median_ms"]
    parts = [f"{key} {m[key]['gate_up_ms']:.3f}/{m[key]['down_ms']:.3f}/{m[key]['experts_ms']:.3f}"
             + ("" if rec["same_bits"][key] else " DIFFERENT BITS") for key in VARIANTS]
    return f"{rec['model']:14s} T={rec['tokens']:<6d} {rec['scheme']:10s} gate_up/down/experts ms: " + " | ".join(parts)


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10)
    run_on_gpu(ap.parse_args(), "scripts/persistent_study.py", study, summary)


if __name__ == "__main__":
    main()

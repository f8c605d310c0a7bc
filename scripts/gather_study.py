"""What gathering A's rows costs the prefill gate_up GEMM, against A laid out at padded positions.

The gate_up GEMM reads each tile's A rows through the tile plan (routed row m is token
m // repeat), with pointer loads: Hopper's TMA cannot gather rows. Were the activations laid out
at the plan's padded positions first, each tile's A would be one contiguous block, which TMA
loads. For each model, token count and scheme this times, on the bench's workload
(``moeshard.bench.workload``, CUDA graphs, an L2 flush before every repetition), gate_up alone
with the tiles ``select_config`` picks:

* ``gather``: as ``TritonExperts`` runs it (the tile config's own TMA setting for the weights);
* ``gather_tma_w``: the same with the weights through TMA;
* ``rows_ptr`` / ``rows_tma``: A already at padded positions, loaded with pointers / through TMA
  (weights likewise);
* ``layout``: the pass that lays A out (``kernels.layout.lay_out_rows``: the quantized rows
  and their row scales), the price of the contiguous variants;
* ``experts_gather`` / ``experts_laid_out``: the whole ``TritonExperts`` call with the selected
  tiles, A gathered or laid out first (``ExpertsConfig.lay_out_a``).

Alternating rounds keep drift from reading as a difference. Every variant's h must equal the
gathered one at the routed rows, bit for bit, and both experts' calls must give the same y.

    PYTHONPATH=src python3 scripts/gather_study.py --json results/h200/gather_study.json
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import case_line, routed_case, run_on_gpu, study_parser, time_variants
from moeshard.kernels.align import RowAlignment, align_rows
from moeshard.kernels.configs import multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.layout import lay_out_rows

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (4096, 16384)
SCHEMES = ("fp8_tensor", "fp8_block", "none")


def routed_positions(plan: RowAlignment) -> torch.Tensor:
    """[P] bool: whether each padded position holds a routed row."""
    pos = torch.arange(plan.padded_rows, device=plan.sorted_rows.device)
    expert = plan.tile_expert.long()[pos // plan.block_m]
    e = expert.clamp(min=0)
    return (expert >= 0) & (pos - plan.start.long()[e] < plan.count.long()[e])


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    case = routed_case(model, tokens, scheme)
    cfg, device, spec, experts, inp = case.cfg, case.device, case.spec, case.experts, case.inp
    M, E, H, I = case.M, case.E, case.H, case.I
    sel = select_config(M, E, H, I, scheme, multiprocessors(device.index))
    plan = align_rows(inp.expert_ids, E, sel.block_m)
    valid = routed_positions(plan)
    a_rows = lay_out_rows(inp.x, plan, inp.repeat)
    g = sel.gate_up
    variants = {"gather": (inp.x, True, g), "gather_tma_w": (inp.x, True, dataclasses.replace(g, tma=True)),
                "rows_ptr": (a_rows, False, dataclasses.replace(g, tma=False)),
                "rows_tma": (a_rows, False, dataclasses.replace(g, tma=True))}
    calls, hs = {}, {}
    for key, (a, gather, gc) in variants.items():
        amax = torch.zeros(E, dtype=torch.float32, device=device) if spec.per_tensor_activation else None
        h = torch.zeros(plan.padded_rows, I, dtype=cfg.dtype, device=device)
        div = inp.repeat if gather else 1

        def call(a=a, gather=gather, gc=gc, h=h, amax=amax, div=div):
            return moe_gemm(a, experts.gate_up, plan, h, gc, activation=cfg.activation, gather=gather, amax=amax,
                            a_row_div=div)
        call()
        hs[key] = h[valid].clone()
        calls[key] = call
    calls["layout"] = lambda: lay_out_rows(inp.x, plan, inp.repeat)
    ys = {}
    for lay_out in (False, True):
        # A laid-out input reads tiles of the sorted plan, never the direct one.
        laid = dataclasses.replace(sel, lay_out_a=lay_out, direct=sel.direct and not lay_out,
                                   quantize_in_down=sel.quantize_in_down and not lay_out,
                                   gemv=None if lay_out else sel.gemv)
        kernel = TritonExperts(cfg.activation, cfg.dtype, laid)
        key = "experts_laid_out" if lay_out else "experts_gather"
        calls[key] = lambda kernel=kernel: kernel(inp, experts)
        ys[key] = calls[key]().clone()
    same = {k: bool(torch.equal(v, hs["gather"])) for k, v in hs.items() if k != "gather"}
    same["y"] = bool(torch.equal(ys["experts_gather"], ys["experts_laid_out"]))
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M, "padded_rows": plan.padded_rows,
           "config": g.as_dict(), "selected_lay_out_a": sel.lay_out_a, "same": same}
    return time_variants(rec, calls, flush, args)


def summary(rec: dict) -> str:
    """One case's line: each variant's median ms, and which outputs differ if any do."""
    return (case_line(rec)
            + ("" if all(rec["same"].values()) else f" | DIFFERENT {rec['same']}"))


def main() -> None:
    run_on_gpu(study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10).parse_args(), "scripts/gather_study.py",
               study, summary)


if __name__ == "__main__":
    main()

"""The Gluon persistent down GEMM against the Triton grouped GEMM at prefill, alone and in the experts.

``moeshard.kernels.persistent_down`` computes the per-tensor / per-row fp8 down GEMM as one
program per SM that walks the tiles in use and issues its own TMA loads STAGES - 1 steps ahead of
the MMAs across tile boundaries (``GemmConfig.engine == "gluon"``). For each model, token count
and scheme (fp8_tensor, fp8_token) this times, on the bench's workload
(``moeshard.bench.workload``, CUDA graphs, an L2 flush before every repetition, rounds
alternating): the down GEMM of the Triton kernel (the prefill tile ``select_config`` picks
without Gluon) and of the Gluon kernel at 3 and 4 stages, checking each against the Triton
kernel's y bit for bit; and the whole ``TritonExperts`` call with the config ``select_config``
picks on this GPU and with its down GEMM on the Triton kernel (``experts_triton``).

For fp8_block (``--schemes fp8_block``) the Gluon kernel is ``moeshard.kernels.persistent_block_down``
(warp-specialized, block scales) in 128 x 128 x 128 tiles at 4 and 6 stages, and the experts are
timed as selected and with that down GEMM (``experts_block_down_s4``, ``_s6``).

    PYTHONPATH=src python3 scripts/gluon_down_study.py --json results/h200/gluon_down_study.json
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import bits_line, experts_variants, routed_case, run_on_gpu, study_parser, time_variants
from moeshard.kernels.align import align_rows, split_tiles
from moeshard.kernels.configs import GemmConfig, multiprocessors, select_config
from moeshard.kernels.experts import gluon_supported
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.persistent_block_down import persistent_block_down
from moeshard.kernels.persistent_down import persistent_down
from moeshard.kernels.quant import quantize_h

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (4096, 16384)
SCHEMES = ("fp8_tensor", "fp8_token")
STAGES = (3, 4)
BLOCK_STAGES = (4, 6)


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    case = routed_case(model, tokens, scheme)
    cfg, device, spec, experts, inp = case.cfg, case.device, case.spec, case.experts, case.inp
    M, E, H, I = case.M, case.E, case.H, case.I
    sms = multiprocessors(device.index)
    triton_only = select_config(M, E, H, I, scheme, sms)
    chosen = select_config(M, E, H, I, scheme, sms, gluon=gluon_supported(device))
    plan = align_rows(inp.expert_ids, E, triton_only.block_m)
    amax = torch.zeros(E, dtype=torch.float32, device=device) if spec.per_tensor_activation else None
    h = torch.empty(plan.padded_rows, I, dtype=cfg.dtype, device=device)
    moe_gemm(inp.x, experts.gate_up, plan, h, triton_only.gate_up, activation=cfg.activation, gather=True,
             amax=amax, a_row_div=inp.repeat)
    hq = quantize_h(h, scheme, plan, amax)
    down_plan = split_tiles(plan, triton_only.down.block_m)
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M,
           "config": {"triton": dataclasses.asdict(triton_only), "chosen": dataclasses.asdict(chosen)}}
    y_ref = torch.full((M, H), float("nan"), dtype=cfg.dtype, device=device)
    moe_gemm(hq, experts.down, down_plan, y_ref, triton_only.down, activation=None, gather=False)
    calls = {"down_triton": lambda: moe_gemm(hq, experts.down, down_plan, y_ref, triton_only.down, activation=None,
                                             gather=False)}
    rec["same_bits"] = {}
    if scheme == "fp8_block":
        configs = {"experts_chosen": chosen}
        for stages in BLOCK_STAGES:
            gemm = GemmConfig(128, 128, 128, 8, 8, stages, tma=True, fp8_acc="imprecise", engine="gluon")
            y = torch.full((M, H), float("nan"), dtype=cfg.dtype, device=device)
            persistent_block_down(hq, experts.down, plan, y, gemm)
            rec["same_bits"][f"down_gluon_s{stages}"] = bool(torch.equal(y, y_ref))
            calls[f"down_gluon_s{stages}"] = lambda y=y, gemm=gemm: persistent_block_down(hq, experts.down, plan, y,
                                                                                          gemm)
            configs[f"experts_block_down_s{stages}"] = dataclasses.replace(chosen, down=gemm)
        experts_variants(case, configs, calls, rec)
        return time_variants(rec, calls, flush, args)
    if chosen.down.engine == "gluon":
        for stages in STAGES:
            gemm = dataclasses.replace(chosen.down, num_stages=stages)
            y = torch.full((M, H), float("nan"), dtype=cfg.dtype, device=device)
            persistent_down(hq, experts.down, plan, y, gemm)
            rec["same_bits"][f"down_gluon_s{stages}"] = bool(torch.equal(y, y_ref))
            calls[f"down_gluon_s{stages}"] = lambda y=y, gemm=gemm: persistent_down(hq, experts.down, plan, y, gemm)
    triton_down = dataclasses.replace(chosen, down=triton_only.down)
    experts_variants(case, {"experts_triton": triton_down, "experts_chosen": chosen}, calls, rec)
    return time_variants(rec, calls, flush, args)


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10)
    run_on_gpu(ap.parse_args(), "scripts/gluon_down_study.py", study, bits_line)


if __name__ == "__main__":
    main()

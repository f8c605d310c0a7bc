"""The Gluon persistent gate_up GEMM against the Triton grouped GEMM at prefill, alone and in the experts.

``moeshard.kernels.persistent_gate_up`` computes the per-tensor / per-row fp8 gate_up GEMM as one
program per SM that walks the tiles in use, its weight tiles through TMA and its gathered input
rows through cp.async, STAGES - 1 steps ahead of the MMAs across tile boundaries
(``GemmConfig.engine == "gluon"``). For each model, token count and scheme (fp8_tensor, fp8_token)
this times, on the bench's workload (``moeshard.bench.workload``, CUDA graphs, an L2 flush before
every repetition, rounds alternating): gate_up on the Triton kernel with the tile ``select_config``
picks (half tiles where it takes them) and with whole tiles, and on the Gluon kernel at 3 and 4
stages, checking h and the per-expert amax against the Triton kernel's bit for bit; and the whole
``TritonExperts`` call with the config ``select_config`` picks on this GPU, and with its gate_up
on the Gluon kernel.

    PYTHONPATH=src python3 scripts/gluon_gate_up_study.py --json results/h200/gluon_gate_up_study.json
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import routed_case, run_on_gpu, study_parser
from moeshard.bench.timing import alternating_medians
from moeshard.kernels.align import align_rows
from moeshard.kernels.configs import multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts, gluon_supported
from moeshard.kernels.grouped_gemm import moe_gemm

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (4096, 16384)
SCHEMES = ("fp8_tensor", "fp8_token")
STAGES = (3, 4)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality where positions no tile writes (padding tiles past the last expert's) hold
    NaN in both."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    case = routed_case(model, tokens, scheme)
    cfg, device, spec, experts, inp = case.cfg, case.device, case.spec, case.experts, case.inp
    M, E, H, I = case.M, case.E, case.H, case.I
    sms = multiprocessors(device.index)
    chosen = select_config(M, E, H, I, scheme, sms, gluon=gluon_supported(device))
    plan = align_rows(inp.expert_ids, E, chosen.block_m)
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M, "config": dataclasses.asdict(chosen)}

    def gate_up(gemm):
        amax = torch.zeros(E, dtype=torch.float32, device=device) if spec.per_tensor_activation else None
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=cfg.dtype, device=device)
        call = lambda: moe_gemm(inp.x, experts.gate_up, plan, h, gemm, activation=cfg.activation,  # noqa: E731
                                gather=True, amax=amax, a_row_div=inp.repeat)
        call()
        return h, amax, call

    h_ref, amax_ref, calls = None, None, {}
    variants = {"triton": chosen.gate_up, "triton_whole": dataclasses.replace(chosen.gate_up, half_tiles=False)}
    for stages in STAGES:
        variants[f"gluon_s{stages}"] = dataclasses.replace(chosen.gate_up, engine="gluon", half_tiles=False,
                                                           num_stages=stages)
    rec["same_bits"] = {}
    for key, gemm in variants.items():
        h, amax, call = gate_up(gemm)
        if h_ref is None:
            h_ref, amax_ref = h, amax
        else:
            rec["same_bits"][f"h_{key}"] = same(h, h_ref)
            if amax is not None:
                rec["same_bits"][f"amax_{key}"] = bool(torch.equal(amax, amax_ref))
        calls[f"gate_up_{key}_ms"] = call
    with_gluon = dataclasses.replace(chosen, gate_up=variants["gluon_s4"])
    configs = {"experts_chosen_ms": chosen, "experts_gluon_gate_up_ms": with_gluon}
    outs = []
    for key, ec in configs.items():
        kernel = TritonExperts(cfg.activation, cfg.dtype, ec)
        outs.append(kernel(inp, experts))
        calls[key] = lambda kernel=kernel: kernel(inp, experts)
    rec["same_bits"]["experts"] = bool(torch.equal(*outs))
    rec["rounds"], rec["median_ms"] = alternating_medians(calls, rounds=args.rounds, reps=args.reps, flush=flush)
    return rec


def summary(rec: dict) -> str:
    parts = " | ".join(f"{k[:-3]} {v:.3f}" for k, v in rec["median_ms"].items())
    bits = " ".join(f"{k}:{'same' if v else 'DIFFERENT'}" for k, v in rec["same_bits"].items())
    return f"{rec['model']:14s} T={rec['tokens']:<6d} {rec['scheme']:10s} ms: {parts} | bits {bits}"


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10)
    run_on_gpu(ap.parse_args(), "scripts/gluon_gate_up_study.py", study, summary)


if __name__ == "__main__":
    main()

"""Programmatic dependent launch for the experts' kernels: what it saves against the same tiles
launched one after another, and which kernels' overlap saves it.

At decode the experts are four short kernels in a row (tile plan, gate_up, quantize_h, down), and
each launch waits for the one before to finish. With PDL (``moeshard.kernels.pdl``) a kernel's
programs become resident while the kernel ahead finishes. For each model, token count and scheme
this times the whole ``TritonExperts`` call on the bench's workload (``moeshard.bench.workload``,
CUDA graphs, an L2 flush before every repetition) with the tiles ``select_config`` picks, launched
serially, with the plan and gate_up under PDL, and with all four under PDL (``ExpertsConfig.pdl``
"off", "gate_up", "all"), in alternating rounds so that drift is not read as a difference. With
``--stages`` (token counts up to 16) it also runs the same four stages with PDL on quantize_h
and down only, or on down alone. Every variant's output must equal
the serial one bit for bit.

    PYTHONPATH=src python3 scripts/pdl_study.py --json results/h200/pdl_study.json
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import study_parser, write_study
from moeshard.bench.timing import L2Flush, alternating_medians
from moeshard.bench.workload import experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels.align import align_rows, split_tiles
from moeshard.kernels.configs import ExpertsConfig, gpu_kind, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.quant import quantize_h
from moeshard.quant import get_scheme

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (1, 16, 128, 4096)
SCHEMES = ("none", "fp8_tensor", "fp8_token", "fp8_block")
# PDL on (plan, gate_up, quantize_h, down) for the --stages variants (the chains ExpertsConfig.pdl
# names, "gate_up" and "all", run through TritonExperts).
STAGES = {"pdl_quantize_h_down": (False, False, True, True), "pdl_down": (False, False, False, True)}


def staged(inp, experts, ec: ExpertsConfig, activation: str, dtype, scheme: str, flags: tuple[bool, ...]):
    """The experts' four stages as ``TritonExperts`` runs them, with PDL on the stages ``flags`` names."""
    spec = get_scheme(scheme)
    E, I, H = experts.num_experts, experts.intermediate_size, experts.hidden_size
    device = inp.expert_ids.device

    def call():
        amax = torch.empty(E, dtype=torch.float32, device=device) if spec.per_tensor_activation else None
        plan = align_rows(inp.expert_ids, E, ec.block_m, amax=amax, pdl_launch=flags[0])
        down_plan = split_tiles(plan, ec.down.block_m)
        h = torch.empty(plan.padded_rows, I, dtype=dtype, device=device)
        moe_gemm(inp.x, experts.gate_up, plan, h, ec.gate_up, activation=activation, gather=True, amax=amax,
                 a_row_div=inp.repeat, pdl_launch=flags[1])
        h_in = quantize_h(h, scheme, plan, amax, pdl_launch=flags[2]) if spec.quantized else h
        y = torch.empty(inp.num_rows, H, dtype=dtype, device=device)
        return moe_gemm(h_in, experts.down, down_plan, y, ec.down, activation=None, gather=False, pdl_launch=flags[3])
    return call


def study(name: str, tokens: int, scheme: str, model, experts, flush, rounds: int, reps: int, stages: bool) -> dict:
    cfg = model.cfg
    device = model.gate_up.device
    x = hidden_states(model, tokens, tokens)
    inp, _ = routed_input(model, x, QuantConfig(scheme))
    M, E, H, I = inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    sel = select_config(M, E, H, I, scheme, multiprocessors(device.index), pdl=True, gpu=gpu_kind(device.index))
    chains = {"serial": "off", "pdl_gate_up": "gate_up", "pdl": "all"}
    kernels = {k: TritonExperts(cfg.activation, cfg.dtype, dataclasses.replace(sel, pdl=c)) for k, c in chains.items()}
    calls = {k: (lambda kern=kern: kern(inp, experts)) for k, kern in kernels.items()}
    if stages and tokens <= 16:
        calls.update({k: staged(inp, experts, sel, cfg.activation, cfg.dtype, scheme, flags)
                      for k, flags in STAGES.items()})
    want = calls["serial"]()
    same = {k: bool(torch.equal(fn(), want)) for k, fn in calls.items()}
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M,
           "config": {"gate_up": sel.gate_up.as_dict(), "down": sel.down.as_dict(), "selected_pdl": sel.pdl},
           "same_bits": same}
    rec["rounds"], rec["median_ms"] = alternating_medians(calls, rounds=rounds, reps=reps, flush=flush)
    return rec


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=20)
    ap.add_argument("--stages", action="store_true", help="also PDL on some stages only (see the module doc)")
    args = ap.parse_args()
    device = torch.device("cuda")
    flush = L2Flush(device)
    records = []
    for name in args.models.split(","):
        model = make_model(name, device)
        for scheme in args.schemes.split(","):
            experts = experts_for(model, scheme)
            for tokens in map(int, args.tokens.split(",")):
                rec = study(name, tokens, scheme, model, experts, flush, args.rounds, args.reps, args.stages)
                records.append(rec)
                m = rec["median_ms"]
                base = m["serial"]
                print(f"{name:14s} T={tokens:<5d} {scheme:10s} serial {base * 1e3:8.1f} us | "
                      + " ".join(f"{k} {v * 1e3:.1f} ({v / base:.3f})" for k, v in m.items() if k != "serial")
                      + ("" if all(rec["same_bits"].values()) else f" | DIFFERENT BITS {rec['same_bits']}"),
                      flush=True)
            del experts
        del model
        torch.cuda.empty_cache()
    if args.json:
        write_study(args.json, "scripts/pdl_study.py", args, records)


if __name__ == "__main__":
    main()

"""The experts' GEMMs with Triton's warp-specialized K loop at prefill, against the tiles chosen now.

``GemmConfig.warp_specialize`` asks Triton to split the K loop into a producer warpgroup that
issues the TMA loads and consumer warpgroups that run the MMAs (``tl.range(warp_specialize=True)``;
on Hopper Triton 3.6 does it from 4 warps, running 12). Both operands must come through TMA, so
gate_up needs the input laid out at the plan's positions (``ExpertsConfig.lay_out_a``); down
reads h there anyway. For each model, token count and scheme this times, on the bench's workload
(``moeshard.bench.workload``, CUDA graphs, an L2 flush before every repetition), the whole
``TritonExperts`` call with the tiles ``select_config`` picks, with down warp-specialized, with
gate_up warp-specialized (input laid out), and with both, in alternating rounds. The warp-specialized
tiles are those the compiler fits without spilling on sm_90a (``scripts/kernel_resources.py``'s
compilation, 12 warps: 128 x 64 x 128 fp8, 128 x 128 x 64 bf16). Each variant's y is compared
with the selected tiles' (bit for bit, and the largest difference relative to the largest |y|).
A record is written after every case, so a run cut short keeps what it measured.

    PYTHONPATH=src python3 scripts/warp_spec_study.py --json results/h200/warp_spec_study.json
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.report import study_parser, write_study
from moeshard.bench.timing import L2Flush, alternating_medians
from moeshard.bench.workload import experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels.configs import FP8, ExpertsConfig, GemmConfig, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts
from moeshard.quant import get_scheme

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (4096, 16384)
SCHEMES = ("fp8_tensor", "fp8_block", "none")


def warp_specialized(scheme: str) -> GemmConfig:
    """The warp-specialized tile of a scheme's GEMMs (gate_up and down alike): 128-row tiles (two
    consumer warpgroups of 64 rows), no spills on sm_90a."""
    mode = get_scheme(scheme).kernel_mode
    if mode in FP8:
        return GemmConfig(128, 64, 128, 8, 4, 4, tma=True, fp8_acc="imprecise", warp_specialize=True)
    return GemmConfig(128, 128, 64, 8, 4, 4, tma=True, warp_specialize=True)


def study(name: str, tokens: int, scheme: str, model, flush, rounds: int, reps: int) -> dict:
    cfg = model.cfg
    device = model.gate_up.device
    experts = experts_for(model, scheme)
    x = hidden_states(model, tokens, tokens)
    inp, _ = routed_input(model, x, QuantConfig(scheme))
    M, E, H, I = inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    sel = select_config(M, E, H, I, scheme, multiprocessors(device.index))
    down = dataclasses.replace(sel, down=warp_specialized(scheme))
    gate_up = dataclasses.replace(sel, gate_up=warp_specialized(scheme), lay_out_a=True)
    variants: dict[str, ExpertsConfig] = {"selected": sel, "down_ws": down, "gate_up_ws": gate_up,
                                          "both_ws": dataclasses.replace(gate_up, down=down.down)}
    calls, ys = {}, {}
    for key, ec in variants.items():
        kernel = TritonExperts(cfg.activation, cfg.dtype, ec)
        calls[key] = lambda kernel=kernel: kernel(inp, experts)
        ys[key] = calls[key]().clone()
    top = ys["selected"].float().abs().max()
    rec = {"model": name, "tokens": tokens, "scheme": scheme, "rows": M,
           "configs": {k: {"gate_up": v.gate_up.as_dict(), "down": v.down.as_dict(), "lay_out_a": v.lay_out_a}
                       for k, v in variants.items()},
           "same_y": {k: bool(torch.equal(v, ys["selected"])) for k, v in ys.items() if k != "selected"},
           "max_rel_diff": {k: float((v.float() - ys["selected"].float()).abs().max() / top)
                            for k, v in ys.items() if k != "selected"}}
    rec["rounds"], rec["median_ms"] = alternating_medians({f"{k}_ms": fn for k, fn in calls.items()}, rounds=rounds,
                                                          reps=reps, flush=flush)
    return rec


def main() -> None:
    args = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10).parse_args()
    device = torch.device("cuda")
    flush = L2Flush(device)
    records = []
    for name in args.models.split(","):
        model = make_model(name, device)
        for tokens in map(int, args.tokens.split(",")):
            for scheme in args.schemes.split(","):
                rec = study(name, tokens, scheme, model, flush, args.rounds, args.reps)
                records.append(rec)
                m = rec["median_ms"]
                print(f"{name:14s} T={tokens:<6d} {scheme:10s} " + " ".join(f"{k[:-3]} {v:.3f}" for k, v in m.items())
                      + " | max rel diff " + " ".join(f"{k} {v:.1e}" for k, v in rec["max_rel_diff"].items()),
                      flush=True)
                if args.json:
                    write_study(args.json, "scripts/warp_spec_study.py", args, records)
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

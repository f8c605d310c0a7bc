"""The Gluon persistent gate_up GEMM against the Triton grouped GEMM at prefill, alone and in the experts.

``moeshard.kernels.persistent_gate_up`` computes the per-tensor / per-row fp8 gate_up GEMM as one
program per SM, warp-specialized: a loader warpgroup takes tiles from a counter and gathers their
input rows through cp.async (the weight tiles through TMA) for two MMA warpgroups
(``GemmConfig.engine == "gluon"``). For each model, token count and scheme (fp8_tensor, fp8_token)
this times, on the bench's workload (``moeshard.bench.workload``, CUDA graphs, an L2 flush before
every repetition, rounds alternating): gate_up on the Triton kernel with the tile ``select_config``
picks (half tiles where it takes them) and with whole tiles, and on the Gluon kernel at 3 and 4
stages, checking h and the per-expert amax against the Triton kernel's bit for bit; and the whole
``TritonExperts`` call with the config ``select_config`` picks on this GPU and with its gate_up on
the other kernel (the Gluon kernel at 4 stages where the Triton kernel is selected, the Triton
kernel's tile where the Gluon kernel is, with h quantized as ``select_config`` pairs with that
gate_up: ``experts_other_gate_up``), and, where fp8_token's row maxima come from the gate_up
epilogue, with quantize_h's row-max pass instead (``experts_chosen_h_pass``).

For fp8_block (``--schemes fp8_block``) the Gluon kernel runs with block scales in 64-column
tiles at 4 and 6 stages and 128-column tiles at 3 and 4 (``BLOCK_TILES``), and the experts are
timed as selected and with each of those gate_up tiles (input gathered, h quantized by
quantize_h's pass).

    PYTHONPATH=src python3 scripts/gluon_gate_up_study.py --json results/h200/gluon_gate_up_study.json
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import bits_line, experts_variants, routed_case, run_on_gpu, study_parser, time_variants
from moeshard.kernels.align import align_rows
from moeshard.kernels.configs import multiprocessors, select_config
from moeshard.kernels.experts import gluon_supported
from moeshard.kernels.grouped_gemm import moe_gemm

MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")
TOKENS = (4096, 16384)
SCHEMES = ("fp8_tensor", "fp8_token")
STAGES = (3, 4)
# fp8_block's Gluon tiles (block_n, stages): 64 columns with both step products in flight, 128
# with one at a time (``persistent_gate_up._block_scaled_k_loop``).
BLOCK_TILES = ((64, 4), (64, 6), (128, 3), (128, 4))


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
    # The Triton kernel's tile as select_config picks it without the Gluon kernels, and variants of it.
    triton_tile = select_config(M, E, H, I, scheme, sms, gluon=False).gate_up
    variants = {"triton": triton_tile, "triton_whole": dataclasses.replace(triton_tile, half_tiles=False)}
    if scheme == "fp8_block":
        for block_n, stages in BLOCK_TILES:
            variants[f"gluon_n{block_n}_s{stages}"] = dataclasses.replace(
                triton_tile, block_n=block_n, engine="gluon", half_tiles=False, num_stages=stages,
                fp8_acc="imprecise")
    else:
        for stages in STAGES:
            variants[f"gluon_s{stages}"] = dataclasses.replace(triton_tile, engine="gluon", half_tiles=False,
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
        calls[f"gate_up_{key}"] = call
    # The experts as selected, and with the Gluon gate_up (4 stages) or, where that is selected,
    # the Triton kernel's tile. fp8_block: with each Gluon tile, the input gathered (not laid out)
    # and h quantized by quantize_h's pass.
    if scheme == "fp8_block":
        configs = {"experts_chosen": chosen}
        for block_n, stages in BLOCK_TILES:
            configs[f"experts_gluon_n{block_n}_s{stages}"] = dataclasses.replace(
                chosen, gate_up=variants[f"gluon_n{block_n}_s{stages}"], lay_out_a=False, h_quant="pass")
        experts_variants(case, configs, calls, rec)
        return time_variants(rec, calls, flush, args)
    other = variants["gluon_s4"] if chosen.gate_up.engine == "triton" else triton_tile
    rec["other_gate_up"] = dataclasses.asdict(other)
    # h quantized as select_config pairs it with the other gate_up (fp8_token's row maxima come
    # from the Gluon gate_up's epilogue, not from the Triton prefill tile's).
    h_quant = select_config(M, E, H, I, scheme, sms, gluon=other.engine == "gluon").h_quant
    configs = {"experts_chosen": chosen, "experts_other_gate_up": dataclasses.replace(chosen, gate_up=other, h_quant=h_quant)}
    if chosen.h_quant == "row_max":
        # fp8_token's row maxima from the gate_up epilogue against quantize_h's row-max pass.
        configs["experts_chosen_h_pass"] = dataclasses.replace(chosen, h_quant="pass")
    experts_variants(case, configs, calls, rec)
    return time_variants(rec, calls, flush, args)


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10)
    run_on_gpu(ap.parse_args(), "scripts/gluon_gate_up_study.py", study, bits_line)


if __name__ == "__main__":
    main()

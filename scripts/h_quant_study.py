"""fp8_block experts with h quantized by the gate_up GEMM as it stores h, against quantize_h's own pass.

``ExpertsConfig.h_quant``: "pass" writes h in the model dtype and quantizes it in a separate
kernel (``kernels.quant.quantize_h``); "gate_up" quantizes each 128-column tile of h in the
gate_up GEMM's epilogue (``moe_gemm``'s out_scale), so h is written once, in fp8, and never read
back in the model dtype. For each model and token count this times the ``TritonExperts`` call
with the config ``select_config`` picks and with the other h_quant, on the bench's workload
(``moeshard.bench.workload``, CUDA graphs, an L2 flush before every repetition, rounds
alternating), and checks that all give the same bits. Where the gate_up tile is a 64-row decode
tile narrower than 128 columns, the other variants are that tile widened to 128 columns with 8
warps (3 and 4 stages), quantizing h; for other tiles narrower than 128 columns only the selected
config runs.

    PYTHONPATH=src python3 scripts/h_quant_study.py --json results/h200/h_quant_study.json
"""

from __future__ import annotations

import dataclasses

from moeshard.bench.study import bits_line, experts_variants, routed_case, run_on_gpu, study_parser, time_variants
from moeshard.kernels.configs import ExpertsConfig, multiprocessors, select_config
from moeshard.kernels.experts import gluon_supported
from moeshard.kernels.pdl import supported as pdl_supported

MODELS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
TOKENS = (1, 128, 4096, 16384)
SCHEMES = ("fp8_block",)


def variants(M: int, E: int, H: int, I: int, scheme: str, sms: int, pdl: bool,  # noqa: E741
             gluon: bool) -> dict[str, ExpertsConfig]:
    """The configs timed for M routed rows over E experts of hidden size H and intermediate size
    I: the one ``select_config`` picks, named by its h_quant, and the other h_quant where the
    gate_up tile is 128 columns wide; a 64-row decode tile narrower than h's scale groups is
    also tried widened to 128 columns with 8 warps (4 spill, scripts/kernel_resources.py) at 3
    and 4 stages, quantizing h."""
    chosen = select_config(M, E, H, I, scheme, sms, pdl=pdl, gluon=gluon)
    configs = {f"h_{chosen.h_quant}": chosen}
    if chosen.gate_up.block_n == 128 and chosen.gate_up.engine == "triton" and I % 128 == 0:
        other = "pass" if chosen.h_quant == "gate_up" else "gate_up"
        configs[f"h_{other}"] = dataclasses.replace(chosen, h_quant=other)
    elif chosen.gate_up.block_m == 64 and chosen.gate_up.block_n < 128 and I % 128 == 0:
        for stages in (3, 4):
            # 128-column K steps, as the chosen 64-row tiles take (a 256-column step at this
            # width would not fit shared memory at 3 stages).
            wide = dataclasses.replace(chosen.gate_up, block_n=128, block_k=128, num_warps=8, num_stages=stages)
            configs[f"h_gate_up_w8_s{stages}"] = dataclasses.replace(chosen, gate_up=wide, h_quant="gate_up")
    return configs


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    case = routed_case(model, tokens, scheme)
    device = case.device
    configs = variants(case.M, case.E, case.H, case.I, scheme, multiprocessors(device.index),
                       pdl_supported(device), gluon_supported(device))
    chosen = next(iter(configs.values()))
    rec: dict = {"model": name, "tokens": tokens, "scheme": scheme, "rows": case.M,
                 "config": dataclasses.asdict(chosen)}
    calls: dict = {}
    experts_variants(case, configs, calls, rec)
    return time_variants(rec, calls, flush, args)


def main() -> None:
    ap = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10)
    run_on_gpu(ap.parse_args(), "scripts/h_quant_study.py", study, bits_line)


if __name__ == "__main__":
    main()

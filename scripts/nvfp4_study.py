"""nvfp4 experts at prefill: decoding the operands once against decoding them in every GEMM program.

The grouped GEMM's nvfp4 mode unpacks e2m1 codes and scales in registers, in every program that
reads a tile, on the CUDA cores. ``ExpertsConfig.decode_nvfp4`` decodes the activations (x and
h: "activations"), or the activations and the weights ("all", a window of
``decode_experts`` experts at a time), to fp16 values once before the GEMMs
(``kernels.nvfp4_values``). For each model and token count this times, on the bench's workload
(``moeshard.bench.workload``, CUDA graphs, an L2 flush before every repetition), the whole
nvfp4 ``TritonExperts`` call under each choice: on nvfp4's own prefill tiles (codes, activations,
all), and with everything decoded on bf16's tiles (``fp16_tiles``: the tiles, TMA and input
layout ``select_config`` gives bf16), in the windows ``decode_window`` gives and, where that is
more than one, whole (``fp16_tiles_whole``); the bf16 experts beside them; and each decoding
pass alone. Alternating rounds keep drift from reading as a difference. Each variant's y is
compared with the codes' (bit for bit, and the largest difference relative to the largest
|y|), the peak memory each call allocates above its inputs is recorded, and so is which
variant ``select_config`` picks.

    PYTHONPATH=src python3 scripts/nvfp4_study.py --json results/h200/nvfp4_study.json
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import case_line, run_on_gpu, study_parser, time_variants
from moeshard.bench.workload import experts_for, hidden_states, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels.configs import NVFP4_DOWN, NVFP4_GATE_UP, ExpertsConfig, decode_window, multiprocessors, select_config
from moeshard.kernels.experts import TritonExperts
from moeshard.kernels.nvfp4_values import nvfp4_values

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
TOKENS = (4096, 16384)
SCHEMES = ("nvfp4",)


def peak_bytes(fn) -> int:
    """Bytes ``fn`` allocates at its peak above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    cfg = model.cfg
    device = model.gate_up.device
    experts = experts_for(model, "nvfp4")
    bf16 = experts_for(model, "none")
    x = hidden_states(model, tokens, tokens)
    inp, _ = routed_input(model, x, QuantConfig("nvfp4"))
    inp_bf16, _ = routed_input(model, x, QuantConfig("none"))
    M, E, H, I = inp.num_rows, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    sms = multiprocessors(device.index)
    sel = select_config(M, E, H, I, "nvfp4", sms)
    own = ExpertsConfig(NVFP4_GATE_UP, NVFP4_DOWN)
    window = decode_window(E, H, I)
    fp16 = dataclasses.replace(select_config(M, E, H, I, "none", sms), decode_nvfp4="all", decode_experts=window)
    variants = {"codes": own, "activations": dataclasses.replace(own, decode_nvfp4="activations"),
                "all": dataclasses.replace(own, decode_nvfp4="all", decode_experts=window), "fp16_tiles": fp16}
    if window:
        variants["fp16_tiles_whole"] = dataclasses.replace(fp16, decode_experts=0)
    calls, ys, peaks = {}, {}, {}
    for key, ec in variants.items():
        kernel = TritonExperts(cfg.activation, cfg.dtype, ec)
        calls[key] = lambda kernel=kernel: kernel(inp, experts)
        ys[key] = calls[key]().clone()
        peaks[key] = peak_bytes(calls[key])
    bf16_kernel = TritonExperts(cfg.activation, cfg.dtype)
    calls["bf16"] = lambda: bf16_kernel(inp_bf16, bf16)
    calls["decode_x"] = lambda: nvfp4_values(inp.x)
    calls["decode_gate_up"] = lambda: nvfp4_values(experts.gate_up)
    calls["decode_down"] = lambda: nvfp4_values(experts.down)
    picked = [k for k, v in variants.items() if v == sel]
    top = ys["codes"].float().abs().max()
    rec = {"model": name, "tokens": tokens, "rows": M, "selected": dataclasses.asdict(sel),
           "selected_variant": picked[0] if picked else None,
           "same_y": {k: bool(torch.equal(v, ys["codes"])) for k, v in ys.items() if k != "codes"},
           "max_rel_diff": {k: float((v.float() - ys["codes"].float()).abs().max() / top)
                            for k, v in ys.items() if k != "codes"},
           "peak_bytes": peaks}
    return time_variants(rec, calls, flush, args)


def summary(rec: dict) -> str:
    """One case's line: each variant's median ms and peak memory, the selected variant, and
    whether any y differs."""
    return (case_line(rec)
            + " | peak GB " + " ".join(f"{k} {v / 1e9:.2f}" for k, v in rec["peak_bytes"].items())
            + f" | selected {rec['selected_variant']}"
            + ("" if all(rec["same_y"].values()) else f" | DIFFERENT y, max rel {rec['max_rel_diff']}"))


def main() -> None:
    args = study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10).parse_args()
    if args.schemes != "nvfp4":
        raise SystemExit(f"nvfp4_study: --schemes must be nvfp4 (the study is of that scheme), got {args.schemes!r}")
    run_on_gpu(args, "scripts/nvfp4_study.py", study, summary)


if __name__ == "__main__":
    main()

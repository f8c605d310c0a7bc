"""Tile-shape sweeps of the grouped GEMM (``moeshard bench --tune``).

Each candidate is timed alone on routed rows of a real shape: the fused gate_up GEMM on gathered
rows (``gate_up``: fp8 widened to fp16; ``gate_up_mma``: on the fp8 tensor cores), and the down GEMM on h at the padded
positions (quantized as the scheme does). The best
candidates per regime are what ``moeshard.kernels.configs`` encodes; rerun this on new hardware.
A candidate that fails to compile or launch (shared memory, registers, a Triton version without
TMA descriptors) is recorded with its error and skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moeshard.bench.timing import L2Flush, release_memory, time_cuda
from moeshard.bench.workload import ModelOnDevice, experts_for, hidden_states, make_model, routed_input
from moeshard.config import QuantConfig
from moeshard.kernels.align import align_rows
from moeshard.kernels.configs import GemmConfig as C
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.quant import quantize_h
from moeshard.quant import get_scheme

# (scheme, model, tokens) -> candidates for the gate_up and the down GEMM; grouped by model so that
# each full-size model is generated once.
SWEEPS: list[tuple[str, str, int, dict[str, list[C]]]] = [
    ("none", "mixtral-8x7b", 16384, {
        "gate_up": [C(128, 128, 64, 8, 8, 4), C(128, 128, 64, 8, 8, 4, tma=True), C(128, 128, 64, 8, 8, 3),
                    C(128, 64, 64, 8, 4, 4), C(128, 64, 64, 8, 4, 4, tma=True)],
        "down": [C(128, 256, 64, 8, 8, 3), C(128, 256, 64, 8, 8, 3, tma=True), C(128, 128, 64, 8, 8, 4),
                 C(128, 128, 64, 8, 8, 4, tma=True), C(128, 128, 64, 8, 4, 4)]}),
    ("fp8_block", "mixtral-8x7b", 16384, {
        "gate_up": [C(128, 64, 64, 8, 8, 4), C(128, 64, 64, 8, 8, 4, tma=True), C(128, 64, 128, 8, 8, 3)],
        # The 2026-11-30 candidates: then 128 x 128 fused fp8 tiles spilled (147-171 TFLOP/s), as did 4 warps
        # (152). The prefill tiles select_config uses now come from scripts/fp8_study.py's sweeps.
        "gate_up_mma": [C(128, 64, 128, 8, 8, 4), C(128, 64, 128, 8, 8, 4, tma=True)],
        "down": [C(128, 128, 128, 8, 8, 4), C(128, 128, 128, 8, 8, 4, tma=True), C(128, 64, 128, 8, 4, 4),
                 C(128, 64, 128, 8, 4, 4, tma=True)]}),
    ("none", "mixtral-8x7b", 1, {
        "gate_up": [C(16, 32, 128, 1, 4, 6), C(16, 64, 128, 1, 4, 4), C(16, 128, 128, 1, 4, 3)],
        "down": [C(16, 16, 128, 1, 4, 6), C(16, 32, 128, 1, 4, 6), C(16, 64, 128, 1, 4, 4)]}),
    ("nvfp4", "mixtral-8x7b", 16384, {
        "gate_up": [C(128, 64, 64, 8, 8, 3), C(128, 128, 64, 8, 8, 3), C(128, 64, 128, 8, 8, 3)],
        "down": [C(128, 128, 64, 8, 8, 3), C(128, 64, 64, 8, 4, 3), C(128, 128, 128, 8, 8, 3)]}),
    ("none", "deepseek-v3", 4096, {
        "gate_up": [C(128, 128, 64, 8, 8, 4), C(128, 128, 64, 8, 8, 4, tma=True), C(64, 128, 64, 8, 4, 4),
                    C(64, 64, 64, 8, 4, 4, tma=True)],
        "down": [C(128, 256, 64, 8, 8, 3), C(128, 128, 64, 8, 8, 4, tma=True), C(64, 128, 64, 8, 4, 4),
                 C(64, 256, 64, 8, 8, 3, tma=True)]}),
    ("none", "deepseek-v3", 1, {
        "gate_up": [C(16, 16, 128, 1, 4, 6), C(16, 32, 128, 1, 4, 6), C(16, 64, 128, 1, 4, 4)],
        "down": [C(16, 64, 128, 1, 4, 4), C(16, 128, 128, 1, 4, 4)]}),
    ("none", "deepseek-v3", 64, {
        "gate_up": [C(16, 64, 128, 1, 4, 4), C(16, 64, 128, 1, 4, 4, tma=True), C(16, 128, 128, 1, 4, 3),
                    C(16, 64, 256, 1, 4, 3), C(16, 32, 256, 1, 4, 4)],
        "down": [C(16, 64, 128, 1, 4, 4), C(16, 64, 128, 1, 4, 4, tma=True), C(16, 128, 128, 1, 4, 4),
                 C(16, 64, 256, 1, 4, 3), C(16, 32, 256, 1, 4, 4)]}),
    ("fp8_block", "deepseek-v3", 64, {
        "gate_up": [C(16, 32, 128, 1, 4, 6), C(16, 64, 128, 1, 4, 4), C(16, 128, 128, 1, 4, 3)],
        "down": [C(16, 64, 128, 1, 4, 4), C(16, 64, 128, 1, 4, 4, tma=True), C(16, 128, 128, 1, 4, 4),
                 C(16, 32, 128, 1, 4, 6)]}),
    ("nvfp4", "deepseek-v3", 64, {
        "gate_up": [C(16, 64, 128, 1, 4, 3), C(16, 64, 256, 1, 4, 3), C(16, 128, 128, 1, 4, 3)],
        "down": [C(16, 64, 128, 1, 4, 3), C(16, 64, 256, 1, 4, 3), C(16, 128, 128, 1, 4, 3)]}),
]


def _time(fn: Callable[[], object], flush: L2Flush, reps: int) -> dict:
    try:
        return {"ms": time_cuda(fn, warmup=2, reps=reps, flush=flush).median_ms}
    except Exception as exc:  # compile / launch failures of one candidate must not end the sweep
        torch.cuda.synchronize()
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def sweep(device: torch.device, progress: Callable[[str], None], reps: int = 10,
          only: tuple[str, ...] | None = None) -> list[dict]:
    """Runs ``SWEEPS`` (or the schemes in ``only``); one entry per (shape, GEMM, candidate)."""
    flush = L2Flush(device)
    out: list[dict] = []
    models: dict[str, ModelOnDevice] = {}
    for scheme, name, tokens, cands in SWEEPS:
        if only and scheme not in only:
            continue
        if name not in models:
            models.clear()
            release_memory()
            models[name] = make_model(name, device)
        model = models[name]
        cfg = model.cfg
        experts = experts_for(model, scheme)
        inp, _ = routed_input(model, hidden_states(model, tokens, tokens), QuantConfig(scheme))
        E, H, I, M = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, inp.num_rows
        per_tensor = get_scheme(scheme).per_tensor_activation
        for gemm in cands:
            for c in cands[gemm]:
                amax = torch.zeros(E, dtype=torch.float32, device=device) if per_tensor else None
                plan = align_rows(inp.expert_ids, E, c.block_m, amax=amax)
                if gemm.startswith("gate_up"):
                    h = torch.empty(plan.padded_rows, I, dtype=cfg.dtype, device=device)
                    # partial binds this candidate's arguments now (the loop rebinds them before the next call).
                    fn: Callable[[], torch.Tensor] = functools.partial(
                        moe_gemm, inp.x, experts.gate_up, plan, h, c, activation=cfg.activation, gather=True, amax=amax,
                        fp8_exact=gemm == "gate_up", a_row_div=inp.repeat)
                    flops = 4 * M * H * I
                else:
                    h = (torch.randn(plan.padded_rows, I, device=device) * 0.1).to(cfg.dtype)
                    if amax is not None:
                        amax.fill_(float(h.abs().amax()))
                    a = quantize_h(h, scheme, plan, amax) if scheme != "none" else h
                    y = torch.empty(M, H, dtype=cfg.dtype, device=device)
                    fn = functools.partial(moe_gemm, a, experts.down, plan, y, c, activation=None, gather=False)
                    flops = 2 * M * H * I
                res = _time(fn, flush, reps)
                entry = {"scheme": scheme, "model": name, "tokens": tokens, "gemm": gemm, "config": c.as_dict(), **res}
                if "ms" in res:
                    entry["tflops"] = flops / (res["ms"] * 1e-3) / 1e12
                out.append(entry)
                progress(f"  tune {scheme:9s} {name:13s} T={tokens:<6d} {gemm:7s} {c.as_dict()} -> "
                         + (f"{res['ms']:.3f} ms ({entry['tflops']:.0f} TFLOP/s)" if "ms" in res else res["error"]))
        del experts, inp
        release_memory()
    return out


def best(results: list[dict]) -> list[dict]:
    """The fastest candidate per (scheme, model, tokens, gemm)."""
    winners: dict[tuple, dict] = {}
    for r in results:
        if "ms" not in r:
            continue
        key = (r["scheme"], r["model"], r["tokens"], r["gemm"])
        if key not in winners or r["ms"] < winners[key]["ms"]:
            winners[key] = r
    return list(winners.values())

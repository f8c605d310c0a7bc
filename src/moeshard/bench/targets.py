"""The performance targets, evaluated on one run's records.

Every ratio but the fused-MoE ones compares figures of the same run. The fused-MoE ratios compare
this run's experts time with ``FUSED_MOE_MS``: the Triton fused-MoE kernel of vLLM 0.33.0 (align,
GEMM1, silu-and-mul, fp8 quantization of h, GEMM2; the top-k sum left out, as it is left out of
moeshard's experts time), timed on one H200 (torch 2.11, Triton 3.6) on the inputs of
``moeshard.bench.workload`` with the bench's seeds, under CUDA graphs with an L2 flush before
every repetition. vLLM is not installed on the GPU machine, so those figures are constants here,
and they are compared only with a run on that GPU (``FUSED_MOE_GPU`` in its device name): on any
other, the fused-MoE targets have no case.

=====================  ==========================================================  =========
name                   ratio (record filter)                                       threshold
=====================  ==========================================================  =========
bf16_vs_grouped_mm     experts time of torch._grouped_mm GEMMs / ours              >= 1.05
                       (bf16, prefill)
bf16_vs_peak           expert TFLOP/s / dense bf16 matmul TFLOP/s (bf16, prefill)   >= 0.80
decode_vs_copy         weight bytes / time / copy bandwidth (deepseek-v3 bf16,      >= 0.85
                       decode, <= 64 tokens)
layer_vs_experts       experts time / whole-layer time (bf16, prefill)              >= 0.85
fp8_block_vs_bf16      bf16 experts time / fp8_block experts time (prefill)         >= 1.5
fp8_vs_fused_moe       fused-MoE time / ours (fp8_tensor, fp8_block; every shape    >= 0.95
                       with a fused-MoE figure; 5% is noise)
fp8_prefill_vs_fused   the same at prefill (4096, 16384 tokens)                     >= 1.2
fp8_decode_vs_copy     weight bytes / time / copy bandwidth (fp8, Mixtral and       >= 0.85
                       DeepSeek-V3, 16 to 128 tokens)
fp8_one_token_vs_copy  the same at 1 token (within 1.2x of copy time)               >= 0.833
fp8_layer_vs_experts   experts time / whole-layer time (fp8, prefill)               >= 0.85
layer_vs_all_experts   (experts + shared experts) time / whole-layer time (bf16,    >= 0.85
                       prefill)
fp8_layer_vs_all_      the same, fp8, prefill                                       >= 0.85
experts
=====================  ==========================================================  =========

The two ``layer_vs_experts`` targets count the routed experts alone as the layer's expert work;
the two ``all_experts`` ones count the shared experts too (the models that have them: DeepSeek-V3
here), each timed alone. Both measure what the layer adds around its experts: the router, the
input quantization, dispatch and combine; with shared experts the first also counts their GEMMs
as overhead, though they are expert work the model asks for, which the layer runs beside the
routed path.
"""

from __future__ import annotations

from collections.abc import Callable

# (model, tokens, quant) -> ms of vLLM 0.33.0's Triton fused-MoE kernel on one H200 (see above).
FUSED_MOE_MS: dict[tuple[str, int, str], float] = {
    **{("mixtral-8x7b", t, q): ms for (t, q), ms in {
        (1, "none"): 0.192, (16, "none"): 0.662, (128, "none"): 0.688, (4096, "none"): 5.51, (16384, "none"): 21.7,
        (1, "fp8_tensor"): 0.120, (16, "fp8_tensor"): 0.364, (128, "fp8_tensor"): 0.379, (4096, "fp8_tensor"): 2.61,
        (16384, "fp8_tensor"): 10.8,
        (1, "fp8_block"): 0.126, (16, "fp8_block"): 0.361, (128, "fp8_block"): 0.402, (4096, "fp8_block"): 4.75,
        (16384, "fp8_block"): 19.3}.items()},
    **{("qwen3-30b-a3b", t, q): ms for (t, q), ms in {
        (1, "none"): 0.039, (16, "none"): 0.225, (128, "none"): 0.315, (4096, "none"): 0.837, (16384, "none"): 2.76,
        (1, "fp8_tensor"): 0.031, (16, "fp8_tensor"): 0.132, (128, "fp8_tensor"): 0.191, (4096, "fp8_tensor"): 0.516,
        (16384, "fp8_tensor"): 1.70,
        (1, "fp8_block"): 0.029, (16, "fp8_block"): 0.131, (128, "fp8_block"): 0.185, (4096, "fp8_block"): 0.749,
        (16384, "fp8_block"): 2.59}.items()},
    **{("deepseek-v3", t, q): ms for (t, q), ms in {
        (1, "none"): 0.191, (16, "none"): 1.73, (128, "none"): 3.93, (4096, "none"): 9.80, (16384, "none"): 28.7,
        (1, "fp8_tensor"): 0.111, (16, "fp8_tensor"): 0.906, (128, "fp8_tensor"): 1.95, (4096, "fp8_tensor"): 4.70,
        (16384, "fp8_tensor"): 13.7,
        (1, "fp8_block"): 0.108, (16, "fp8_block"): 0.906, (128, "fp8_block"): 2.17, (4096, "fp8_block"): 6.43,
        (16384, "fp8_block"): 22.6}.items()},
}

# The GPU FUSED_MOE_MS was timed on, as it appears in torch's device name ("NVIDIA H200").
FUSED_MOE_GPU = "H200"

FP8 = ("fp8_tensor", "fp8_token", "fp8_block")


def fused_moe_applies(device_name: str | None) -> bool:
    """Whether FUSED_MOE_MS may be compared with a run on the GPU named ``device_name`` (torch's
    name, for example "NVIDIA H100 80GB HBM3"; None for a run whose device is unknown)."""
    return device_name is not None and FUSED_MOE_GPU in device_name


def vs_fused_moe(r: dict) -> float | None:
    """fused-MoE ms / our experts ms for a record with a fused-MoE figure, else None. The caller
    decides whether the run's GPU is the one of those figures (``fused_moe_applies``)."""
    ms = FUSED_MOE_MS.get((r["model"], r["tokens"], r["quant"]))
    return None if ms is None or not r.get("experts_ms") else ms / r["experts_ms"]


def _fp8_decode(r: dict, tokens: tuple[int, int]) -> bool:
    return (r["quant"] in FP8 and r["regime"] == "decode" and r["model"] in ("mixtral-8x7b", "deepseek-v3")
            and tokens[0] <= r["tokens"] <= tokens[1])


# (name, ratio: a key of a record's ``ratios`` or "vs_fused_moe", threshold, which records)
TARGETS: tuple[tuple[str, str, float, Callable[[dict], bool]], ...] = (
    ("bf16_vs_grouped_mm", "vs_grouped_mm", 1.05, lambda r: r["quant"] == "none" and r["regime"] == "prefill"),
    ("bf16_vs_peak", "vs_peak", 0.80, lambda r: r["quant"] == "none" and r["regime"] == "prefill"),
    ("decode_vs_copy", "vs_copy", 0.85,
     lambda r: r["quant"] == "none" and r["regime"] == "decode" and r["model"] == "deepseek-v3" and r["tokens"] <= 64),
    ("layer_vs_experts", "layer_over_experts", 0.85, lambda r: r["quant"] == "none" and r["regime"] == "prefill"),
    ("fp8_block_vs_bf16", "vs_bf16", 1.5, lambda r: r["quant"] == "fp8_block" and r["regime"] == "prefill"),
    ("fp8_vs_fused_moe", "vs_fused_moe", 0.95, lambda r: r["quant"] in ("fp8_tensor", "fp8_block")),
    ("fp8_prefill_vs_fused", "vs_fused_moe", 1.2,
     lambda r: r["quant"] in ("fp8_tensor", "fp8_block") and r["regime"] == "prefill"),
    ("fp8_decode_vs_copy", "vs_copy", 0.85, lambda r: _fp8_decode(r, (16, 128))),
    ("fp8_one_token_vs_copy", "vs_copy", 1 / 1.2, lambda r: _fp8_decode(r, (1, 1))),
    ("fp8_layer_vs_experts", "layer_over_experts", 0.85, lambda r: r["quant"] in FP8 and r["regime"] == "prefill"),
    ("layer_vs_all_experts", "layer_over_all_experts", 0.85, lambda r: r["quant"] == "none" and r["regime"] == "prefill"),
    ("fp8_layer_vs_all_experts", "layer_over_all_experts", 0.85,
     lambda r: r["quant"] in FP8 and r["regime"] == "prefill"),
)
# Targets over several schemes name the scheme in each case.
PER_SCHEME = {"fp8_vs_fused_moe", "fp8_prefill_vs_fused", "fp8_decode_vs_copy", "fp8_one_token_vs_copy",
              "fp8_layer_vs_experts", "fp8_layer_vs_all_experts"}


def _value(r: dict, ratio: str) -> float | None:
    return vs_fused_moe(r) if ratio == "vs_fused_moe" else r.get("ratios", {}).get(ratio)


def evaluate(records: list[dict], device_name: str | None) -> list[dict]:
    """One entry per target: the cases it covers with their ratio, and whether each meets it.

    ``records`` are one run's, on the GPU torch names ``device_name`` (the run's
    ``device["name"]``). A target with no matching case (not run, or a fused-MoE target on another
    GPU than ``FUSED_MOE_GPU``, which then also carries ``not_evaluated``: why) is reported with
    ``met: None``.
    """
    fused = fused_moe_applies(device_name)
    out = []
    for name, key, threshold, keep in TARGETS:
        if key == "vs_fused_moe" and not fused:
            out.append({"name": name, "ratio": key, "threshold": threshold, "met": None, "worst": None, "cases": [],
                        "not_evaluated": f"the fused-MoE figures are an {FUSED_MOE_GPU}'s; this run is on {device_name}"})
            continue
        cases: list[dict] = []
        values: list[float] = []
        for r in records:
            v = _value(r, key) if keep(r) else None
            if v is not None:
                label = f"{r['model']} T={r['tokens']}" + (f" {r['quant']}" if name in PER_SCHEME else "")
                cases.append({"case": label, "value": v, "met": v >= threshold})
                values.append(v)
        met = all(c["met"] for c in cases) if cases else None
        worst = min(values, default=None)
        out.append({"name": name, "ratio": key, "threshold": threshold, "met": met, "worst": worst, "cases": cases})
    return out

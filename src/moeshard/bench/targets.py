"""The performance targets, evaluated on one run's records (ratios of the same run).

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
=====================  ==========================================================  =========
"""

from __future__ import annotations

TARGETS = (
    ("bf16_vs_grouped_mm", "vs_grouped_mm", 1.05, lambda r: r["quant"] == "none" and r["regime"] == "prefill"),
    ("bf16_vs_peak", "vs_peak", 0.80, lambda r: r["quant"] == "none" and r["regime"] == "prefill"),
    ("decode_vs_copy", "vs_copy", 0.85,
     lambda r: r["quant"] == "none" and r["regime"] == "decode" and r["model"] == "deepseek-v3" and r["tokens"] <= 64),
    ("layer_vs_experts", "layer_over_experts", 0.85, lambda r: r["quant"] == "none" and r["regime"] == "prefill"),
    ("fp8_block_vs_bf16", "vs_bf16", 1.5, lambda r: r["quant"] == "fp8_block" and r["regime"] == "prefill"),
)


def evaluate(records: list[dict]) -> list[dict]:
    """One entry per target: the cases it covers with their ratio, and whether each meets it.

    A target with no matching case (not run) is reported with ``met: None``.
    """
    out = []
    for name, key, threshold, keep in TARGETS:
        cases = [{"case": f"{r['model']} T={r['tokens']}", "value": r["ratios"][key], "met": r["ratios"][key] >= threshold}
                 for r in records if keep(r) and key in r.get("ratios", {})]
        met = all(c["met"] for c in cases) if cases else None
        worst = min((c["value"] for c in cases), default=None)
        out.append({"name": name, "ratio": key, "threshold": threshold, "met": met, "worst": worst, "cases": cases})
    return out

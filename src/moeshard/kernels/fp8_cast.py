"""The one rounding of fp32 values to e4m3 that every kernel shares, so that a scale applied in
``quantize_h``, in the input quantization or in a GEMM's operand load gives the same bits as
``moeshard.quant.quantize_activations``."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_cast(x, scale, FP8_MAX: tl.constexpr):
    """fp32 x / scale, correctly rounded (``div_rn``, as torch's CUDA division; Triton's default
    fp32 division is approximate), clamped to +-FP8_MAX, rounded to e4m3 (nearest even)."""
    return tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)

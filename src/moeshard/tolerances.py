"""The one tolerance table.

``LAYER[(dtype, scheme)] = (atol, rtol)`` bounds |layer - reference| elementwise as
``atol + rtol * |reference|``, where the reference reproduces the layer's quantization exactly
(see ``moeshard.reference``). What remains is accumulation order, model-dtype rounding of
intermediate results, and the rare activation whose quantization bucket flips because of that
rounding. Upstream's loosest figures (bf16 3.5e-2, fp8 6.5e-2, nvfp4 0.1 + H * 1e-4) are the
ceiling; these are tighter.

``QUANT_ERROR[scheme]`` bounds the relative RMS error of the quantized layer against the
unquantized one (fp32 reference, quantization error alone), measured on the test inputs.
"""

from __future__ import annotations

import torch

LAYER: dict[tuple[str, str], tuple[float, float]] = {
    # Unquantized: accumulation order and model-dtype rounding only.
    ("float32", "none"): (1e-5, 1e-5),
    ("float16", "none"): (4e-3, 4e-3),
    # bf16: a few roundings of intermediates at 2^-8, scaled up by DeepSeek's routed scaling
    # factor 2.5 (1.6e-2 was exceeded at 300 tokens of the deepseek-v3 preset).
    ("bfloat16", "none"): (2e-2, 2e-2),
    # Quantized: as above, plus room for an activation whose fp8 bucket flipped because the value
    # before quantization differed in its last bit (one e4m3 step, 1/8 relative). The size of a
    # flip does not depend on the model dtype, so neither does this allowance.
    ("float32", "fp8_tensor"): (3e-2, 2e-2),
    ("float32", "fp8_token"): (3e-2, 2e-2),
    ("float32", "fp8_block"): (3e-2, 2e-2),
    ("float16", "fp8_tensor"): (3e-2, 2e-2),
    ("float16", "fp8_token"): (3e-2, 2e-2),
    ("float16", "fp8_block"): (3e-2, 2e-2),
    ("bfloat16", "fp8_tensor"): (3e-2, 2e-2),
    ("bfloat16", "fp8_token"): (3e-2, 2e-2),
    ("bfloat16", "fp8_block"): (3e-2, 2e-2),
    # e2m1 steps are coarser (up to 1/3 relative), so a flipped nvfp4 value weighs more.
    ("float32", "nvfp4"): (4e-2, 2e-2),
    ("float16", "nvfp4"): (4e-2, 2e-2),
    ("bfloat16", "nvfp4"): (4e-2, 2e-2),
}

QUANT_ERROR: dict[str, float] = {
    "none": 0.0,
    "fp8_tensor": 0.10,
    "fp8_token": 0.10,
    "fp8_block": 0.10,
    "nvfp4": 0.30,
}


def tolerance(dtype: torch.dtype | str, scheme: str) -> tuple[float, float]:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    key = (name, scheme)
    if key not in LAYER:
        raise ValueError(f"tolerance: no entry for dtype={name!r}, quant={scheme!r}")
    return LAYER[key]


def compare(out: torch.Tensor, ref: torch.Tensor, dtype, scheme: str) -> tuple[float, float, float, bool]:
    """(max_abs_err, atol, rtol, ok) comparing every element of ``out`` with ``ref``."""
    atol, rtol = tolerance(dtype, scheme)
    if out.shape != ref.shape:
        raise ValueError(f"compare: output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    if out.numel() == 0:
        return 0.0, atol, rtol, True
    diff = (out.double() - ref.double()).abs()
    ok = bool(torch.all(diff <= atol + rtol * ref.double().abs())) and bool(torch.isfinite(out).all())
    return float(diff.max()), atol, rtol, ok

"""The one tolerance table.

``LAYER[(dtype, scheme)] = (atol, rtol)`` bounds |layer - reference| elementwise as
``atol + rtol * |reference|``, where the reference reproduces the layer's quantization exactly
(see ``moeshard.reference``). What remains is accumulation order, model-dtype rounding of
intermediate results, and the rare activation whose quantization bucket flips because of that
rounding. Upstream's loosest figures (bf16 3.5e-2, fp8 6.5e-2, nvfp4 0.1 + H * 1e-4) are the
ceiling; these are tighter.

``ACCUMULATION[kind]`` is the accumulation error a kernel's sums may have, relative to
``sum |a| |b|`` of each sum; the reference turns it into a per-element slack (roundings that a
sum this close to a boundary may take either way, see ``moeshard.reference``), which
``compare`` adds to the table's bound.

``QUANT_ERROR[scheme]`` bounds the relative RMS error of the quantized layer against the
unquantized one (fp32 reference, quantization error alone), measured on the test inputs.
"""

from __future__ import annotations

import torch

LAYER: dict[tuple[str, str], tuple[float, float]] = {}
for _scheme in ("none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"):
    # What remains once the reference has reproduced every quantization and priced every
    # ambiguous rounding (its slack): accumulation order and the model-dtype rounding of the
    # output, of the shared experts and of intermediates the layer keeps in the model dtype.
    # The same for every scheme: a quantized layer needs no more room than an unquantized one.
    LAYER[("float32", _scheme)] = (1e-5, 1e-5)
    LAYER[("float16", _scheme)] = (4e-3, 4e-3)
    # bf16: a few roundings at 2^-8, scaled up by DeepSeek's routed scaling factor 2.5 (1.6e-2
    # was exceeded at 300 tokens of the deepseek-v3 preset before the slack existed).
    LAYER[("bfloat16", _scheme)] = (2e-2, 2e-2)

ACCUMULATION: dict[str, float] = {
    # fp32 accumulators (CPU, CUDA-core fp32, bf16 / fp16 tensor cores). Hopper's bf16 tensor
    # cores, the least exact of these, measured at most 2^-20 of sum |a||b| on 4M sums of 7168
    # terms; the bound leaves a factor of 4.
    "fp32": 2.0**-18,
    # Hopper's fp8 tensor cores keep ~14 bits while they accumulate (promoted to fp32 every
    # BLOCK_K terms).
    "fp8_mma": 2.0**-12,
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


def compare(out: torch.Tensor, ref, dtype, scheme: str) -> tuple[float, float, float, bool]:
    """(max_abs_err, atol, rtol, ok) comparing every element of ``out`` with ``ref``.

    ref: a ``moeshard.reference.Reference`` (its slack is added to the bound: ``|out - ref| <=
    atol + rtol |ref| + slack``) or a plain tensor (no slack)."""
    from moeshard.reference import Reference  # the reference itself imports this table

    atol, rtol = tolerance(dtype, scheme)
    expected, slack = (ref.out, ref.slack) if isinstance(ref, Reference) else (ref, None)
    if out.shape != expected.shape:
        raise ValueError(f"compare: output shape {tuple(out.shape)} != reference shape {tuple(expected.shape)}")
    if out.numel() == 0:
        return 0.0, atol, rtol, True
    expected = expected.double().to(out.device)
    diff = (out.double() - expected).abs()
    bound = atol + rtol * expected.abs()
    if slack is not None:
        bound = bound + slack.double().to(out.device)
    ok = bool(torch.all(diff <= bound)) and bool(torch.isfinite(out).all())
    return float(diff.max()), atol, rtol, ok

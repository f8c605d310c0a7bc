"""Triton kernels for the routed experts (GPU; also run by Triton's CPU interpreter in tests).

    expert_ids [M] --align--> tiles of BLOCK_M rows, one expert per tile (no host sync)
    rows [M, H] --gather by tile--> gate_up GEMM with act(gate) * up fused --> h [P, I]
        --quantize per scheme (per-expert / per-row / per-128 / nvfp4)--> h_q
        --down GEMM, rows scattered back to their original order--> y [M, H]

One concern per module: ``align`` (tile plan of routed rows), ``grouped_gemm`` (the grouped
GEMM for every scheme), ``quant`` (activation quantization of h), ``configs`` (tile shapes per regime), ``experts``
(``TritonExperts``, the drop-in for ``GroupedExperts``), ``quant_rows`` (the layer's input
quantized in one fused pass), ``pdl`` (programmatic dependent launch of the experts' kernels),
``layout`` (the experts' input laid out at the tile plan's positions, for gate_up without gather),
``nvfp4_values`` (nvfp4 operands decoded to fp16 once, before the GEMMs, at prefill), ``gemv``
(one token's fp8 experts as matrix-vector products on the CUDA cores).

Importing this package never imports Triton; ``triton_support`` says whether the kernels can
run on a device and why not.
"""

from __future__ import annotations

import torch

from moeshard.triton_env import triton_importable

# The kernel modes (``QuantScheme.kernel_mode``) whose layer input ``quant_rows.quantize_rows``
# quantizes in one pass: fp8 per tensor, per row, per 128 block, and nvfp4. Here, not in
# quant_rows, so that asking ``fused_input_quant`` imports no Triton.
FUSED_INPUT_MODES = (1, 2, 3, 4)


def triton_support(device: torch.device, dtype: torch.dtype, scheme: str) -> tuple[bool, str]:
    """(ok, reason): whether ``TritonExperts`` runs ``scheme`` in model ``dtype`` on ``device``.

    bf16 / fp16 only: fp32 models keep the exact portable path (Triton's fp32 dot would be tf32).
    The scheme needs a kernel mode (``QuantScheme.kernel_mode``); fp8 schemes need fp8 tensor
    cores (compute capability 8.9+); nvfp4 dequantizes in the kernel and multiplies in fp16,
    which any tensor-core GPU (8.0+) does.
    """
    from moeshard.quant import FP8_DTYPE, get_scheme

    spec = get_scheme(scheme, "triton_support: quant")
    if spec.kernel_mode is None:
        return False, f"quant {scheme!r} has no Triton kernel mode (QuantScheme.kernel_mode is None)"
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"Triton kernels run on CUDA devices, not {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return False, f"Triton experts support bfloat16 and float16 models, not {dtype}"
    ok, reason = triton_importable()
    if not ok:
        return False, reason
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 0):
        return False, f"compute capability {major}.{minor} < 8.0 (no bf16 tensor cores)"
    if spec.codec is not None and spec.codec.data_dtype == FP8_DTYPE and (major, minor) < (8, 9):
        return False, f"{scheme} needs fp8 tensor cores (compute capability 8.9+), device has {major}.{minor}"
    return True, ""


def fused_input_quant(device: torch.device, scheme: str) -> bool:
    """Whether ``quant_rows.quantize_rows`` quantizes the layer's input in ``scheme`` on
    ``device``: CUDA with Triton and fp8 conversions (compute capability 8.9+: nvfp4's block
    scales are e4m3 too), and a scheme of its kernel modes (fp8 per tensor, per row, per 128
    block; nvfp4). Otherwise the torch path (``quantize_activations``) runs; both give the same
    bits."""
    from moeshard.quant import get_scheme

    spec = get_scheme(scheme, "fused_input_quant: quant")
    device = torch.device(device)
    if spec.kernel_mode not in FUSED_INPUT_MODES or spec.codec is None:
        return False
    if device.type != "cuda" or not triton_importable()[0]:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 9)


"""Which expert implementation runs: the Triton kernels (``moeshard.kernels``) where they support
the device, dtype, scheme and activation, else the portable ``GroupedExperts``
(``moeshard.experts``). Above both, so that neither imports the other to decide."""

from __future__ import annotations

import torch

from moeshard.activations import get_activation
from moeshard.experts.base import ExpertKernel
from moeshard.experts.grouped import GroupedExperts
from moeshard.kernels import triton_support


def kernel_choice(dtype: torch.dtype, device: torch.device | str, scheme: str) -> tuple[str, str]:
    """(name, reason) of the implementation ``select_kernel`` picks, for reports and tests.

    name: "triton" (``moeshard.kernels.experts.TritonExperts``) or "grouped"
    (``GroupedExperts``: ``torch._grouped_mm`` where it runs, else a per-expert loop; quantized
    schemes dequantize and multiply in fp32); reason: why the Triton kernels were not taken.
    Both add expert biases (``MoEConfig.expert_bias``).
    """
    ok, reason = triton_support(torch.device(device), dtype, scheme)
    return ("triton", "") if ok else ("grouped", reason)


def select_kernel(activation: str, dtype: torch.dtype, device: torch.device, scheme: str) -> ExpertKernel:
    """The fastest expert implementation that supports (device, dtype, scheme, activation).

    Every implementation has the same ``__call__(ExpertInput, ExpertWeights) -> [M, H]`` and
    matches the reference within the one tolerance table. On CUDA with Triton, bf16/fp16 models
    run the fused Triton kernels for every scheme (fp8 schemes need compute capability 8.9+),
    expert biases too; everything else (CPU, fp32 models, no Triton, an activation kind without a
    Triton epilogue) runs the portable ``GroupedExperts``.
    """
    name, _ = kernel_choice(dtype, device, scheme)
    if name == "triton" and get_activation(activation, "select_kernel: activation").kernel_mode is not None:
        from moeshard.kernels.experts import TritonExperts
        return TritonExperts(activation, dtype)
    return GroupedExperts(activation, dtype)

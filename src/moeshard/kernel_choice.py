"""Which expert implementation runs: the Triton kernels (``moeshard.kernels``) where they support
the device, dtype, scheme and activation, else the portable ``GroupedExperts``
(``moeshard.experts``). Above both, so that neither imports the other to decide."""

from __future__ import annotations

import torch

from moeshard.activations import get_activation
from moeshard.experts.base import ExpertKernel
from moeshard.experts.grouped import GroupedExperts
from moeshard.kernels import triton_support

# Why the Triton kernels do not run experts with biases (gpt-oss): their epilogues add none.
BIAS_REFUSAL = ("the experts have biases (MoEConfig.expert_bias), which the Triton GEMM epilogues do not add; "
                "they run on the portable experts")


def kernel_choice(dtype: torch.dtype, device: torch.device | str, scheme: str,
                  expert_bias: bool = False) -> tuple[str, str]:
    """(name, reason) of the implementation ``select_kernel`` picks, for reports and tests.

    name: "triton" (``moeshard.kernels.experts.TritonExperts``) or "grouped"
    (``GroupedExperts``: ``torch._grouped_mm`` where it runs, else a per-expert loop; quantized
    schemes dequantize and multiply in fp32); reason: why the Triton kernels were not taken.
    expert_bias: the experts have biases (``MoEConfig.expert_bias``), which only the portable
    experts add.
    """
    ok, reason = triton_support(torch.device(device), dtype, scheme)
    if ok and expert_bias:
        return "grouped", BIAS_REFUSAL
    return ("triton", "") if ok else ("grouped", reason)


def select_kernel(activation: str, dtype: torch.dtype, device: torch.device, scheme: str,
                  expert_bias: bool = False) -> ExpertKernel:
    """The fastest expert implementation that supports (device, dtype, scheme, biases).

    Every implementation has the same ``__call__(ExpertInput, ExpertWeights) -> [M, H]`` and
    matches the reference within the one tolerance table. On CUDA with Triton, bf16/fp16 models
    run the fused Triton kernels for every scheme (fp8 schemes need compute capability 8.9+);
    everything else (CPU, fp32 models, no Triton, an activation kind without a Triton epilogue,
    experts with biases) runs the portable ``GroupedExperts``.
    """
    name, _ = kernel_choice(dtype, device, scheme, expert_bias)
    if name == "triton" and get_activation(activation, "select_kernel: activation").kernel_mode is not None:
        from moeshard.kernels.experts import TritonExperts
        return TritonExperts(activation, dtype)
    return GroupedExperts(activation, dtype)

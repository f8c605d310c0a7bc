"""Numerical contracts shared by the kernels, the reference and the comparison.

Below every module that computes or checks experts (the kernels declare their accumulation
error from here, the reference prices it, ``moeshard.tolerances.compare`` reads the result), so
that none of them imports another for these facts.

``ACCUMULATION[kind]`` is the accumulation error a kernel's sums may have, relative to
``sum |a| |b|`` of each sum; the reference turns it into a per-element slack (roundings that a
sum this close to a boundary may take either way, see ``moeshard.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACCUMULATION: dict[str, float] = {
    # fp32 accumulators (CPU, CUDA-core fp32, bf16 / fp16 tensor cores). Hopper's bf16 tensor
    # cores, the least exact of these, measured at most 2^-20 of sum |a||b| on 4M sums of 7168
    # terms; the bound leaves a factor of 4.
    "fp32": 2.0**-18,
    # Hopper's fp8 tensor cores keep ~14 bits while they accumulate, promoted to fp32 every
    # BLOCK_K terms or (the per-row schemes' prefill gate_up) not at all across K. On one H200
    # (scripts/accumulation_contract.py, 2026-12-01, 8 shapes x 2 seeds, K up to 7168) both
    # stayed within 0.52 of this bound and exceeded the fp32 one 5.8-fold.
    "fp8_mma": 2.0**-12,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a float dtype: rounding to nearest moves any value v by at most u |v| (bf16 2^-8,
    fp16 2^-11, fp32 2^-24). The reference prices the layer's model-dtype roundings with it."""
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class Reference:
    """What a correct layer returns, and how far ambiguous roundings let it stray.

    out: fp64 [T, H] the reference output; slack: fp64 [T, H] >= 0 (see ``moeshard.reference``),
    added to the tolerance table's bound by ``moeshard.tolerances.compare``.
    """

    out: torch.Tensor
    slack: torch.Tensor

    def rows(self, start: int, stop: int) -> Reference:
        return Reference(self.out[start:stop], self.slack[start:stop])

    @staticmethod
    def cat(parts: list[Reference]) -> Reference:
        return Reference(torch.cat([p.out for p in parts]), torch.cat([p.slack for p in parts]))

"""What the kernels are compiled on: a scheme's and an activation's constexpr modes, and how they
read a scale tensor of any of the schemes' shapes.

Shared by the Triton grouped GEMM (``grouped_gemm``), the quantization kernels (``quant``,
``quant_rows``) and the Gluon GEMMs (``persistent_gate_up``, ``persistent_down``,
``persistent_block_down``), which compute the same arithmetic on the same operands.
"""

from __future__ import annotations

import torch

from moeshard.activations import KERNEL_PARAMS, get_activation
from moeshard.quant import get_scheme


def kernel_mode(scheme: str) -> int:
    """The scheme's mode in these kernels (``moeshard.quant.schemes.KERNEL_MODES``)."""
    mode = get_scheme(scheme, "moe_gemm").kernel_mode
    if mode is None:
        raise ValueError(f"moe_gemm: quant {scheme!r} has no Triton kernel mode")
    return mode


def act_mode(activation: str | None) -> int:
    """The epilogue's ``ACT`` mode of a registered activation kind (0 when none is fused)."""
    if activation is None:
        return 0
    kind = get_activation(activation, "moe_gemm: activation")
    refusal = kind.kernel_refusal()
    if refusal is not None or kind.kernel_mode is None:
        raise ValueError(f"moe_gemm: {refusal}")
    return kind.kernel_mode


def act_constants(activation: str | None) -> tuple[float, float]:
    """The epilogue's ``(ACT_P0, ACT_P1)``: the kind's parameters in the order its mode takes them
    (``activations.KERNEL_PARAMS``: gpt-oss's ``alpha, limit``, HY-V4's ``limit``, Inkling 2's
    ``gate_cap, up_cap``), 0.0 where the mode takes fewer than two. Compile-time constants: a
    kind's values never change."""
    if activation is None:
        return 0.0, 0.0
    kind = get_activation(activation, "moe_gemm: activation")
    names = KERNEL_PARAMS.get(kind.kernel_mode, ()) if kind.kernel_mode is not None else ()
    values = [float(kind.params[name]) for name in names] + [0.0, 0.0]
    return values[0], values[1]


# The activation modes the Gluon gate_up (``persistent_gate_up._act_mul``) computes; the experts
# run the others on the Triton gate_up (``TritonExperts``), and the Gluon kernel refuses them.
GLUON_ACT_MODES = (0, 1, 2)


def amax_mode(amax: torch.Tensor | None, row_amax: torch.Tensor | None) -> int:
    """The gate_up epilogue's ``TRACK_AMAX``: 1 max-reduces |h| per expert into amax [E], 2 per
    position into row_amax [P] (fp8_token's row maxima), 0 neither."""
    return 1 if amax is not None else 2 if row_amax is not None else 0


def scale_strides(t: torch.Tensor | None, dims: int) -> tuple[int, ...]:
    """Strides of a scale tensor broadcast to ``dims`` dimensions (0 where it has size one or is
    missing), so one kernel handles per-tensor, per-row and per-block scales alike."""
    if t is None or t.dim() == 0:
        return (0,) * dims
    strides = [s if n > 1 else 0 for n, s in zip(t.shape, t.stride(), strict=True)]
    return tuple(strides + [0] * (dims - len(strides)))


def one_w_scale_per_tile(mode: int, block_n: int, n: int, fused: bool) -> bool:
    """Whether every fp8_block (mode 3) tile of ``block_n`` of the N output columns lies in one
    128-column weight block: at most 128 columns starting on a multiple of its width, and for the
    fused gate_up N a multiple of 128 (so up's columns, N later, are aligned too). Its weight scale
    is then one scalar per K step. A [BLOCK_N] scale vector in the MMA layout costs registers:
    the 8-warp 128 x 64 x 128 fused gate_up tile needs 180 with the scalar and spills at 255 with
    the vector (scripts/kernel_resources.py). The products are the same in either form."""
    return mode == 3 and block_n <= 128 and 128 % block_n == 0 and (not fused or n % 128 == 0)

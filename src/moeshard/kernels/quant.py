"""Quantization of the intermediate h [P, I] between the two GEMMs, bit for bit as
``moeshard.quant.quantize_activations`` does it (``tests/test_kernels.py`` checks equality).

h sits at the padded positions of the tile plan (``align``); programs of ROWS positions take
their expert from ``tile_expert`` and skip tiles past the end. Modes are the schemes'
``kernel_mode`` (``moeshard.quant.schemes.KERNEL_MODES``):

=========  =========================================================================
scheme     scales
=========  =========================================================================
fp8_tensor per expert: ``amax[e] / 448`` (amax max-reduced by the gate_up GEMM)
fp8_token  per row: ``amax(|h[p, :]|) / 448`` (two passes over the row)
fp8_block  per row and 128 columns: ``amax(|h[p, g*128:(g+1)*128]|) / 448``
nvfp4      global ``2688 / amax[e]`` per expert; e4m3 block scale per 16 values
=========  =========================================================================

Divisions use ``div_rn`` (correctly rounded), as torch's CUDA kernels do; Triton's default fp32
division is approximate and would move values across rounding boundaries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.kernels.align import RowAlignment
from moeshard.kernels.grouped_gemm import kernel_mode
from moeshard.quant import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, NVFP4_BLOCK, QuantizedActivations

ROWS = 16
CHUNK = 128


@triton.jit
def _fp8(x, scale, FP8_MAX: tl.constexpr):
    return tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _e2m1_code(y):
    """fp32 -> e2m1 code (uint8, 0..15): nearest value, ties to the even code, saturating at 6;
    the sign bit follows y's sign bit (so -0.0 keeps 0x8), as ``moeshard.quant.e2m1_encode``."""
    a = tl.abs(y)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) < 0).to(tl.int32)
    return (code | (sign << 3)).to(tl.uint8)


@triton.jit
def _quantize_h_kernel(h_ptr, q_ptr, s_ptr, g_ptr, amax_ptr, tile_expert_ptr,
                       K, stride_hm, stride_qm, stride_sm,
                       MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                       CHUNK: tl.constexpr, AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr):
    pid = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + (pid * ROWS) // BLOCK_M)
    if expert < 0:
        return
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    h_rows = h_ptr + rows[:, None] * stride_hm
    if MODE == 1 or MODE == 4:
        amax = tl.maximum(tl.load(amax_ptr + expert), AMAX_FLOOR)
    if MODE == 1:
        scale = tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX)
        tl.store(s_ptr + rows * stride_sm, tl.zeros([ROWS], dtype=tl.float32) + scale)
        for k0 in range(0, K, CHUNK):
            ok = (k0 + cols) < K
            x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            tl.store(q_ptr + rows[:, None] * stride_qm + k0 + cols[None, :], _fp8(x, scale, FP8_MAX), mask=ok[None, :])
    elif MODE == 2:
        row_max = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, K, CHUNK):
            ok = (k0 + cols) < K
            x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            row_max = tl.maximum(row_max, tl.max(tl.abs(x), axis=1))
        scale = tl.math.div_rn(tl.maximum(row_max, AMAX_FLOOR), tl.zeros_like(row_max) + FP8_MAX)
        tl.store(s_ptr + rows * stride_sm, scale)
        for k0 in range(0, K, CHUNK):
            ok = (k0 + cols) < K
            x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            tl.store(q_ptr + rows[:, None] * stride_qm + k0 + cols[None, :], _fp8(x, scale[:, None], FP8_MAX), mask=ok[None, :])
    elif MODE == 3:
        for k0 in range(0, K, CHUNK):
            ok = (k0 + cols) < K
            x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            block_max = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
            scale = tl.math.div_rn(block_max, tl.zeros_like(block_max) + FP8_MAX)
            tl.store(s_ptr + rows * stride_sm + k0 // CHUNK, scale)
            tl.store(q_ptr + rows[:, None] * stride_qm + k0 + cols[None, :], _fp8(x, scale[:, None], FP8_MAX), mask=ok[None, :])
    else:
        g = tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX * 6.0, amax)
        tl.store(g_ptr + rows, tl.zeros([ROWS], dtype=tl.float32) + g)
        bcols = tl.arange(0, CHUNK // 16)
        pcols = tl.arange(0, CHUNK // 2)
        for k0 in range(0, K, CHUNK):
            ok = (k0 + cols) < K
            x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            blocks = tl.reshape(x, (ROWS, CHUNK // 16, 16))
            block_amax = tl.max(tl.abs(blocks), axis=2)
            s = tl.minimum(tl.math.div_rn(block_amax, tl.zeros_like(block_amax) + 6.0) * g, FP8_MAX).to(tl.float8e4nv)
            s32 = s.to(tl.float32)
            zero = s32 == 0.0
            y = tl.math.div_rn(blocks * g, tl.where(zero, 1.0, s32)[:, :, None])
            y = tl.where(zero[:, :, None], 0.0, y)
            code = tl.reshape(_e2m1_code(y), (ROWS, CHUNK // 2, 2))
            lo, hi = tl.split(code)
            packed = lo | (hi << 4)
            s_ok = (k0 // 16 + bcols) < K // 16
            tl.store(s_ptr + rows[:, None] * stride_sm + k0 // 16 + bcols[None, :], s, mask=s_ok[None, :])
            p_ok = (k0 // 2 + pcols) < K // 2
            tl.store(q_ptr + rows[:, None] * stride_qm + k0 // 2 + pcols[None, :], packed, mask=p_ok[None, :])


def quantize_h(h: torch.Tensor, scheme: str, plan: RowAlignment, amax: torch.Tensor | None) -> QuantizedActivations:
    """h: [P, I] model dtype at the plan's padded positions -> ``QuantizedActivations`` [P, I].

    amax: fp32 [E] per-expert amax of h (fp8_tensor, nvfp4), else None. The per-tensor scales
    come back per row (``tensor_scale`` [P, 1]), each row carrying its expert's scale. Rows of
    tiles past the end of the plan are left unwritten (no kernel reads them).
    """
    P, K = h.shape
    mode = kernel_mode(scheme)
    if P % ROWS or plan.block_m % ROWS:
        raise ValueError(f"quantize_h: padded rows {P} and block_m {plan.block_m} must be multiples of {ROWS}")
    if mode in (1, 4) and amax is None:
        raise ValueError(f"quantize_h: {scheme} needs the per-expert amax")
    dev = h.device
    if mode == 4:
        if K % NVFP4_BLOCK:
            raise ValueError(f"quantize_h: nvfp4 needs I % {NVFP4_BLOCK} == 0, got {K}")
        q = torch.empty(P, K // 2, dtype=torch.uint8, device=dev)
        s = torch.empty(P, K // NVFP4_BLOCK, dtype=FP8_DTYPE, device=dev)
        g = torch.empty(P, 1, dtype=torch.float32, device=dev)
    else:
        q = torch.empty(P, K, dtype=FP8_DTYPE, device=dev)
        s = torch.empty(P, triton.cdiv(K, CHUNK) if mode == 3 else 1, dtype=torch.float32, device=dev)
        g = s
    _quantize_h_kernel[(P // ROWS,)](
        h, q, s, g, amax if amax is not None else s, plan.tile_expert,
        K, h.stride(0), q.stride(0), s.stride(0),
        MODE=mode, ROWS=ROWS, BLOCK_M=plan.block_m, CHUNK=CHUNK, AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=FP8_MAX, num_warps=4)
    if mode == 1:
        return QuantizedActivations(scheme, q, None, s)
    if mode == 4:
        return QuantizedActivations(scheme, q, s, g)
    return QuantizedActivations(scheme, q, s, None)


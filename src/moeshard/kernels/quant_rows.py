"""The layer's input quantization in one fused pass: rows x [T, K] -> ``QuantizedActivations``,
bit for bit as ``moeshard.quant.quantize_activations`` makes them (``tests/test_kernels.py``).

The torch path takes several passes over x (float copy, abs, amax, division, clamp, fp8 cast:
about 1.7 ms for DeepSeek-V3's 16384 x 7168 bf16 input on one H200, ``scripts/layer_profile.py``);
here each row block is read once (fp8_token's rows longer than WHOLE_ROW columns twice) and written
once:

=========  =====================================================================================
scheme     passes
=========  =====================================================================================
fp8_tensor ``input_amax``: one read of x, max-reduced into one fp32 (the caller all-reduces it
           over the quantization domain); then ``quantize_rows``: one program per ROWS rows x
           CHUNK columns, one read, one fp8 write; each program computes the scale from the
           amax, and the first stores it
fp8_token  one program per ``token_tile(T, K)`` rows: rows of at most WHOLE_ROW columns held in
           registers, their max and their quantized values from that one read; longer rows in
           two passes of column steps (the row max, then the quantized row)
fp8_block  one program per ROWS rows x CHUNK columns: the group max, then the group
nvfp4      ``input_amax`` as for fp8_tensor (the global scale ``2688 / amax``); then one program
           per ROWS rows x CHUNK columns: each 16-value block's max, its e4m3 scale, the packed
           e2m1 codes (``quant._nvfp4_chunk``, the arithmetic quantize_h uses for h)
=========  =====================================================================================

Why fp8_token holds whole rows: in two passes the second read of a row missed L2 at 16384 tokens
(1.8-2.1 TB/s against a copy's 3.6-4.1 at the bench models' hidden sizes, one H200,
``scripts/input_quant_study.py``), and at one token a 16 x 128 tile left one SM doing 56 dependent
steps of DeepSeek-V3's 7168 columns, twice. Longer rows, which do not fit, get fewer rows per
program and wider steps when T is small, for the same reason.

Schemes without a kernel mode here keep the torch path (``quantize_activations``), which takes
about twenty elementwise passes for nvfp4. Scales are correctly rounded (``div_rn``), as torch
computes them; max is exact in any order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.kernels import FUSED_INPUT_MODES
from moeshard.kernels.modes import kernel_mode
from moeshard.kernels.quant import _fp8, _nvfp4_chunk
from moeshard.quant import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, NVFP4_BLOCK, QuantizedActivations
from moeshard.quant.fp8 import fp8_scale
from moeshard.quant.nvfp4 import nvfp4_global_scale

ROWS = 16  # rows per program
CHUNK = 128  # columns per step: one fp8_block scale group
MODES = FUSED_INPUT_MODES  # the kernel modes quantized here (fp8 per tensor, per row, per 128 block; nvfp4)
_AMAX_COLS = 2048  # columns per amax program
# fp8_token: a program's rows x the row length rounded up to a power of two, held in registers
# (32 fp32 per thread of 8 warps, twice that while loading).
WHOLE_ROW = 8192


@triton.jit
def _amax_kernel(x_ptr, out_ptr, T, K, stride_xm, ROWS: tl.constexpr, COLS: tl.constexpr):
    """out (fp32 [1], zeroed) = max |x| over all of x [T, K]; one program per ROWS x COLS block.
    |x| >= 0, so its fp32 bits order as int32 and one integer atomic max reduces the blocks."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok = (rows < T)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    block_max = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    tl.atomic_max(out_ptr.to(tl.pointer_type(tl.int32)), block_max.to(tl.int32, bitcast=True))


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, tensor_scale_ptr, T, K, stride_xm, stride_qm, stride_sm,
                          MODE: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                          AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr, WHOLE: tl.constexpr = False):
    """Program (i, j) quantizes rows [i*ROWS, (i+1)*ROWS); modes 1, 3 and 4 columns
    [j*CHUNK, (j+1)*CHUNK) (mode 1: the scale ``fp8_scale(amax)`` from the amax at
    ``tensor_scale_ptr``, stored by program (0, 0) at ``s_ptr``; mode 3: one scale group; mode 4:
    CHUNK / 16 blocks, the global scale read from ``tensor_scale_ptr``), mode 2 the whole row
    (j = 0 only): WHOLE, in one load of CHUNK >= K columns; else in steps of CHUNK columns, twice."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < T
    cols = tl.arange(0, CHUNK)
    x_rows = x_ptr + rows[:, None] * stride_xm
    q_rows = q_ptr + rows[:, None] * stride_qm
    if MODE == 4:
        k0 = tl.program_id(1) * CHUNK
        x = tl.load(x_rows + k0 + cols[None, :], mask=row_ok[:, None] & ((k0 + cols) < K)[None, :],
                    other=0.0).to(tl.float32)
        packed, s = _nvfp4_chunk(x, tl.load(tensor_scale_ptr), ROWS, CHUNK, FP8_MAX)
        bcols = k0 // 16 + tl.arange(0, CHUNK // 16)
        pcols = k0 // 2 + tl.arange(0, CHUNK // 2)
        tl.store(s_ptr + rows[:, None] * stride_sm + bcols[None, :], s,
                 mask=row_ok[:, None] & (bcols < K // 16)[None, :])
        tl.store(q_rows + pcols[None, :], packed, mask=row_ok[:, None] & (pcols < K // 2)[None, :])
    elif MODE != 2:
        k0 = tl.program_id(1) * CHUNK
        ok = row_ok[:, None] & ((k0 + cols) < K)[None, :]
        x = tl.load(x_rows + k0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if MODE == 1:
            # fp8_scale(amax), correctly rounded as torch divides (an infinite amax too); program
            # (0, 0) stores it.
            at = tl.zeros([ROWS], dtype=tl.int32)
            amax = tl.maximum(tl.load(tensor_scale_ptr + at), AMAX_FLOOR)
            scale = tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX)
            # Zero only at row 0 of program (0, 0): program ids are never negative.
            tl.store(s_ptr + at, scale, mask=(tl.arange(0, ROWS) + tl.program_id(0) + tl.program_id(1)) == 0)
        else:
            block_max = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
            scale = tl.math.div_rn(block_max, tl.zeros_like(block_max) + FP8_MAX)
            tl.store(s_ptr + rows * stride_sm + k0 // CHUNK, scale, mask=row_ok)
        tl.store(q_rows + k0 + cols[None, :], _fp8(x, scale[:, None], FP8_MAX), mask=ok)
    elif WHOLE:
        ok = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR), tl.zeros([ROWS], tl.float32) + FP8_MAX)
        tl.store(s_ptr + rows * stride_sm, scale, mask=row_ok)
        tl.store(q_rows + cols[None, :], _fp8(x, scale[:, None], FP8_MAX), mask=ok)
    else:
        row_max = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, K, CHUNK):
            ok = row_ok[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_rows + k0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            row_max = tl.maximum(row_max, tl.max(tl.abs(x), axis=1))
        scale = tl.math.div_rn(tl.maximum(row_max, AMAX_FLOOR), tl.zeros_like(row_max) + FP8_MAX)
        tl.store(s_ptr + rows * stride_sm, scale, mask=row_ok)
        for k0 in range(0, K, CHUNK):
            ok = row_ok[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_rows + k0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            tl.store(q_rows + k0 + cols[None, :], _fp8(x, scale[:, None], FP8_MAX), mask=ok)


def _check(x: torch.Tensor, where: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point() or x.stride(1) != 1:
        got = f"{x.dtype} {list(x.shape)} strides {x.stride()}" if isinstance(x, torch.Tensor) else repr(x)
        raise ValueError(f"{where}: x must be a float [T, K] tensor with unit column stride, got {got}")


def input_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 []: max |x| over x [T, K] (0 for T = 0 or K = 0), as ``quant.fp8.abs_amax(x, (0, 1))``;
    one read of x, no host synchronisation."""
    _check(x, "input_amax")
    T, K = x.shape
    out = torch.zeros(1, dtype=torch.float32, device=x.device)
    if T and K:
        _amax_kernel[(triton.cdiv(T, ROWS), triton.cdiv(K, _AMAX_COLS))](
            x, out, T, K, x.stride(0), ROWS=ROWS, COLS=_AMAX_COLS, num_warps=4)
    return out.reshape(())


def token_tile(T: int, K: int) -> tuple[int, int, bool]:
    """fp8_token's (rows per program, columns per load, whole rows) for x [T, K]: rows of at most
    WHOLE_ROW columns (rounded up to a power of two) whole, as many per program as fit in
    WHOLE_ROW elements (at most ROWS, and not more than T needs); longer rows in steps, ROWS rows
    per program, or the power of two at or above T when fewer (the steps then take
    ROWS * CHUNK / rows columns: the same tile, fewer steps)."""
    width = triton.next_power_of_2(max(K, 1))
    rows = min(ROWS, triton.next_power_of_2(max(T, 1)))
    if width <= WHOLE_ROW:
        return min(rows, WHOLE_ROW // width), width, True
    return rows, ROWS * CHUNK // rows, False


def quantize_rows(x: torch.Tensor, scheme: str, amax: torch.Tensor | None = None) -> QuantizedActivations:
    """x [T, K] (bf16 / fp16 / fp32) -> ``QuantizedActivations`` equal to
    ``quantize_activations(x, scheme, amax)`` bit for bit.

    scheme: a registered scheme of kernel mode 1, 2, 3 or 4 (``MODES``). amax: fp32 [] the amax
    of the quantization domain for fp8_tensor and nvfp4's global scale (``input_amax``,
    all-reduced over the domain by the caller); None: this x's own. Ignored (but validated as ``quantize_activations`` does: a
    per-row scheme takes its scales from x) for the other schemes.
    """
    _check(x, "quantize_rows")
    mode = kernel_mode(scheme)
    if mode not in MODES:
        raise ValueError(f"quantize_rows: {scheme!r} (kernel mode {mode}) is not one of the modes {list(MODES)}; "
                         f"use moeshard.quant.quantize_activations")
    T, K = x.shape
    dev = x.device
    if mode == 4 and K % NVFP4_BLOCK:
        raise ValueError(f"quantize_rows: {scheme} needs K % {NVFP4_BLOCK} == 0, got x.shape[1] (K)={K}")
    q = torch.empty(T, K // 2 if mode == 4 else K, dtype=torch.uint8 if mode == 4 else FP8_DTYPE, device=dev)
    launch = T > 0 and (K > 0 or mode == 2)  # an empty fp8_token row still has a scale (the amax floor's)
    tensor_scale = None
    g = None  # what the kernel reads at tensor_scale_ptr: fp8_tensor's amax, nvfp4's global scale
    if mode in (1, 4):
        a = input_amax(x) if amax is None else amax
        if not isinstance(a, torch.Tensor) or a.shape != () or a.dtype != torch.float32:
            raise ValueError(f"quantize_rows: amax must be an fp32 [] tensor, got {a!r}")
        if mode == 4:
            tensor_scale = nvfp4_global_scale(a)
            g = tensor_scale.reshape(1)
        elif launch:
            # The kernel computes fp8_scale(amax) itself and stores it: three small launches fewer.
            tensor_scale = torch.empty((), dtype=torch.float32, device=dev)
            g = a.reshape(1)
        else:
            tensor_scale = fp8_scale(a)
    if mode == 1:
        assert tensor_scale is not None
        s = tensor_scale.reshape(1)
    elif mode == 4:
        s = torch.empty(T, K // NVFP4_BLOCK, dtype=FP8_DTYPE, device=dev)
    else:
        s = torch.empty(T, triton.cdiv(K, CHUNK) if mode == 3 else 1, dtype=torch.float32, device=dev)
    if launch:
        rows, chunk, whole = token_tile(T, K) if mode == 2 else (ROWS, CHUNK, False)
        grid = (triton.cdiv(T, rows), 1 if mode == 2 else triton.cdiv(K, chunk))
        _quantize_rows_kernel[grid](x, q, s, s if g is None else g, T, K, x.stride(0), q.stride(0),
                                    s.stride(0) if mode != 1 else 0, MODE=mode, ROWS=rows, CHUNK=chunk,
                                    AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=FP8_MAX, WHOLE=whole,
                                    num_warps=8 if whole else 4)
    if mode == 1:
        return QuantizedActivations(scheme, q, None, tensor_scale)
    return QuantizedActivations(scheme, q, s, tensor_scale)

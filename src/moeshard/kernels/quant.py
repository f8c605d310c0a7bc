"""Quantization of the intermediate h [P, I] between the two GEMMs, bit for bit as
``moeshard.quant.quantize_activations`` does it (``tests/test_kernels.py`` checks equality).

h sits at the padded positions of the tile plan (``align``). The grid is (P / ROWS row blocks) x
(column spans): a program quantizes ROWS positions x ``span`` columns, CHUNK columns per step,
takes its expert from ``tile_expert`` and skips tiles past the end, and row blocks past its
expert's last row: padding only, which no GEMM stores a result of (an expert of 32 rows in a
64-row decode tile leaves two of its four row blocks). Modes are the schemes'
``kernel_mode`` (``moeshard.quant.schemes.KERNEL_MODES``):

=========  =========================================================================
scheme     scales
=========  =========================================================================
fp8_tensor per expert: ``amax[e] / 448`` (amax max-reduced by the gate_up GEMM)
fp8_token  per row: ``amax(|h[p, :]|) / 448`` (the row max given, or over all spans first)
fp8_block  per row and 128 columns: ``amax(|h[p, g*128:(g+1)*128]|) / 448``
nvfp4      global ``2688 / amax[e]`` per expert; e4m3 block scale per 16 values
=========  =========================================================================

Every scale but fp8_token's depends on its own 128 (or 16) columns or on the expert alone, so
the spans of a row are independent. fp8_token's row max spans the whole row. The gate_up GEMM
can max-reduce it as it stores h (``moe_gemm(row_amax=...)``); given that, one pass quantizes.
Else, with more than one span, a first kernel writes each span's max into a [P, spans] buffer and
the quantizing kernel reduces that row of partial maxima (max is exact in any order, so the scale
is bit for bit the whole row's); with one span, one kernel makes both passes over its row.

Divisions use ``div_rn`` (correctly rounded), as torch's CUDA kernels do; Triton's default fp32
division is approximate and would move values across rounding boundaries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.kernels import pdl
from moeshard.kernels.align import RowAlignment
from moeshard.kernels.configs import QUANT_ROWS, SPAN_UNIT, column_span
from moeshard.kernels.modes import kernel_mode
from moeshard.quant import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, NVFP4_BLOCK, QuantizedActivations

ROWS = QUANT_ROWS  # positions per program; BLOCK_M is a multiple, so a program's rows share one tile
CHUNK = SPAN_UNIT  # columns per step: one fp8_block scale group, eight nvfp4 blocks
# fp8_token partial row maxima read per step: all of them up to 16384 columns at CHUNK-wide spans.
PART_BLOCK = 128


@triton.jit
def _fp8(x, scale, FP8_MAX: tl.constexpr):
    return tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _fp8_group(x, AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr):
    """x fp32 [R, 128] (one fp8_block scale group per row) -> (e4m3 [R, 128] values, fp32 [R]
    scales ``max(amax, AMAX_FLOOR) / 448``), as ``moeshard.quant`` quantizes a 1 x 128 block."""
    block_max = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    scale = tl.math.div_rn(block_max, tl.zeros_like(block_max) + FP8_MAX)
    return _fp8(x, scale[:, None], FP8_MAX), scale


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
def _nvfp4_chunk(x, g, ROWS: tl.constexpr, CHUNK: tl.constexpr, FP8_MAX: tl.constexpr):
    """x fp32 [ROWS, CHUNK] (CHUNK / 16 whole nvfp4 blocks per row), g the fp32 global scale
    (a scalar) -> (packed uint8 [ROWS, CHUNK / 2] e2m1 codes, column 2i in the low
    nibble; e4m3 [ROWS, CHUNK / 16] block scales), as ``moeshard.quant.nvfp4.nvfp4_quantize``:
    s = e4m3(min(block amax / 6 * g, 448)), codes e2m1(x * g / s), 0 where s rounds to 0."""
    blocks = tl.reshape(x, (ROWS, CHUNK // 16, 16))
    block_amax = tl.max(tl.abs(blocks), axis=2)
    s = tl.minimum(tl.math.div_rn(block_amax, tl.zeros_like(block_amax) + 6.0) * g, FP8_MAX).to(tl.float8e4nv)
    s32 = s.to(tl.float32)
    zero = s32 == 0.0
    y = tl.math.div_rn(blocks * g, tl.where(zero, 1.0, s32)[:, :, None])
    y = tl.where(zero[:, :, None], 0.0, y)
    code = tl.reshape(_e2m1_code(y), (ROWS, CHUNK // 2, 2))
    lo_code, hi_code = tl.split(code)
    return lo_code | (hi_code << 4), s


@triton.jit
def _abs_max(h_rows, lo, hi, K, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """fp32 [ROWS]: max |h| over columns [lo, hi) of the rows at h_rows (pointers [ROWS, 1])."""
    cols = tl.arange(0, CHUNK)
    row_max = tl.zeros([ROWS], dtype=tl.float32)
    for k0 in range(lo, hi, CHUNK):
        ok = (k0 + cols) < K
        x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
        row_max = tl.maximum(row_max, tl.max(tl.abs(x), axis=1))
    return row_max


@triton.jit
def _row_block_expert(pid, tile_expert_ptr, start_ptr, count_ptr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                      DIRECT: tl.constexpr):
    """The expert of row block ``pid`` (positions [pid * ROWS, +ROWS)), or -1 where the block holds
    none of its rows: a tile past the end, or positions past the expert's last row (DIRECT, a
    direct plan: past the tile's first position, its one row)."""
    expert = tl.load(tile_expert_ptr + (pid * ROWS) // BLOCK_M).to(tl.int32)  # a direct plan's ids: int64
    if expert >= 0:
        if DIRECT:
            if (pid * ROWS) % BLOCK_M != 0:
                expert = -1
        elif pid * ROWS - tl.load(start_ptr + expert) >= tl.load(count_ptr + expert):
            expert = -1
    return expert


@triton.jit
def _row_max_kernel(h_ptr, part_ptr, tile_expert_ptr, start_ptr, count_ptr, K, span, num_spans, stride_hm,
                    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
                    DIRECT: tl.constexpr):
    """part[p, j] (fp32 [P, num_spans]) = max |h[p, j*span:(j+1)*span]|, for the row blocks that
    hold rows of their expert (``_row_block_expert``; the others are left unwritten)."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    expert = _row_block_expert(pid, tile_expert_ptr, start_ptr, count_ptr, ROWS, BLOCK_M, DIRECT)
    if expert < 0:
        return
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    lo = pid_k * span
    row_max = _abs_max(h_ptr + rows[:, None] * stride_hm, lo, tl.minimum(lo + span, K), K, ROWS, CHUNK)
    tl.store(part_ptr + rows * num_spans + pid_k, row_max)


@triton.jit
def _quantize_h_kernel(h_ptr, q_ptr, s_ptr, g_ptr, amax_ptr, part_ptr, tile_expert_ptr, start_ptr, count_ptr,
                       K, span, num_spans, stride_hm, stride_qm, stride_sm,
                       MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                       ROW_MAX: tl.constexpr, PART_BLOCK: tl.constexpr,
                       AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr, DIRECT: tl.constexpr):
    """Program (i, j) quantizes rows [i*ROWS, (i+1)*ROWS) x columns [j*span, (j+1)*span) (span a
    multiple of CHUNK, so no 128- or 16-column scale group straddles two programs); program
    (i, 0) writes the rows' per-row scales. fp8_token's row max (ROW_MAX): 0, this program's own
    pass over its columns, which are then the whole row; 1, the reduction of part [P, num_spans],
    PART_BLOCK partial maxima per step; 2, part [P] itself (the gate_up GEMM's row maxima). Row
    blocks without a row of their expert (``_row_block_expert``) are left unwritten."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    expert = _row_block_expert(pid, tile_expert_ptr, start_ptr, count_ptr, ROWS, BLOCK_M, DIRECT)
    if expert < 0:
        return
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    h_rows = h_ptr + rows[:, None] * stride_hm
    lo = pid_k * span
    hi = tl.minimum(lo + span, K)
    if MODE == 1 or MODE == 4:
        amax = tl.maximum(tl.load(amax_ptr + expert), AMAX_FLOOR)
    if MODE == 1:
        scale = tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX)
        if pid_k == 0:
            tl.store(s_ptr + rows * stride_sm, tl.zeros([ROWS], dtype=tl.float32) + scale)
        for k0 in range(lo, hi, CHUNK):
            ok = (k0 + cols) < K
            x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            tl.store(q_ptr + rows[:, None] * stride_qm + k0 + cols[None, :], _fp8(x, scale, FP8_MAX), mask=ok[None, :])
    elif MODE == 2:
        if ROW_MAX == 2:
            row_max = tl.load(part_ptr + rows)
        elif ROW_MAX == 1:
            row_max = tl.zeros([ROWS], dtype=tl.float32)
            for j0 in range(0, num_spans, PART_BLOCK):
                j = j0 + tl.arange(0, PART_BLOCK)
                part = tl.load(part_ptr + rows[:, None] * num_spans + j[None, :], mask=(j < num_spans)[None, :],
                               other=0.0)
                row_max = tl.maximum(row_max, tl.max(part, axis=1))
        else:
            row_max = _abs_max(h_rows, lo, hi, K, ROWS, CHUNK)
        scale = tl.math.div_rn(tl.maximum(row_max, AMAX_FLOOR), tl.zeros_like(row_max) + FP8_MAX)
        if pid_k == 0:
            tl.store(s_ptr + rows * stride_sm, scale)
        for k0 in range(lo, hi, CHUNK):
            ok = (k0 + cols) < K
            x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            tl.store(q_ptr + rows[:, None] * stride_qm + k0 + cols[None, :], _fp8(x, scale[:, None], FP8_MAX),
                     mask=ok[None, :])
    elif MODE == 3:
        for k0 in range(lo, hi, CHUNK):
            ok = (k0 + cols) < K
            x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            q, scale = _fp8_group(x, AMAX_FLOOR, FP8_MAX)
            tl.store(s_ptr + rows * stride_sm + k0 // CHUNK, scale)
            tl.store(q_ptr + rows[:, None] * stride_qm + k0 + cols[None, :], q, mask=ok[None, :])
    else:
        g = tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX * 6.0, amax)
        if pid_k == 0:
            tl.store(g_ptr + rows, tl.zeros([ROWS], dtype=tl.float32) + g)
        bcols = tl.arange(0, CHUNK // 16)
        pcols = tl.arange(0, CHUNK // 2)
        for k0 in range(lo, hi, CHUNK):
            ok = (k0 + cols) < K
            x = tl.load(h_rows + k0 + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            packed, s = _nvfp4_chunk(x, g, ROWS, CHUNK, FP8_MAX)
            s_ok = (k0 // 16 + bcols) < K // 16
            tl.store(s_ptr + rows[:, None] * stride_sm + k0 // 16 + bcols[None, :], s, mask=s_ok[None, :])
            p_ok = (k0 // 2 + pcols) < K // 2
            tl.store(q_ptr + rows[:, None] * stride_qm + k0 // 2 + pcols[None, :], packed, mask=p_ok[None, :])


def quantized_positions(plan: RowAlignment) -> torch.Tensor:
    """bool [P] on the plan's device: the padded positions ``quantize_h`` writes, the blocks of
    ``ROWS`` positions in live tiles that begin before their expert's last row (for comparing its
    outputs; a few torch ops)."""
    tile_of = plan.tile_expert.repeat_interleave(plan.block_m).long()
    expert = tile_of.clamp(min=0)
    block_start = torch.arange(tile_of.shape[0], device=tile_of.device) // ROWS * ROWS
    if plan.direct:  # each tile's first block: its one row
        return (tile_of >= 0) & (block_start % plan.block_m == 0)
    return (tile_of >= 0) & (block_start - plan.start.long()[expert] < plan.count.long()[expert])


def quantize_h(h: torch.Tensor, scheme: str, plan: RowAlignment, amax: torch.Tensor | None,
               span: int | None = None, pdl_launch: bool = False,
               row_amax: torch.Tensor | None = None) -> QuantizedActivations:
    """h: [P, I] model dtype at the plan's padded positions -> ``QuantizedActivations`` [P, I].

    amax: fp32 [E] per-expert amax of h (fp8_tensor, nvfp4), else None. The per-tensor scales
    come back per row (``tensor_scale`` [P, 1]), each row carrying its expert's scale. Rows of
    tiles past the end of the plan, and blocks of ``ROWS`` positions past their expert's last
    row, are left unwritten: no GEMM stores a result computed from them (the down GEMM reads
    whole tiles but masks their rows' scales and stores).
    span: columns per program, a multiple of CHUNK (128); None picks it from P and I
    (``column_span``). Results do not depend on it. row_amax: fp8_token only, fp32 [P], max |h|
    of each row (the gate_up GEMM's ``row_amax``), read at the positions quantized instead of a
    pass over h. One launch, two for fp8_token without row_amax when a row spans several
    programs. pdl_launch: launched with programmatic dependent launch
    (``moeshard.kernels.pdl``; the caller checks ``pdl.supported``).
    """
    P, K = h.shape
    mode = kernel_mode(scheme)
    if P % ROWS or plan.block_m % ROWS:
        raise ValueError(f"quantize_h: padded rows {P} and block_m {plan.block_m} must be multiples of {ROWS}")
    if mode in (1, 4) and amax is None:
        raise ValueError(f"quantize_h: {scheme} needs the per-expert amax")
    if row_amax is not None and (mode != 2 or row_amax.dtype != torch.float32 or tuple(row_amax.shape) != (P,)
                                 or row_amax.stride(0) != 1):
        raise ValueError(f"quantize_h: row_amax is fp8_token's contiguous float32 [P={P}] row maxima; got "
                         f"{row_amax.dtype} {list(row_amax.shape)} with strides {row_amax.stride()} for {scheme}")
    if span is not None and (span <= 0 or span % CHUNK):
        raise ValueError(f"quantize_h: span must be a positive multiple of {CHUNK}, got {span}")
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
    if P:  # no launch for an empty grid
        span = span or column_span(P, K)
        num_spans = triton.cdiv(K, span)
        grid = (P // ROWS, num_spans)
        partial = mode == 2 and num_spans > 1 and row_amax is None
        part = torch.empty(P, num_spans, dtype=torch.float32, device=dev) if partial else \
            row_amax if row_amax is not None else s
        if partial:
            _row_max_kernel[grid](h, part, plan.tile_expert, plan.start, plan.count, K, span, num_spans, h.stride(0),
                                  ROWS=ROWS, BLOCK_M=plan.block_m, CHUNK=CHUNK, PDL=pdl_launch, DIRECT=plan.direct,
                                  num_warps=4, **pdl.launch_options(pdl_launch))
        _quantize_h_kernel[grid](
            h, q, s, g, amax if amax is not None else s, part, plan.tile_expert, plan.start, plan.count,
            K, span, num_spans, h.stride(0), q.stride(0), s.stride(0),
            MODE=mode, ROWS=ROWS, BLOCK_M=plan.block_m, CHUNK=CHUNK, ROW_MAX=2 if row_amax is not None else int(partial),
            PART_BLOCK=PART_BLOCK, AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=FP8_MAX, PDL=pdl_launch, DIRECT=plan.direct,
            num_warps=4, **pdl.launch_options(pdl_launch))
    if mode == 1:
        return QuantizedActivations(scheme, q, None, s)
    if mode == 4:
        return QuantizedActivations(scheme, q, s, g)
    return QuantizedActivations(scheme, q, s, None)

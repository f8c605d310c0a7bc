"""The experts' input laid out at the tile plan's padded positions, for a gate_up GEMM without gather.

    x [M / repeat, K] (model dtype, or quantized: data and every per-row scale) + tile plan
        --one copy per position--> A [P, K]: position p holds row sorted_rows[p] // repeat of x,
                                   zeros where p is padding (or past the last tile)

The gate_up GEMM normally gathers each tile's rows through the plan with per-thread loads:
Hopper's tensor memory accelerator (TMA) loads whole blocks but cannot gather rows. With A laid
out first, each tile's rows are one contiguous block that TMA loads. That costs one pass over
P x K bytes and pays where experts hold many rows (each A tile is then read by every column
block of its tile row; ``configs.select_config`` says where it was measured to pay). The values
are copied, never converted, so the GEMM computes the same bits either way; padding rows are
zeros, as the gathered path loads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.kernels.align import RowAlignment
from moeshard.kernels.nvfp4_values import Nvfp4Values
from moeshard.quant import QuantizedActivations

ROWS = 16  # positions per program
COLUMN_BYTES = 1024  # bytes of a row per program (a multiple of 16: whole vector loads)


@triton.jit(do_not_specialize=["repeat"])
def _lay_out_kernel(src_ptr, dst_ptr, sorted_rows_ptr, tile_expert_ptr, start_ptr, count_ptr,
                    repeat, cols, stride_src, stride_dst,
                    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """dst[p, c] = src[sorted_rows[p] // repeat, c] for positions p holding a routed row, 0 at
    every other position; one ROWS x COLS block per program."""
    offs_p = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    col_ok = offs_c < cols
    expert = tl.load(tile_expert_ptr + offs_p // BLOCK_M)
    placed = expert >= 0
    e = tl.where(placed, expert, 0)
    routed = placed & (offs_p - tl.load(start_ptr + e) < tl.load(count_ptr + e))
    # Routed row m is token m // repeat (divided in int32: sorted_rows is int32).
    src_rows = (tl.load(sorted_rows_ptr + offs_p, mask=routed, other=0) // repeat).to(tl.int64)
    values = tl.load(src_ptr + src_rows[:, None] * stride_src + offs_c[None, :],
                     mask=routed[:, None] & col_ok[None, :], other=0)
    tl.store(dst_ptr + offs_p.to(tl.int64)[:, None] * stride_dst + offs_c[None, :], values, mask=col_ok[None, :])


def _lay_out_tensor(t: torch.Tensor, plan: RowAlignment, repeat: int) -> torch.Tensor:
    """t: [M / repeat, C], unit column stride -> [P, C] of t's dtype at the padded positions."""
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"lay_out_rows: expected a 2-D tensor with unit column stride, got shape "
                         f"{list(t.shape)} strides {list(t.stride())}")
    out = torch.empty(plan.padded_rows, t.shape[1], dtype=t.dtype, device=t.device)
    # float8 pointers load and store as bytes: the copy never converts.
    src, dst = (t.view(torch.uint8), out.view(torch.uint8)) if t.element_size() == 1 else (t, out)
    cols = triton.next_power_of_2(max(1, COLUMN_BYTES // t.element_size()))
    grid = (plan.padded_rows // ROWS, triton.cdiv(t.shape[1], cols))
    _lay_out_kernel[grid](src, dst, plan.sorted_rows, plan.tile_expert, plan.start, plan.count,
                          repeat, t.shape[1], src.stride(0), dst.stride(0),
                          BLOCK_M=plan.block_m, ROWS=ROWS, COLS=cols)
    return out


def lay_out_rows(x: torch.Tensor | QuantizedActivations | Nvfp4Values, plan: RowAlignment,
                 repeat: int = 1) -> torch.Tensor | QuantizedActivations | Nvfp4Values:
    """x laid out at the plan's P padded positions, as the gate_up GEMM reads it without gather.

    x: [M / repeat, K] in the model dtype, or ``QuantizedActivations`` whose data and per-row
       scales (``row_scale``; a ``tensor_scale`` of one value per row) have M / repeat rows, or
       decoded nvfp4 ``Nvfp4Values`` (values, and a global scale per row); a single
       ``tensor_scale`` (global scale) is shared by every row and kept as it is.
    plan: the tile plan (``align.align_rows``) of the M routed rows; P = ``plan.padded_rows``, a
       multiple of ``ROWS``.
    repeat: ``ExpertInput.repeat``: routed row m is row m // repeat of x.
    Returns [P, K] (and [P, ...] scales): zeros (zero scales) at padding positions.
    """
    if plan.direct:
        raise ValueError("lay_out_rows: the plan is direct (``align.direct_rows``), which holds no sorted rows to "
                         "lay the input out by; lay out by ``align.align_rows``' plan")
    rows = x.shape[0]
    if rows * repeat != plan.num_rows:
        raise ValueError(f"lay_out_rows: x has {rows} rows and repeat={repeat}, the plan has "
                         f"{plan.num_rows} routed rows (rows * repeat must equal them)")
    if plan.padded_rows % ROWS:
        raise ValueError(f"lay_out_rows: the plan's {plan.padded_rows} padded rows are not a multiple of {ROWS}")
    if isinstance(x, Nvfp4Values):
        g = x.global_scale
        return Nvfp4Values(_lay_out_tensor(x.values, plan, repeat), _lay_out_tensor(g, plan, repeat) if g.dim() == 2 else g)
    if not isinstance(x, QuantizedActivations):
        return _lay_out_tensor(x, plan, repeat)
    row_scale = None if x.row_scale is None else _lay_out_tensor(x.row_scale, plan, repeat)
    tensor_scale = x.tensor_scale
    if tensor_scale is not None and tensor_scale.dim() == 2:  # one scale per row: it moves with its row
        tensor_scale = _lay_out_tensor(tensor_scale, plan, repeat)
    return QuantizedActivations(x.scheme, _lay_out_tensor(x.data, plan, repeat), row_scale, tensor_scale)

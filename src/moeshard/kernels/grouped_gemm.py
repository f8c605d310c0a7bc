"""The grouped expert GEMM: ``out[rows of tile] = A[rows] @ W[expert of tile].T`` per row tile.

Legend: M routed rows, P padded positions (see ``align``), E experts, N output columns,
K reduction; A is [M / a_row_div or P, K], W is [E, N_w, K] (N_w = 2N for the fused gate_up, else N).

One kernel serves both projections and every scheme (constexpr branches, one compiled variant
each):

* gate_up (``FUSE_ACT``): A rows are gathered through ``sorted_rows``: position p reads A row
  ``sorted_rows[p] // a_row_div`` and its scales (a_row_div = ``ExpertInput.repeat``: the local
  backend passes each token once for its K routed rows, so no [M, K] copy is made); the program keeps two
  accumulators, gate columns [n, n + BN) and up columns [N + n, N + n + BN) of W, and writes
  h = act(gate) * up at the padded positions, each factor rounded to the model dtype first as
  the reference does. With ``TRACK_AMAX`` 1 it also max-reduces |h| of the tile's real rows into
  the expert's amax (per-tensor activation scales of the down projection); with 2, |h| of each
  real row into that position's amax (fp8_token's row scales, so that ``quantize_h`` need not
  read h twice).
* down (``SCATTER_OUT``): A is h at the padded positions; results go straight to the original
  routed row order, row ``sorted_rows[p]`` of the [M, N] output (no separate unpermute pass).
  On a direct plan (one tile per routed row) only each tile's row 0 is read, and with
  ``QUANT_A`` that row is read as model-dtype h and quantized as it is loaded.

Schemes (``QUANT`` is the scheme's ``kernel_mode``, ``moeshard.quant.schemes.KERNEL_MODES``):

=====  ===========  ==============================================================
QUANT  scheme       arithmetic
=====  ===========  ==============================================================
0      none         bf16/fp16 dot, fp32 accumulation
1, 2   fp8 tensor / e4m3 dot; each BLOCK_K step accumulates into a fresh fp32 tile
       fp8 token    (Hopper's fp8 MMA keeps fewer accumulator bits), then
                    acc * a_scale[row] * w_scale[e, n] (per-tensor scales are strided 0)
3      fp8 block    e4m3 dot per 128-column step, acc += dot * a_scale[row, kb] *
                    w_scale[e, n // 128, kb]
1-3    ``FP8_EXACT`` the same with both operands widened to fp16 (exact) first: fp32-accurate
                    sums, at the fp16 tensor-core rate (``TritonExperts(fp8_gate_up="exact")``).
                    Without it the ~14-bit fp8 accumulation moves some gate_up sums across
                    rounding boundaries of h; the reference prices exactly those flips from the
                    accumulation error the kernel declares (``ACCUMULATION["fp8_mma"]``).
4      nvfp4        e2m1 codes and e4m3 block scales dequantized in registers to
                    fp16 (value * block scale is exact in fp16), fp16 dot, then
                    acc / (a_global[row] * w_global[e])
=====  ===========  ==============================================================
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.activations import FIRST_UNGATED_MODE, get_activation
from moeshard.kernels import pdl
from moeshard.kernels.align import RowAlignment
from moeshard.kernels.configs import FP8_ACCUMULATIONS, GemmConfig
from moeshard.kernels.modes import act_constants, act_mode, amax_mode, kernel_mode, one_w_scale_per_tile, scale_strides
from moeshard.kernels.nvfp4_values import Nvfp4Values, e2m1_scaled_f16
from moeshard.kernels.quant import _fp8, _fp8_group
from moeshard.quant import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, QuantizedActivations, QuantizedWeight

FP8_ACC_MODES = {name: i for i, name in enumerate(FP8_ACCUMULATIONS)}  # the kernel's FP8_ACC
# The model dtypes h is rounded to (the kernel's H_TY).
H_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_FIRST_UNGATED = tl.constexpr(FIRST_UNGATED_MODE)
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _gelu_mul(gate, up):
    return 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up


@triton.jit
def _gelu_tanh_mul(gate, up):
    # tanh(z) as 2 sigmoid(2z) - 1: Triton has no tanh of its own, and at |z| large exp's
    # overflow to inf gives exactly -1 (and its underflow +1).
    z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0)) * up


@triton.jit
def _clamp_products(gate, up, LIMIT: tl.constexpr):
    """(min(gate, LIMIT), clamp(up, -LIMIT, LIMIT)); NaN stays NaN, as torch.clamp keeps it."""
    g = tl.minimum(gate, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(up, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                   propagate_nan=tl.PropagateNan.ALL)
    return g, u


@triton.jit
def _swiglu_clamped_mul(gate, up, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    g, u = _clamp_products(gate, up, LIMIT)
    return (u + 1.0) * (g * (1.0 / (1.0 + tl.exp(-(g * ALPHA)))))


@triton.jit
def _silu_clamped_mul(gate, up, LIMIT: tl.constexpr):
    g, u = _clamp_products(gate, up, LIMIT)
    return _silu_mul(g, u)


@triton.jit
def _tanh(z):
    """tanh(z) in fp32 from exp alone (Triton has no tanh of its own): (1 - e) / (1 + e) with
    e = exp(-2|z|), the sign restored; below |z| = 0.25, where 1 - e would cancel (a soft cap
    multiplies by tanh, so its relative error counts), its odd Taylor polynomial to z^11, whose
    truncation is under 1e-9 relative there. tanh(+-inf) = +-1, NaN stays NaN."""
    a = tl.abs(z)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    z2 = a * a
    near = a * (1.0 + z2 * (-0.3333333333333333 + z2 * (0.13333333333333333 + z2 * (
        -0.05396825396825397 + z2 * (0.021869488536155203 + z2 * -0.008863235529902197)))))
    t = tl.where(a < 0.25, near, far)
    return tl.where(z < 0.0, -t, t)


@triton.jit
def _swiglu_softcapped_mul(gate, up, GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr):
    # Inkling 2: the sigmoid sees the raw gate; the caps bound the two linear factors.
    capped_gate = GATE_CAP * _tanh(gate / GATE_CAP)
    return capped_gate * (1.0 / (1.0 + tl.exp(-gate))) * (UP_CAP * _tanh(up / UP_CAP))


@triton.jit
def _act_mul(gate, up, ACT: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr):
    """h = act(gate, up) in fp32 for the activation's kernel mode, with its parameters P0, P1 in
    ``activations.KERNEL_PARAMS`` order: 0 silu, 1 exact-erf gelu, 2 tanh-approximate gelu, 3
    gpt-oss's clamped SwiGLU (alpha, limit), 4 SwiGLU on clamped products (limit), 5 Inkling 2's
    soft-capped SwiGLU (gate_cap, up_cap)."""
    if ACT == 0:
        h = _silu_mul(gate, up)
    elif ACT == 1:
        h = _gelu_mul(gate, up)
    elif ACT == 2:
        h = _gelu_tanh_mul(gate, up)
    elif ACT == 3:
        h = _swiglu_clamped_mul(gate, up, P0, P1)
    elif ACT == 4:
        h = _silu_clamped_mul(gate, up, P0)
    else:
        tl.static_assert(ACT == 5, "an activation mode the epilogue does not compute")
        h = _swiglu_softcapped_mul(gate, up, P0, P1)
    return h


@triton.jit
def _act_one(up, ACT: tl.constexpr):
    """h = act(up) in fp32 for an ungated kind's mode (``activations.UNGATED_KERNEL_MODES``):
    32 relu(up)^2 (NaN stays NaN, as torch.relu keeps it)."""
    tl.static_assert(ACT == 32, "an ungated activation mode the epilogue does not compute")
    r = tl.maximum(up, 0.0, propagate_nan=tl.PropagateNan.ALL)
    return r * r


@triton.jit
def _load_tile(ptr, ptrs, row, col, rows_ok, cols_ok, TMA: tl.constexpr, MASK_ROWS: tl.constexpr,
               EVEN_K: tl.constexpr, ZERO: tl.constexpr):
    """One [R, C] operand tile: through a TMA descriptor at (row, col) (out-of-bounds parts read
    as zeros), or through ``ptrs`` with the row / column masks the shapes need (masked lanes
    read ``ZERO``, 0.0 for float tiles and 0 for packed nvfp4 bytes)."""
    if TMA:
        return ptr.load([row, col])
    elif MASK_ROWS and EVEN_K:
        return tl.load(ptrs, mask=rows_ok[:, None], other=ZERO)
    elif MASK_ROWS:
        return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=ZERO)
    elif EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=cols_ok[None, :], other=ZERO)


@triton.jit
def _block_w_scale(ws_base, cols, first_col, stride_wsn, SCALAR: tl.constexpr):
    """fp8_block weight scales of one K step for a tile's weight rows ``cols`` [BLOCK_N]: one
    scalar, that of ``first_col``'s 128-row block, when the whole tile lies in it (``moe_gemm``'s
    ws_scalar), else a [1, BLOCK_N] row of each column's block scale."""
    if SCALAR:
        return tl.load(ws_base + (first_col // 128) * stride_wsn)
    else:
        return tl.load(ws_base + (cols // 128) * stride_wsn)[None, :]


@triton.jit
def _block_a_scale(a_scale_ptr, rows, kb, stride_asm, stride_ask, row_ok, row_scale, QUANT_A: tl.constexpr):
    """fp8_block's A scales [BLOCK_M] of 128-column group kb: loaded, or (QUANT_A) the one row's
    ``row_scale`` just computed; 0 for rows of padding, whose products are never stored."""
    if QUANT_A:
        return tl.where(row_ok, row_scale, 0.0)
    else:
        return tl.load(a_scale_ptr + rows * stride_asm + kb * stride_ask, mask=row_ok, other=0.0)


@triton.jit
def _direct_row_fp8(a_ptr, p0, ka, offs_ka, ka_ok, stride_am, stride_ak, scale, QUANT: tl.constexpr,
                    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, SUB_K: tl.constexpr):
    """A direct tile's A operand from model-dtype h (``moe_gemm(quantize_a=True)``): columns
    [ka, ka + SUB_K) of the tile's one row (position p0), quantized as ``quant.quantize_h``
    quantizes them, as row 0 of an e4m3 [BLOCK_M, SUB_K] tile whose other rows are zeros; and
    that row's scale: ``scale`` (fp8_tensor's per-expert, fp8_token's per-row), or for fp8_block
    (QUANT 3, SUB_K = 128: one scale group) the group's own. Only the one row is read and divided:
    the tile's padding rows would cost 15 of every 16 correctly rounded divisions."""
    ptrs = a_ptr + p0 * stride_am + (ka + offs_ka) * stride_ak
    if EVEN_K:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=ka_ok, other=0.0).to(tl.float32)
    if QUANT == 3:
        q, group_scale = _fp8_group(x[None, :], _AMAX_FLOOR, _FP8_MAX)
        row_scale = tl.max(group_scale, axis=0)  # the one row's
    else:
        q = _fp8(x, scale, _FP8_MAX)[None, :]
        row_scale = scale
    first = (tl.arange(0, BLOCK_M) == 0)[:, None]
    bits = tl.where(first, q.to(tl.uint8, bitcast=True), tl.zeros((BLOCK_M, SUB_K), dtype=tl.uint8))
    return bits.to(tl.float8e4nv, bitcast=True), row_scale


@triton.jit
def _direct_row_fp8_groups(a_ptr, p0, k_step, stride_am, stride_ak, BLOCK_M: tl.constexpr, SUB_K: tl.constexpr):
    """``_direct_row_fp8`` for fp8_block over a 256-column K step at once: the row's two 128-column
    scale groups loaded in one load (two elements a thread, a load the pipeline stages, where one
    group's is a 2-byte load it waits on) and quantized each by its own amax; returns (tile, scale)
    of the first group, then of the second. K is a multiple of the step (``moe_gemm``)."""
    x = tl.load(a_ptr + p0 * stride_am + (k_step + tl.arange(0, 2 * SUB_K)) * stride_ak).to(tl.float32)
    q, scales = _fp8_group(tl.reshape(x, (2, SUB_K)), _AMAX_FLOOR, _FP8_MAX)
    q_lo, q_hi = tl.split(tl.permute(q.to(tl.uint8, bitcast=True), (1, 0)))
    s_lo, s_hi = tl.split(scales)
    first = (tl.arange(0, BLOCK_M) == 0)[:, None]
    zeros = tl.zeros((BLOCK_M, SUB_K), dtype=tl.uint8)
    lo = tl.where(first, q_lo[None, :], zeros).to(tl.float8e4nv, bitcast=True)
    hi = tl.where(first, q_hi[None, :], zeros).to(tl.float8e4nv, bitcast=True)
    return lo, s_lo, hi, s_hi


@triton.jit
def _tile(a_ptr, a_scale_ptr, a_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, out_scale_ptr, amax_ptr,
          bias_ptr, sorted_rows_ptr, p0, expert, w_expert, first, count, direct_row, pid_n, N, K, N_w, up_offset,
          a_row_div, stride_am, stride_ak, stride_asm, stride_ask, stride_ag,
          stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
          stride_om, stride_on, stride_osm, stride_be,
          QUANT: tl.constexpr, FUSE_ACT: tl.constexpr, ACT: tl.constexpr, ACT_P0: tl.constexpr,
          ACT_P1: tl.constexpr, BIAS: tl.constexpr, QUANT_OUT: tl.constexpr, QUANT_A: tl.constexpr,
          H_TY: tl.constexpr,
          GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, TRACK_AMAX: tl.constexpr,
          EVEN_K: tl.constexpr, TMA_A: tl.constexpr, TMA_W: tl.constexpr, FP8_EXACT: tl.constexpr,
          FP8_ACC: tl.constexpr, WS_SCALAR: tl.constexpr, A_VALUES: tl.constexpr, W_VALUES: tl.constexpr,
          DIRECT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          SUB_K: tl.constexpr):
    """Computes and stores the BLOCK_M x BLOCK_N output tile whose rows are the padded positions
    [p0, p0 + BLOCK_M) of ``expert`` (its rows: [first, first + count)) and whose columns start
    at pid_n * BLOCK_N; ``w_expert`` is that expert's index in the weights given (``moe_gemm``'s
    expert window). DIRECT: a direct plan's tile, whose one row (count 1) is routed row
    ``direct_row``. Each K step of BLOCK_K columns loads and multiplies SUB_K columns at a time
    (``k_sub_step``). ``a_ptr`` is a TMA descriptor of [BLOCK_M, SUB_K / pack] blocks when TMA_A,
    ``w_ptr`` one of [BLOCK_N, SUB_K / pack] blocks when TMA_W (pack: 2 for nvfp4 codes, 1 for an
    operand given as decoded values, A_VALUES / W_VALUES). The gate_up product and h are
    rounded to H_TY, the model dtype; with QUANT_OUT (gate_up, BLOCK_N = 128) h is stored as
    fp8_block values at ``out_ptr`` and their row scales at column pid_n of ``out_scale_ptr``.
    QUANT_A (down, DIRECT): A is h in the model dtype, its one row quantized as it is loaded
    (``_direct_row_fp8``), bit for bit as ``quant.quantize_h`` would quantize it, with the scale
    from ``a_scale_ptr``: fp8_tensor's amax [E] (row ``expert``), fp8_token's row maxima [P]
    (position p0), or none for fp8_block (each 128-column group's own).
    BIAS: ``bias_ptr`` is the experts' bias [E, N_w] (row ``expert``, stride ``stride_be``; of
    the plan's experts, not the window's), added in fp32 to the product rounded to the model
    dtype and rounded again: before the activation (gate_up: gate columns, then up columns
    ``up_offset`` on) or to the output (down)."""
    # A gated kind's gate_up loads and multiplies an up tile beside the gate tile; an ungated
    # kind's (modes from activations.FIRST_UNGATED_MODE on) has its one product in acc.
    UP: tl.constexpr = FUSE_ACT and ACT < _FIRST_UNGATED
    # A direct tile's padding rows are not read: its one row is row 0, and the GEMM's A at padded
    # positions holds zeros below it (the down GEMM would read 16 times the bytes of its one row).
    MASK_A_ROWS: tl.constexpr = GATHER_A or DIRECT
    offs_p = p0 + tl.arange(0, BLOCK_M)
    row_ok = offs_p - first < count
    if GATHER_A or SCATTER_OUT:
        if DIRECT:  # the tile's one row is routed row direct_row; no plan holds it
            orig_rows32 = tl.zeros([BLOCK_M], dtype=tl.int32) + direct_row
        else:
            orig_rows32 = tl.load(sorted_rows_ptr + offs_p, mask=row_ok, other=0)
        orig_rows = orig_rows32.to(tl.int64)
    # rows: where this tile's A rows (and their scales) live. Routed row m of a gathered A is
    # row m // a_row_div (divided in int32: sorted_rows is int32, and 64-bit division is slow).
    if GATHER_A:
        rows = (orig_rows32 // a_row_div).to(tl.int64)
    else:
        rows = offs_p.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # Out-of-range columns read row 0 of the expert instead of masking every load; their
    # results are never stored.
    offs_wn = tl.where(n_ok, offs_n, 0).to(tl.int64)

    # nvfp4 stores two values per byte along K: a stored tile of codes is BLOCK_K // 2 wide. An
    # operand decoded beforehand (``nvfp4_values``) is fp16 values, one per column.
    A_PACK: tl.constexpr = 2 if QUANT == 4 and not A_VALUES else 1
    W_PACK: tl.constexpr = 2 if QUANT == 4 and not W_VALUES else 1
    A_ZERO: tl.constexpr = 0 if A_PACK == 2 else 0.0
    W_ZERO: tl.constexpr = 0 if W_PACK == 2 else 0.0
    tl.static_assert(BLOCK_K % SUB_K == 0, "SUB_K divides BLOCK_K (k_sub_step)")
    offs_ka = tl.arange(0, SUB_K // A_PACK)
    offs_kw = tl.arange(0, SUB_K // W_PACK)
    # With TMA the descriptor addresses the tile itself; 0 stands in for the unused pointers.
    if TMA_A:
        a_ptrs = 0
    else:
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_ka[None, :] * stride_ak
    if TMA_W:
        w_ptrs = 0
    else:
        w_ptrs = w_ptr + w_expert * stride_we + offs_wn[:, None] * stride_wn + offs_kw[None, :] * stride_wk
    w_row = w_expert.to(tl.int32) * N_w + pid_n * BLOCK_N
    a_row = p0
    if QUANT == 4:
        offs_kq = tl.arange(0, SUB_K // 16)
        as_ptrs = a_scale_ptr + rows[:, None] * stride_asm + offs_kq[None, :] * stride_ask
        ws_ptrs = w_scale_ptr + w_expert * stride_wse + offs_wn[:, None] * stride_wsn + offs_kq[None, :] * stride_wsk

    if QUANT_A:
        tl.static_assert(DIRECT and not GATHER_A and not TMA_A and not FUSE_ACT and QUANT >= 1 and QUANT <= 3,
                         "QUANT_A quantizes the one row of a direct fp8 down tile")
        tl.static_assert(QUANT != 3 or (SUB_K == 128 and BLOCK_K <= 256),
                         "fp8_block's row is quantized one or two 128-column groups at a time")
        if QUANT == 3:
            a_scale_q = 0.0  # each 128-column group's scale is its own (_direct_row_fp8)
        else:
            a_amax = tl.load(a_scale_ptr + (expert if QUANT == 1 else p0))
            a_amax = tl.maximum(a_amax, _AMAX_FLOOR)
            a_scale_q = tl.math.div_rn(a_amax, tl.zeros_like(a_amax) + _FP8_MAX)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if UP:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # fp8_block's row over a 256-column step: both scale groups from one load (_direct_row_fp8_groups)
    ROW_GROUPS: tl.constexpr = QUANT_A and QUANT == 3 and BLOCK_K == 2 * SUB_K
    for k_step in range(0, K, BLOCK_K):
        if ROW_GROUPS:
            a_lo, s_lo, a_hi, s_hi = _direct_row_fp8_groups(a_ptr, p0, k_step, stride_am, stride_ak, BLOCK_M, SUB_K)
        for k_sub in tl.static_range(0, BLOCK_K, SUB_K):
            k0 = k_step + k_sub
            ka = k0 // A_PACK
            kw = k0 // W_PACK
            ka_ok = ka + offs_ka < K // A_PACK
            kw_ok = kw + offs_kw < K // W_PACK
            if ROW_GROUPS:
                if k_sub == 0:
                    a, a_row_scale = a_lo, s_lo
                else:
                    a, a_row_scale = a_hi, s_hi
            elif QUANT_A:
                a, a_row_scale = _direct_row_fp8(a_ptr, p0, ka, offs_ka, ka_ok, stride_am, stride_ak, a_scale_q,
                                                 QUANT, EVEN_K, BLOCK_M, SUB_K)
            else:
                a = _load_tile(a_ptr, a_ptrs + ka * stride_ak, a_row, ka, row_ok, ka_ok, TMA_A, MASK_A_ROWS, EVEN_K,
                               A_ZERO)
                a_row_scale = 0.0  # fp8_block's A scales are loaded (_block_a_scale)
            b = _load_tile(w_ptr, w_ptrs + kw * stride_wk, w_row, kw, n_ok, kw_ok, TMA_W, False, EVEN_K, W_ZERO)
            if UP:
                b_up = _load_tile(w_ptr, w_ptrs + (up_offset * stride_wn + kw * stride_wk), w_row + up_offset, kw,
                                  n_ok, kw_ok, TMA_W, False, EVEN_K, W_ZERO)
            if QUANT == 4:
                # Codes are decoded here to the fp16 values a decoded operand already holds.
                kq = k0 // 16
                kq_ok = kq + offs_kq < K // 16
                if not A_VALUES:
                    a_s = _load_tile(a_scale_ptr, as_ptrs + kq * stride_ask, 0, 0, row_ok, kq_ok, False, True, EVEN_K,
                                     0.0)
                    a = e2m1_scaled_f16(a, a_s, BLOCK_M, SUB_K)
                if not W_VALUES:
                    w_s = _load_tile(w_scale_ptr, ws_ptrs + kq * stride_wsk, 0, 0, n_ok, kq_ok, False, False, EVEN_K, 0.0)
                    b = e2m1_scaled_f16(b, w_s, BLOCK_N, SUB_K)
                acc = tl.dot(a, tl.trans(b), acc)
                if UP:
                    if not W_VALUES:
                        wu_s = _load_tile(w_scale_ptr, ws_ptrs + (up_offset * stride_wsn + kq * stride_wsk), 0, 0, n_ok,
                                          kq_ok, False, False, EVEN_K, 0.0)
                        b_up = e2m1_scaled_f16(b_up, wu_s, BLOCK_N, SUB_K)
                    acc_up = tl.dot(a, tl.trans(b_up), acc_up)
            elif QUANT == 0:
                acc = tl.dot(a, tl.trans(b), acc)
                if UP:
                    acc_up = tl.dot(a, tl.trans(b_up), acc_up)
            elif FP8_EXACT:
                # e4m3 -> fp16 is exact and fp16 MMA accumulates in fp32; Hopper's fp8 MMA keeps about
                # 14 bits while accumulating.
                a = a.to(tl.float16)
                if QUANT != 3:
                    acc = tl.dot(a, tl.trans(b.to(tl.float16)), acc)
                    if UP:
                        acc_up = tl.dot(a, tl.trans(b_up.to(tl.float16)), acc_up)
                else:
                    kb = k0 // 128
                    a_s = _block_a_scale(a_scale_ptr, rows, kb, stride_asm, stride_ask, row_ok, a_row_scale, QUANT_A)
                    ws_base = w_scale_ptr + w_expert * stride_wse + kb * stride_wsk
                    w_s = tl.load(ws_base + (offs_wn // 128) * stride_wsn)
                    acc += tl.dot(a, tl.trans(b.to(tl.float16))) * a_s[:, None] * w_s[None, :]
                    if UP:
                        wu_s = tl.load(ws_base + ((offs_wn + up_offset) // 128) * stride_wsn)
                        acc_up += tl.dot(a, tl.trans(b_up.to(tl.float16))) * a_s[:, None] * wu_s[None, :]
            elif QUANT != 3 and FP8_ACC == 0:
                acc += tl.dot(a, tl.trans(b))
                if UP:
                    acc_up += tl.dot(a, tl.trans(b_up))
            elif QUANT != 3 and FP8_ACC == 1:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=SUB_K)
                if UP:
                    acc_up = tl.dot(a, tl.trans(b_up), acc_up, max_num_imprecise_acc=SUB_K)
            elif QUANT != 3:
                acc = tl.dot(a, tl.trans(b), acc)
                if UP:
                    acc_up = tl.dot(a, tl.trans(b_up), acc_up)
            else:
                kb = k0 // 128
                a_s = _block_a_scale(a_scale_ptr, rows, kb, stride_asm, stride_ask, row_ok, a_row_scale, QUANT_A)
                ws_base = w_scale_ptr + w_expert * stride_wse + kb * stride_wsk
                col0 = pid_n * BLOCK_N
                acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * _block_w_scale(ws_base, offs_wn, col0, stride_wsn,
                                                                               WS_SCALAR)
                if UP:
                    acc_up += tl.dot(a, tl.trans(b_up)) * a_s[:, None] * _block_w_scale(
                        ws_base, offs_wn + up_offset, col0 + up_offset, stride_wsn, WS_SCALAR)

    if QUANT == 1 or QUANT == 2:
        if QUANT_A:
            a_s = tl.where(row_ok, a_scale_q, 0.0)
        else:
            a_s = tl.load(a_scale_ptr + rows * stride_asm, mask=row_ok, other=0.0)
        ws_base = w_scale_ptr + w_expert * stride_wse
        acc = acc * a_s[:, None] * tl.load(ws_base + offs_wn * stride_wsn)[None, :]
        if UP:
            acc_up = acc_up * a_s[:, None] * tl.load(ws_base + (offs_wn + up_offset) * stride_wsn)[None, :]
    elif QUANT == 4:
        a_g = tl.load(a_global_ptr + rows * stride_ag, mask=row_ok, other=1.0)
        denom = a_g[:, None] * tl.load(w_global_ptr + w_expert)
        acc = acc / denom
        if UP:
            acc_up = acc_up / denom

    out_ty = out_ptr.dtype.element_ty
    if BIAS:
        b_ptrs = bias_ptr + expert * stride_be + offs_wn
    if FUSE_ACT:
        # The reference rounds the gate_up product to the model dtype before the activation
        # (a bias is added to that, and the sum rounded again, as a model adding its bias after
        # the matmul does), and the activation's fp32 result to the model dtype again. An
        # ungated kind's one product is in acc (named gate here).
        gate = acc.to(H_TY).to(tl.float32)
        if BIAS:
            gate = (gate + tl.load(b_ptrs).to(tl.float32)[None, :]).to(H_TY).to(tl.float32)
        if UP:
            up = acc_up.to(H_TY).to(tl.float32)
            if BIAS:
                up = (up + tl.load(b_ptrs + up_offset).to(tl.float32)[None, :]).to(H_TY).to(tl.float32)
            h = _act_mul(gate, up, ACT, ACT_P0, ACT_P1)
        else:
            h = _act_one(gate, ACT)
        if BIAS:
            # Padding rows (A loaded as zeros) would hold act(bias): they stay exact zeros, as
            # without a bias (act(0, 0) is 0 for every mode).
            h = tl.where(row_ok[:, None], h, 0.0)
        result = h.to(H_TY)
    else:
        result = acc.to(out_ty)
        if BIAS:
            result = (result.to(tl.float32) + tl.load(b_ptrs).to(tl.float32)[None, :]).to(out_ty)
    if TRACK_AMAX == 1:
        seen = tl.where(row_ok[:, None] & n_ok[None, :], tl.abs(result.to(tl.float32)), 0.0)
        tl.atomic_max(amax_ptr + expert, tl.max(tl.max(seen, axis=1), axis=0), sem="relaxed")
    elif TRACK_AMAX == 2:
        # Padding rows are left at the plan's zero: their h is exactly zero.
        seen = tl.where(n_ok[None, :], tl.abs(result.to(tl.float32)), 0.0)
        tl.atomic_max(amax_ptr + offs_p, tl.max(seen, axis=1), mask=row_ok, sem="relaxed")
    if SCATTER_OUT:
        out_ptrs = out_ptr + orig_rows[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, result, mask=row_ok[:, None] & n_ok[None, :])
    elif QUANT_OUT:
        # h as quantize_h would quantize it from the model dtype: this tile's columns are one
        # 128-column scale group of every row, padding rows included (their zeros give the
        # floor scale, as quantize_h's do).
        q, scale = _fp8_group(result.to(tl.float32), _AMAX_FLOOR, _FP8_MAX)
        rows64 = offs_p.to(tl.int64)
        tl.store(out_ptr + rows64[:, None] * stride_om + offs_n[None, :] * stride_on, q, mask=n_ok[None, :])
        tl.store(out_scale_ptr + rows64 * stride_osm + pid_n, scale)
    else:
        # Padding rows are stored too (their A rows loaded as zeros, so they hold exact zeros):
        # the next stage may read whole tiles without masking.
        out_ptrs = out_ptr + offs_p.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, result, mask=n_ok[None, :])


@triton.jit
def _prefetch_w_rows(w_ptr, tile_expert_ptr, pid_m, pid_n, expert_lo, expert_hi, N, stride_we, stride_wn,
                     BLOCK_N: tl.constexpr, PREFETCH_BYTES: tl.constexpr):
    """Asks L2 for the first PREFETCH_BYTES of each of this program's BLOCK_N weight rows (one
    bulk prefetch a row, ``cp.async.bulk.prefetch.L2``; Hopper and later). A hint with no effect
    on any value: L2 is the GPU's point of coherence, and the loads that follow read what they
    would have read. The caller guarantees that the tile plan (``tile_expert_ptr``) was written
    before the kernel ahead started, so it may be read before ``pdl.enter``; row starts are 16-byte
    aligned and PREFETCH_BYTES a multiple of 16 within the row (``moe_gemm``)."""
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert >= expert_lo and expert < expert_hi:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        base = w_ptr + (expert - expert_lo).to(tl.int64) * stride_we
        # Rows past N ask for the expert's first row again: a valid address, a duplicate hint.
        ptrs = base + tl.where(rows < N, rows, 0).to(tl.int64) * stride_wn
        size = tl.full([BLOCK_N], PREFETCH_BYTES, tl.int32)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


# num_tiles varies with the routed rows, and the expert window with the chunk; specializing on
# them would compile a variant per value class.
@triton.jit(do_not_specialize=["num_tiles", "expert_lo", "expert_hi"])
def moe_gemm_kernel(
        a_ptr, a_half_ptr, a_scale_ptr, a_global_ptr,
        w_ptr, w_scale_ptr, w_global_ptr,
        out_ptr, out_scale_ptr, amax_ptr, bias_ptr,
        sorted_rows_ptr, tile_expert_ptr, start_ptr, count_ptr,
        num_tiles, expert_lo, expert_hi, N, K, N_w, up_offset, a_row_div,
        stride_am, stride_ak, stride_asm, stride_ask, stride_ag,
        stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
        stride_om, stride_on, stride_osm, stride_be,
        QUANT: tl.constexpr, FUSE_ACT: tl.constexpr, ACT: tl.constexpr, ACT_P0: tl.constexpr,
        ACT_P1: tl.constexpr, BIAS: tl.constexpr, QUANT_OUT: tl.constexpr, QUANT_A: tl.constexpr,
          H_TY: tl.constexpr,
        GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, TRACK_AMAX: tl.constexpr,
        EVEN_K: tl.constexpr, TMA_A: tl.constexpr, TMA_W: tl.constexpr, FP8_EXACT: tl.constexpr,
        FP8_ACC: tl.constexpr, WS_SCALAR: tl.constexpr, HALF_TILES: tl.constexpr,
        A_VALUES: tl.constexpr, W_VALUES: tl.constexpr, PDL: tl.constexpr, DIRECT: tl.constexpr,
        PREFETCH_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
        GROUP_M: tl.constexpr):
    # Grouped launch order: GROUP_M consecutive row tiles (mostly one expert) sweep all column
    # blocks together, so each weight tile is read from HBM once per group, not once per tile.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(num_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if PREFETCH_BYTES > 0:
        # Weights no kernel in the chain writes: asked for while the kernel ahead still runs, so
        # that its last wave and this kernel's start overlap with weight traffic.
        _prefetch_w_rows(w_ptr, tile_expert_ptr, pid_m, pid_n, expert_lo, expert_hi, N, stride_we, stride_wn,
                         BLOCK_N, PREFETCH_BYTES)
    pdl.enter(PDL)

    expert = tl.load(tile_expert_ptr + pid_m)
    # Padding tiles, and tiles of experts outside the window of weights given, compute nothing.
    if expert < expert_lo or expert >= expert_hi:
        return
    expert = expert.to(tl.int64)
    w_expert = expert - expert_lo
    p0 = pid_m * BLOCK_M
    if DIRECT:  # tile pid_m is routed row pid_m alone (``align.direct_rows``)
        first = p0
        count = 1
    else:
        first = tl.load(start_ptr + expert)
        count = tl.load(count_ptr + expert)
    # An expert's last tile holds count % BLOCK_M rows. With HALF_TILES a tile whose rows fit in
    # its first half computes only that half (a BLOCK_M / 2 tile, the smallest the wgmma takes
    # is 64 rows): with 128-row tiles and ~128 rows per expert (DeepSeek-V3 at 4096 tokens) a
    # third of the MMA work was padding.
    if HALF_TILES:
        if count - (p0 - first) <= BLOCK_M // 2:
            _tile(a_half_ptr, a_scale_ptr, a_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, out_scale_ptr,
                  amax_ptr, bias_ptr, sorted_rows_ptr, p0, expert, w_expert, first, count, pid_m, pid_n, N, K, N_w,
                  up_offset, a_row_div, stride_am, stride_ak, stride_asm, stride_ask, stride_ag,
                  stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_om, stride_on,
                  stride_osm, stride_be, QUANT, FUSE_ACT, ACT, ACT_P0, ACT_P1, BIAS, QUANT_OUT, QUANT_A, H_TY,
                  GATHER_A, SCATTER_OUT, TRACK_AMAX, EVEN_K,
                  TMA_A, TMA_W, FP8_EXACT, FP8_ACC, WS_SCALAR, A_VALUES, W_VALUES, DIRECT, BLOCK_M // 2, BLOCK_N,
                  BLOCK_K, SUB_K)
            if not SCATTER_OUT:
                # The skipped half holds padding only: store its zeros (quantized: zeros and the
                # floor scale), as a whole tile would.
                offs_z = (p0 + BLOCK_M // 2 + tl.arange(0, BLOCK_M // 2)).to(tl.int64)
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                z_ptrs = out_ptr + offs_z[:, None] * stride_om + offs_n[None, :] * stride_on
                tl.store(z_ptrs, tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=out_ptr.dtype.element_ty),
                         mask=(offs_n < N)[None, :])
                if QUANT_OUT:
                    _, floor = _fp8_group(tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32), _AMAX_FLOOR, _FP8_MAX)
                    tl.store(out_scale_ptr + offs_z * stride_osm + pid_n, floor)
            return
    _tile(a_ptr, a_scale_ptr, a_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, out_scale_ptr, amax_ptr,
          bias_ptr, sorted_rows_ptr, p0, expert, w_expert, first, count, pid_m, pid_n, N, K, N_w, up_offset,
          a_row_div, stride_am, stride_ak, stride_asm, stride_ask, stride_ag,
          stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_om, stride_on, stride_osm,
          stride_be, QUANT, FUSE_ACT, ACT, ACT_P0, ACT_P1, BIAS, QUANT_OUT, QUANT_A, H_TY, GATHER_A, SCATTER_OUT,
          TRACK_AMAX, EVEN_K, TMA_A, TMA_W, FP8_EXACT, FP8_ACC, WS_SCALAR, A_VALUES, W_VALUES, DIRECT, BLOCK_M,
          BLOCK_N, BLOCK_K, SUB_K)


def _a_operand(a: torch.Tensor | QuantizedActivations | Nvfp4Values):
    """(data, scale, global, stride_asm, stride_ask, stride_ag, quant mode, decoded values) of
    activations."""
    if isinstance(a, Nvfp4Values):  # decoded nvfp4: no block scales left, the global scale stays
        ag = scale_strides(a.global_scale, 2)[0]
        return a.values, a.values, a.global_scale, 0, 0, ag, kernel_mode("nvfp4"), True
    if not isinstance(a, QuantizedActivations):
        return a, a, a, 0, 0, 0, 0, False
    mode = kernel_mode(a.scheme)
    if a.row_scale is None:  # one scale per tensor (or per row from an amax override)
        scale = a.tensor_scale
        sm, sk = scale_strides(scale, 2)
        return a.data, scale, scale, sm, sk, 0, mode, False
    if a.tensor_scale is not None:  # row scales and a global scale (nvfp4)
        sm, sk = a.row_scale.stride()
        ag = scale_strides(a.tensor_scale, 2)[0]  # [] -> 0, [M, 1] -> its row stride
        return a.data, a.row_scale, a.tensor_scale, sm, sk, ag, mode, False
    sm, sk = scale_strides(a.row_scale, 2)
    return a.data, a.row_scale, a.row_scale, sm, sk, 0, mode, False


def _w_operand(w: torch.Tensor | QuantizedWeight | Nvfp4Values):
    """(data, scale, global, (stride_wse, stride_wsn, stride_wsk), quant mode, decoded values) of
    weights."""
    if isinstance(w, Nvfp4Values):
        return w.values, w.values, w.global_scale, (0, 0, 0), kernel_mode("nvfp4"), True
    if not isinstance(w, QuantizedWeight):
        return w, w, w, (0, 0, 0), 0, False
    if w.global_scale is not None:
        return w.data, w.scale, w.global_scale, w.scale.stride(), kernel_mode(w.scheme), False
    return w.data, w.scale, w.scale, scale_strides(w.scale, 3), kernel_mode(w.scheme), False


def k_sub_step(mode: int, block_k: int) -> int:
    """The columns of K that ``moe_gemm_kernel`` loads and multiplies at a time within a K step of
    ``block_k`` (its SUB_K, and the width of its TMA blocks): the whole step, except that
    fp8_block (mode 3) scales each 128-column group of K and every MMA's sum must stay inside one
    group, so a wider step runs as 128-column sub-steps, their tiles loaded apart (the same sums,
    added in the same order, as 128-column steps; the loop takes fewer iterations)."""
    return 128 if mode == 3 and block_k > 128 else block_k


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a 2-D row-major view with a 16-byte aligned base and row stride."""
    return (t.stride(-1) == 1 and (t.stride(-2) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
            and all(t.stride(d) == t.stride(d + 1) * t.shape[d + 1] for d in range(t.dim() - 2)))


def moe_gemm(a: torch.Tensor | QuantizedActivations | Nvfp4Values, w: torch.Tensor | QuantizedWeight | Nvfp4Values,
             plan: RowAlignment,
             out: torch.Tensor, config: GemmConfig, *, activation: str | None, gather: bool,
             amax: torch.Tensor | None = None, fp8_exact: bool = False, a_row_div: int = 1,
             fp8_acc: str | None = None, pdl_launch: bool = False,
             experts: tuple[int, int] | None = None, out_scale: torch.Tensor | None = None,
             h_dtype: torch.dtype | None = None, row_amax: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, quantize_a: bool = False,
             a_amax: torch.Tensor | None = None, prefetch_w: int = 0) -> torch.Tensor:
    """Launches the grouped GEMM; writes and returns ``out``.

    a: activations [M / a_row_div, K] (``gather=True``: original rows, routed row m read from row
       m // a_row_div through ``plan.sorted_rows``) or [P, K] (``gather=False``: padded
       positions); model dtype or quantized, same scheme as w; nvfp4 also as ``Nvfp4Values``
       (decoded once by ``nvfp4_values``; the same products as from its codes).
    w: [E, N_w, K] model dtype or ``QuantizedWeight`` (nvfp4: or ``Nvfp4Values``).
    out: ``activation`` given (gate_up): [P, N_w / 2] in the model dtype, written at padded
       positions; else (down): [M, N_w], written at the original rows (``plan.sorted_rows``).
    amax: fp32 [E] zeroed buffer; gate_up max-reduces each expert's |h| into it.
    row_amax: fp32 [P] zeroed buffer (``align_rows(row_amax=...)``); gate_up max-reduces the |h|
       of each position holding a routed row into it: the row maxima of h, which fp8_token's
       ``quantize_h`` then reads instead of h (the same values: max is exact in any order).
       Padding positions are left as they are. Not with amax or out_scale.
    config.tma: weights (and, for the down GEMM, the contiguous h tiles) are read through TMA
       descriptors where the layout allows it; gathered rows always use pointer loads.
    config.half_tiles: a tile whose expert has rows in its first half only (the expert's last
       tile) computes a tile of half the height; the other half, padding, is stored as zeros
       (gate_up) or not at all (down), as a whole tile would leave it.
    fp8_exact: fp8 operands are widened to fp16 (exactly) for an fp32-accurate product; without
       it they go to the fp8 tensor cores, whose accumulation keeps about 14 bits within each
       BLOCK_K step (the fp32 sum across steps is exact).
    a_row_div: ``ExpertInput.repeat``: how many consecutive routed rows share one row of a
       (gather only; 1 otherwise).
    fp8_acc: how the per-tensor / per-row fp8 GEMMs (modes 1, 2) accumulate on the fp8 tensor
       cores: "split" (a fresh fp32 tile per BLOCK_K step, added in fp32), "promote" (one
       accumulator, promoted to fp32 every BLOCK_K terms by the MMA lowering: the same contract),
       "imprecise" (the tensor cores' reduced-precision accumulation across all of K, as Triton
       does by default on Hopper). fp8_block always scales per 128-column step. None: the
       config's own (``GemmConfig.fp8_acc``).
    pdl_launch: launch with programmatic dependent launch (``moeshard.kernels.pdl``; the caller
       checks ``pdl.supported``): every program waits for the kernel ahead before it reads
       anything that kernel may write.
    config.engine: "gluon" runs the persistent fp8 GEMMs (``kernels.persistent_gate_up`` with
       gathered rows, ``kernels.persistent_down`` and for fp8_block
       ``kernels.persistent_block_down``; the same bits) for fp8_tensor / fp8_token / fp8_block on
       compute capability 9.x, without fp8_exact, pdl_launch or experts (the down GEMM also
       without amax and a_row_div); anything else is refused.
    experts: (lo, hi): w holds experts [lo, hi) of the plan's E only (w[e - lo] is expert e), and
       only their tiles are computed; the others' output rows are left as they are, for another
       launch over another window. None: w holds all E experts.
    out_scale: fp8_block gate_up only: h is quantized as it is stored, bit for bit as
       ``quant.quantize_h`` quantizes the model-dtype h (no h in the model dtype is written):
       ``out`` is then fp8 e4m3 [P, N_w / 2] and ``out_scale`` fp32 [P, N_w / 256], the scale of
       each row's 128-column group. Needs 128-column tiles (one group per tile), N_w / 2 a
       multiple of 128, no amax, and ``h_dtype``, the model dtype h is rounded to first.
    bias: None, or the experts' bias [E, N_w] (all E experts of the plan, whatever the window;
       the model dtype, rows of unit column stride): gate_up's [gate | up] bias, added to each
       product rounded to the model dtype, before the activation; down's, added to its rounded
       output (``ExpertWeights.gate_up_bias`` / ``down_bias``). Padding positions take none.
    quantize_a: the down GEMM of a direct plan (``plan.direct``) over fp8_tensor, fp8_token or
       fp8_block weights takes a as h in the model dtype [P, K] and quantizes each tile's one row
       as it loads it, bit for bit as ``quant.quantize_h`` would (no quantized h is written and
       read again, and no quantize_h launch sits between the GEMMs). a_amax: fp8_tensor's fp32 [E]
       per-expert amax of h (the gate_up GEMM's ``amax``), fp8_token's fp32 [P] row maxima (its
       ``row_amax``), None for fp8_block (each 128-column group's scale is its own; block_k 128,
       or 256: both groups of a step from one load). Not through TMA.
    prefetch_w: with pdl_launch, each program first asks L2 for the first ``prefetch_w`` columns
       of K of each of its weight rows, before it waits for the kernel ahead (``pdl.enter``), so
       that the weights stream while that kernel ends. Precondition: the plan (its
       ``tile_expert``) was written before the kernel ahead started, as the down GEMM's is (the
       plan precedes gate_up). Values are unchanged. Applies to pointer-loaded weights whose rows
       are contiguous and 16-byte aligned; elsewhere (TMA weights, other layouts) nothing is
       prefetched. 0: none.
    """
    if row_amax is not None:
        _check_row_amax(row_amax, plan, activation, amax, out_scale)
    if not isinstance(prefetch_w, int) or isinstance(prefetch_w, bool) or prefetch_w < 0:
        raise ValueError(f"moe_gemm: prefetch_w must be an int >= 0 (columns of K a row), got {prefetch_w!r}")
    if prefetch_w and (not pdl_launch or config.engine != "triton"):
        raise ValueError(f"moe_gemm: prefetch_w={prefetch_w} asks for weights before the wait on the kernel ahead; "
                         f"it needs pdl_launch=True and the Triton engine, got pdl_launch={pdl_launch}, "
                         f"engine={config.engine!r}")
    if config.engine == "gluon":
        return _gluon(a, w, plan, out, config, activation=activation, gather=gather, amax=amax,
                      fp8_exact=fp8_exact, a_row_div=a_row_div, fp8_acc=fp8_acc, pdl_launch=pdl_launch,
                      experts=experts, out_scale=out_scale, row_amax=row_amax, bias=bias, quantize_a=quantize_a)
    if quantize_a:
        _check_quantize_a(a, w, plan, config, activation, gather, a_amax)
    elif a_amax is not None:
        raise ValueError("moe_gemm: a_amax gives the scales of an A quantized as it is loaded; it needs quantize_a=True")
    fp8_acc = config.fp8_acc if fp8_acc is None else fp8_acc
    if config.block_m != plan.block_m:
        # Tiles of another height would index the plan's tiles at the wrong positions.
        raise ValueError(f"moe_gemm: config.block_m={config.block_m} but the plan's block_m={plan.block_m}; "
                         f"shorter tiles run over align.split_tiles(plan, {config.block_m})")
    if fp8_acc not in FP8_ACC_MODES:
        raise ValueError(f"moe_gemm: fp8_acc {fp8_acc!r} is not one of {list(FP8_ACC_MODES)}")
    a_rows = a.shape[0]
    if not isinstance(a_row_div, int) or isinstance(a_row_div, bool) or a_row_div < 1:
        raise ValueError(f"moe_gemm: a_row_div must be an int >= 1, got {a_row_div!r}")
    if not gather and a_row_div != 1:
        raise ValueError(f"moe_gemm: a_row_div={a_row_div} needs gather=True (a at padded positions is never shared)")
    want_rows = plan.num_rows if gather else plan.padded_rows
    if a_rows * a_row_div != want_rows:
        raise ValueError(f"moe_gemm: a has {a_rows} rows, a_row_div={a_row_div}; the plan needs "
                         f"{'M' if gather else 'P'} = {want_rows} = rows * a_row_div")
    a_data, a_scale, a_global, s_am, s_ak, s_ag, a_mode, a_values = _a_operand(a)
    w_data, w_scale, w_global, (s_we, s_wn, s_wk), w_mode, w_values = _w_operand(w)
    if quantize_a:  # a is quantized in the kernel, to the weights' scheme, with a_amax's scales
        a_mode, a_scale = w_mode, a_amax if a_amax is not None else a_data
    if a_mode != w_mode:
        raise ValueError(f"moe_gemm: activation scheme (mode {a_mode}) and weight scheme (mode {w_mode}) differ")
    fused = activation is not None
    e, n_w, k = w.shape
    num_experts = plan.start.shape[0]
    lo, hi = (0, num_experts) if experts is None else experts
    if not (0 <= lo < hi <= num_experts) or hi - lo != e:
        raise ValueError(f"moe_gemm: experts={experts!r} must be a window 0 <= lo < hi <= E={num_experts} of the "
                         f"plan's experts, with hi - lo equal to the {e} experts of w")
    # A gated kind's gate_up holds gate rows then up rows (2 per column of h); an ungated one's up rows.
    products = get_activation(activation, "moe_gemm: activation").products if activation is not None else 1
    gated = products == 2
    n = n_w // products
    if fused and n_w % products:
        raise ValueError(f"moe_gemm: fused gate_up needs an even number of weight rows, got {n_w}")
    if bias is not None and (tuple(bias.shape) != (num_experts, n_w) or bias.stride(1) != 1
                             or not bias.is_floating_point() or bias.device != out.device):
        raise ValueError(f"moe_gemm: bias must be a float [E={num_experts}, N_w={n_w}] tensor with unit column stride "
                         f"on {out.device}; got {bias.dtype} {list(bias.shape)} strides {bias.stride()} on "
                         f"{bias.device}")
    if w_mode == 4 and k % 16:
        raise ValueError(f"moe_gemm: nvfp4 needs K % 16 == 0, got K={k}")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if w_mode == 3 and 128 % bk and (bk % 128 or k % bk):
        # The kernel scales each 128-column sub-step with its group's scales (k0 // 128); a step
        # wider than a group runs as whole groups, and only over a K it divides (a last partial
        # step would read scales past K's groups).
        raise ValueError(f"moe_gemm: fp8_block scales each 128-column group of K; config.block_k={bk} must divide "
                         f"128, or be a multiple of 128 that divides K={k}")
    # Stored columns per value: nvfp4 codes pack two per byte, decoded values one.
    a_pack = 2 if a_mode == 4 and not a_values else 1
    w_pack = 2 if w_mode == 4 and not w_values else 1
    sub_k = k_sub_step(w_mode, bk)
    a_arg, w_arg = a_data, w_data
    a_half = a_data  # the half tiles' A: a descriptor of [BLOCK_M / 2, SUB_K] blocks under TMA
    tma_a = tma_w = False
    if config.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        if _tma_ok(w_data):
            w_arg = TensorDescriptor.from_tensor(w_data.view(e * n_w, k // w_pack), [bn, sub_k // w_pack])
            tma_w = True
        if not gather and not quantize_a and _tma_ok(a_data):
            a_arg = TensorDescriptor.from_tensor(a_data, [bm, sub_k // a_pack])
            if config.half_tiles:
                a_half = TensorDescriptor.from_tensor(a_data, [bm // 2, sub_k // a_pack])
            tma_a = True
    ws_scalar = one_w_scale_per_tile(w_mode, bn, n, gated)
    if out_scale is not None:
        h_ty = H_TYPES[_check_quantized_out(out, out_scale, h_dtype, plan, n, w_mode, bn, fused, amax)]
    else:
        if h_dtype is not None and h_dtype != out.dtype:
            raise ValueError(f"moe_gemm: h_dtype={h_dtype} differs from out's {out.dtype}; it rounds h for out_scale")
        h_ty = H_TYPES.get(out.dtype, tl.float32)
    grid = (plan.max_tiles * triton.cdiv(n, bn),)
    act_p0, act_p1 = act_constants(activation)
    prefetch_bytes = _prefetch_bytes(w_data, prefetch_w, tma_w)
    moe_gemm_kernel[grid](
        a_arg, a_half if tma_a else a_arg, a_scale, a_global, w_arg, w_scale, w_global,
        out, out_scale if out_scale is not None else out,
        amax if amax is not None else row_amax if row_amax is not None else out,
        bias if bias is not None else out, plan.sorted_rows, plan.tile_expert, plan.start, plan.count,
        plan.max_tiles, lo, hi, n, k, n_w, n if gated else 0, a_row_div,
        a_data.stride(0), a_data.stride(1), s_am, s_ak, s_ag,
        w_data.stride(0), w_data.stride(1), w_data.stride(2), s_we, s_wn, s_wk,
        out.stride(0), out.stride(1), out_scale.stride(0) if out_scale is not None else 0,
        bias.stride(0) if bias is not None else 0,
        QUANT=w_mode, FUSE_ACT=fused, ACT=act_mode(activation),  # fused
        ACT_P0=act_p0, ACT_P1=act_p1, BIAS=bias is not None, QUANT_OUT=out_scale is not None,
        QUANT_A=quantize_a, H_TY=h_ty,
        GATHER_A=gather, SCATTER_OUT=not fused, TRACK_AMAX=amax_mode(amax, row_amax), EVEN_K=k % bk == 0,
        TMA_A=tma_a, TMA_W=tma_w, FP8_EXACT=fp8_exact and w_mode in (1, 2, 3), FP8_ACC=FP8_ACC_MODES[fp8_acc],
        WS_SCALAR=ws_scalar, HALF_TILES=config.half_tiles, A_VALUES=a_values, W_VALUES=w_values,
        PDL=pdl_launch, DIRECT=plan.direct, PREFETCH_BYTES=prefetch_bytes,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SUB_K=sub_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(pdl_launch),
    )
    return out


def _prefetch_bytes(w: torch.Tensor, columns: int, tma_w: bool) -> int:
    """Bytes of each weight row of w [E, N_w, K] a program prefetches for ``prefetch_w=columns``:
    the first ``columns`` of K (at most K), rounded down to the bulk prefetch's 16-byte unit; 0
    where w is read through TMA or its rows are not contiguous and 16-byte aligned."""
    es = w.element_size()
    aligned = w.stride(2) == 1 and w.data_ptr() % 16 == 0 and (w.stride(0) * es) % 16 == 0 \
        and (w.stride(1) * es) % 16 == 0
    if not columns or tma_w or not aligned:
        return 0
    return min(columns, w.shape[2]) * es // 16 * 16


def _check_row_amax(row_amax: torch.Tensor, plan: RowAlignment, activation: str | None,
                    amax: torch.Tensor | None, out_scale: torch.Tensor | None) -> None:
    """Refuses, naming the values, a ``row_amax`` ``moe_gemm`` cannot fill."""
    if activation is None or amax is not None or out_scale is not None:
        raise ValueError(f"moe_gemm: row_amax takes h's row maxima in the gate_up GEMM, without amax or out_scale; "
                         f"got {'gate_up' if activation is not None else 'down'}, amax given: {amax is not None}, "
                         f"out_scale given: {out_scale is not None}")
    P = plan.padded_rows
    if row_amax.dtype != torch.float32 or tuple(row_amax.shape) != (P,) or row_amax.stride(0) != 1:
        raise ValueError(f"moe_gemm: row_amax must be a contiguous float32 [P={P}] buffer; got {row_amax.dtype} "
                         f"{list(row_amax.shape)} with strides {row_amax.stride()}")


def _check_quantize_a(a, w, plan: RowAlignment, config: GemmConfig, activation: str | None, gather: bool,
                      a_amax: torch.Tensor | None) -> None:
    """Refuses, naming the values, a ``quantize_a`` call ``moe_gemm``'s kernel cannot quantize A in."""
    mode = kernel_mode(w.scheme) if isinstance(w, QuantizedWeight) else 0
    if activation is not None or gather or not plan.direct or mode not in (1, 2, 3):
        raise ValueError(f"moe_gemm: quantize_a quantizes h in the fp8_tensor / fp8_token / fp8_block down GEMM of a "
                         f"direct plan; got {'gate_up' if activation is not None else 'down'}, gather={gather}, "
                         f"direct plan: {plan.direct}, weights {getattr(w, 'scheme', 'none')!r}")
    if not isinstance(a, torch.Tensor) or a.dtype not in H_TYPES or a.dim() != 2:
        raise ValueError(f"moe_gemm: quantize_a takes h in the model dtype [P, K]; got "
                         f"{type(a).__name__} {getattr(a, 'dtype', '')} {list(getattr(a, 'shape', []))}")
    want = {1: ("per-expert amax", plan.start.shape[0]), 2: ("row maxima", plan.padded_rows)}.get(mode)
    if want is None:
        if a_amax is not None:
            raise ValueError("moe_gemm: quantize_a of fp8_block scales each 128-column group by its own amax; "
                             "a_amax must be None")
        if config.block_k not in (128, 256):
            raise ValueError(f"moe_gemm: quantize_a of fp8_block quantizes one or two 128-column groups per K step; "
                             f"config.block_k={config.block_k} must be 128 or 256")
        return
    what, n = want
    if a_amax is None or a_amax.dtype != torch.float32 or tuple(a_amax.shape) != (n,) or a_amax.stride(0) != 1 \
            or a_amax.device != a.device:
        raise ValueError(f"moe_gemm: quantize_a of {w.scheme} needs a_amax, the contiguous float32 [{n}] {what} of h "
                         f"on {a.device}; got "
                         f"{None if a_amax is None else (a_amax.dtype, list(a_amax.shape), a_amax.stride())}")


def _check_quantized_out(out: torch.Tensor, out_scale: torch.Tensor, h_dtype: torch.dtype | None,
                         plan: RowAlignment, n: int, mode: int, block_n: int, fused: bool,
                         amax: torch.Tensor | None) -> torch.dtype:
    """Refuses, naming the values, an ``out_scale`` call ``moe_gemm``'s kernel cannot quantize h in;
    returns h_dtype."""
    if not fused or mode != kernel_mode("fp8_block"):
        raise ValueError(f"moe_gemm: out_scale quantizes h in the fp8_block gate_up GEMM; got "
                         f"{'gate_up' if fused else 'down'} with operands of kernel mode {mode}")
    if block_n != 128 or n % 128:
        raise ValueError(f"moe_gemm: out_scale needs 128-column tiles over a multiple of 128 columns (one scale "
                         f"group per tile); got block_n={block_n}, N={n}")
    if amax is not None:
        raise ValueError("moe_gemm: out_scale takes no amax (fp8_block scales h per row and 128 columns)")
    if h_dtype not in H_TYPES:
        raise ValueError(f"moe_gemm: out_scale needs h_dtype, the model dtype h is rounded to, one of "
                         f"{list(H_TYPES)}; got {h_dtype}")
    P = plan.padded_rows
    if out.dtype != FP8_DTYPE or tuple(out.shape) != (P, n):
        raise ValueError(f"moe_gemm: with out_scale, out must be {FP8_DTYPE} [{P}, {n}]; got {out.dtype} "
                         f"{list(out.shape)}")
    if out_scale.dtype != torch.float32 or tuple(out_scale.shape) != (P, n // 128) or out_scale.stride(1) != 1:
        raise ValueError(f"moe_gemm: out_scale must be contiguous float32 [{P}, {n // 128}] rows; got "
                         f"{out_scale.dtype} {list(out_scale.shape)} with strides {out_scale.stride()}")
    return h_dtype


def _gluon(a, w, plan: RowAlignment, out: torch.Tensor, config: GemmConfig, *, activation: str | None,
           gather: bool, amax: torch.Tensor | None, fp8_exact: bool, a_row_div: int, fp8_acc: str | None,
           pdl_launch: bool, experts: tuple[int, int] | None, out_scale: torch.Tensor | None,
           row_amax: torch.Tensor | None, bias: torch.Tensor | None, quantize_a: bool) -> torch.Tensor:
    """``moe_gemm`` with ``config.engine == "gluon"``: the gate_up GEMM of
    ``kernels.persistent_gate_up`` (rows gathered) or the down GEMM of ``kernels.persistent_down``
    (``kernels.persistent_block_down`` for fp8_block; at padded positions), which take fewer of
    moe_gemm's options (each other one given is refused by name)."""
    gate_up = activation is not None
    given = {"gather": gather != gate_up, "fp8_exact": fp8_exact, "fp8_acc": fp8_acc not in (None, config.fp8_acc),
             "pdl_launch": pdl_launch, "experts": experts is not None, "out_scale": out_scale is not None,
             "a direct plan": plan.direct, "bias": bias is not None, "quantize_a": quantize_a}
    if not gate_up:
        given.update({"amax": amax is not None, "a_row_div": a_row_div != 1})
    if any(given.values()):
        what = "gate_up GEMM with gathered rows" if gate_up else "down GEMM at padded positions"
        raise ValueError(f"moe_gemm: engine 'gluon' computes the {what}; it does not take "
                         f"{[name for name, used in given.items() if used]}")
    if activation is not None:
        from moeshard.kernels.persistent_gate_up import persistent_gate_up

        return persistent_gate_up(a, w, plan, out, config, activation=activation, amax=amax, a_row_div=a_row_div,
                                  row_amax=row_amax)
    if getattr(w, "scheme", None) == "fp8_block":
        from moeshard.kernels.persistent_block_down import persistent_block_down

        return persistent_block_down(a, w, plan, out, config)
    from moeshard.kernels.persistent_down import persistent_down

    return persistent_down(a, w, plan, out, config)

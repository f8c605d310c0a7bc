"""One token's fp8 experts as matrix-vector products on the CUDA cores (``ExpertsConfig.gemv``).

    x [1, H] fp8 (one token, its top-k routed rows m = 0..M-1, expert ids[m])
        --gate_up GEMV: BLOCK_N gate rows and BLOCK_N up rows of expert ids[m] per program,
          act fused--> h [M, I] in the model dtype (and fp8_tensor's per-expert amax [E], or
          fp8_token's row maxima [M], max-reduced as h is stored)
    h --down GEMV: BLOCK_N weight rows per program; h's row quantized as it is loaded, bit for bit
          as ``quant.quantize_h`` would--> y [M, H] in the model dtype, in input order

One token reads each routed expert's weights once and multiplies them by one row: the tile GEMMs
(``grouped_gemm``) hold 16-row tiles of which 15 are padding, and a few programs a multiprocessor
stream their weights through a shared-memory pipeline. Here every program streams BLOCK_N weight
rows with plain 16-byte loads into registers, and multiplies in fp32 (an e4m3 x e4m3 product is
exact there; fp8_block's factor x_q * scales is rounded once), summed in fp32: more accurate than
the fp8 tensor cores' accumulation that ``TritonExperts`` declares (``ACCUMULATION["fp8_mma"]``),
so the reference's price of the experts holds. Each thread sums the 16 products of each of its
16-byte loads itself and keeps one partial sum a load across K; the threads' sums are reduced
once, at the end (no cross-thread reduction per K step).

Scales, per scheme (``QUANT`` is the scheme's ``kernel_mode``):

=====  ===========  =================================================================
QUANT  scheme       arithmetic
=====  ===========  =================================================================
1      fp8_tensor   sum(x_q * w_q) * a_scale * w_scale[e]; h's scale from amax[e]
2      fp8_token    sum(x_q * w_q) * a_scale[row] * w_scale[e, n]; h's from its row max
3      fp8_block    sum over 128-column groups g of w_q * (x_q * a_scale[g] * w_scale[e, n // 128, g]);
                    h's scale per 128-column group, from the group itself
=====  ===========  =================================================================

The gate_up product is rounded to the model dtype, then h = act(gate) * up in fp32 rounded to it
again, as the reference and the tile GEMM's epilogue do (``grouped_gemm._act_mul``). Rows whose
expert id is -1 compute nothing, and their output rows are left unwritten. Under PDL
(``pdl_launch``) every program waits for the kernel ahead first (``pdl.enter``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.activations import get_activation
from moeshard.kernels import pdl
from moeshard.kernels.configs import GemvConfig
from moeshard.kernels.grouped_gemm import H_TYPES, _a_operand, _act_mul, _act_one, _w_operand
from moeshard.kernels.modes import act_constants, act_mode
from moeshard.kernels.quant import _fp8, _fp8_group
from moeshard.quant import AMAX_FLOOR, FP8_MAX, QuantizedActivations, QuantizedWeight

# The schemes' kernel modes these kernels compute (fp8_tensor, fp8_token, fp8_block).
GEMV_MODES = (1, 2, 3)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _step_scales(x_scale_ptr, ws_base, k, k_ok, offs_k, stride_xsk, stride_wsk, EVEN_K: tl.constexpr):
    """fp8_block's factor of each column [BLOCK_K] of a K step: its 128-column group's activation
    scale times the tile's weight scale of that group (a tile lies in one 128-row weight block).
    Columns past K (a last, partial step) read no scale, which would lie past the row's groups,
    and take 0: their values are zeros, and 0 times a scale read past the end could be NaN."""
    groups = (k + offs_k) // 128
    if EVEN_K:
        return tl.load(x_scale_ptr + groups * stride_xsk) * tl.load(ws_base + groups * stride_wsk)
    return tl.load(x_scale_ptr + groups * stride_xsk, mask=k_ok, other=0.0) * \
        tl.load(ws_base + groups * stride_wsk, mask=k_ok, other=0.0)


@triton.jit
def _weights(ptrs, k_ok, EVEN_K: tl.constexpr):
    """One K step of a program's BLOCK_N weight rows, as fp32 [BLOCK_N, BLOCK_K] (e4m3 -> fp32 is
    exact); columns past K read as zeros."""
    if EVEN_K:
        return tl.load(ptrs).to(tl.float32)
    return tl.load(ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _row_sums(products, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] products -> [BLOCK_N, BLOCK_K / 16] sums of 16 consecutive columns: the
    16 e4m3 values one thread loads in one 16-byte load, so the sums stay within each thread and
    the accumulator holds one register per load instead of sixteen."""
    return tl.sum(tl.reshape(products, (BLOCK_N, BLOCK_K // 16, 16)), axis=2)


@triton.jit
def _program(N, BLOCK_N: tl.constexpr):
    """(routed row, block of BLOCK_N of the N output columns) of this program."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    return pid // num_pid_n, pid % num_pid_n


@triton.jit
def _gate_up_gemv_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, ids_ptr, h_ptr, amax_ptr, bias_ptr,
                         N, K, up_offset, x_row_div,
                         stride_xm, stride_xk, stride_xsm, stride_xsk,
                         stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
                         stride_hm, stride_be,
                         QUANT: tl.constexpr, ACT: tl.constexpr, ACT_P0: tl.constexpr, ACT_P1: tl.constexpr,
                         UP: tl.constexpr, BIAS: tl.constexpr, H_TY: tl.constexpr, TRACK_AMAX: tl.constexpr,
                         EVEN_K: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row, n block): h[row, n : n + BLOCK_N] of routed row ``row`` (x row row //
    x_row_div) through expert ids[row]'s gate rows [n, n + BLOCK_N) and up rows up_offset later."""
    row, pid_n = _program(N, BLOCK_N)
    pdl.enter(PDL)
    expert = tl.load(ids_ptr + row).to(tl.int64)  # -1: a padding row
    if expert < 0:
        return
    x_row = (row // x_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # Out-of-range columns read row 0 of the expert instead of masking every load; never stored.
    offs_wn = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    gate_ptrs = w_base + offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wk
    up_ptrs = gate_ptrs + up_offset * stride_wn
    ws_base = w_scale_ptr + expert * stride_wse
    xs_row = x_scale_ptr + x_row * stride_xsm
    # fp8_block: the tile's gate rows and up rows each lie in one 128-row weight block.
    gate_ws = ws_base + ((pid_n * BLOCK_N) // 128) * stride_wsn
    up_ws = ws_base + ((pid_n * BLOCK_N + up_offset) // 128) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    if UP:
        acc_up = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + offs_k < K
        if EVEN_K:
            a = tl.load(x_ptr + x_row * stride_xm + (k + offs_k) * stride_xk).to(tl.float32)
        else:
            a = tl.load(x_ptr + x_row * stride_xm + (k + offs_k) * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        if QUANT == 3:
            a_gate = a * _step_scales(xs_row, gate_ws, k, k_ok, offs_k, stride_xsk, stride_wsk, EVEN_K)
        else:
            a_gate = a
        acc += _row_sums(_weights(gate_ptrs + k * stride_wk, k_ok, EVEN_K) * a_gate[None, :], BLOCK_N, BLOCK_K)
        if UP:
            if QUANT == 3:
                a_up = a * _step_scales(xs_row, up_ws, k, k_ok, offs_k, stride_xsk, stride_wsk, EVEN_K)
            else:
                a_up = a
            acc_up += _row_sums(_weights(up_ptrs + k * stride_wk, k_ok, EVEN_K) * a_up[None, :], BLOCK_N, BLOCK_K)
    gate = tl.sum(acc, axis=1)
    if UP:
        up = tl.sum(acc_up, axis=1)
    if QUANT != 3:
        a_s = tl.load(xs_row)
        gate = gate * a_s * tl.load(ws_base + offs_wn * stride_wsn)
        if UP:
            up = up * a_s * tl.load(ws_base + (offs_wn + up_offset) * stride_wsn)
    # As the reference: each product rounded to the model dtype (a bias added to that and the sum
    # rounded again), then the activation's fp32 result rounded to it.
    gate = gate.to(H_TY).to(tl.float32)
    if BIAS:
        b_ptrs = bias_ptr + expert * stride_be + offs_wn
        gate = (gate + tl.load(b_ptrs).to(tl.float32)).to(H_TY).to(tl.float32)
    if UP:
        up = up.to(H_TY).to(tl.float32)
        if BIAS:
            up = (up + tl.load(b_ptrs + up_offset).to(tl.float32)).to(H_TY).to(tl.float32)
        h = _act_mul(gate, up, ACT, ACT_P0, ACT_P1)
    else:
        h = _act_one(gate, ACT)
    result = h.to(H_TY)
    if TRACK_AMAX == 1:
        tl.atomic_max(amax_ptr + expert, tl.max(tl.where(n_ok, tl.abs(result.to(tl.float32)), 0.0), axis=0),
                      sem="relaxed")
    elif TRACK_AMAX == 2:
        tl.atomic_max(amax_ptr + row, tl.max(tl.where(n_ok, tl.abs(result.to(tl.float32)), 0.0), axis=0),
                      sem="relaxed")
    tl.store(h_ptr + row.to(tl.int64) * stride_hm + offs_n, result, mask=n_ok)


@triton.jit
def _down_gemv_kernel(h_ptr, h_amax_ptr, w_ptr, w_scale_ptr, ids_ptr, y_ptr, bias_ptr, N, K,
                      stride_hm, stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
                      stride_ym, stride_be,
                      QUANT: tl.constexpr, BIAS: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row, n block): y[row, n : n + BLOCK_N] = h[row] quantized, through expert
    ids[row]'s down rows [n, n + BLOCK_N)."""
    row, pid_n = _program(N, BLOCK_N)
    pdl.enter(PDL)
    expert = tl.load(ids_ptr + row).to(tl.int64)  # -1: a padding row
    if expert < 0:
        return
    row64 = row.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_wn = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert * stride_we + offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wk
    ws_base = w_scale_ptr + expert * stride_wse
    if QUANT == 3:
        tile_ws = ws_base + ((pid_n * BLOCK_N) // 128) * stride_wsn
    else:
        # h's scale as quantize_h computes it: the expert's amax (fp8_tensor) or the row's max
        # (fp8_token), floored, over 448, correctly rounded.
        h_amax = tl.maximum(tl.load(h_amax_ptr + (expert if QUANT == 1 else row64)), _AMAX_FLOOR)
        h_scale = tl.math.div_rn(h_amax, tl.zeros_like(h_amax) + _FP8_MAX)
    acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + offs_k < K
        if EVEN_K:
            hv = tl.load(h_ptr + row64 * stride_hm + k + offs_k).to(tl.float32)
        else:
            hv = tl.load(h_ptr + row64 * stride_hm + k + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if QUANT == 3:
            # Each 128-column group by its own amax (a group past K is zeros: the floor scale,
            # zero values); the group's scale and the tile's weight scale folded into the values.
            q, group_scale = _fp8_group(tl.reshape(hv, (BLOCK_K // 128, 128)), _AMAX_FLOOR, _FP8_MAX)
            groups = k // 128 + tl.arange(0, BLOCK_K // 128)
            if EVEN_K:
                ws = tl.load(tile_ws + groups * stride_wsk)
            else:  # no scale read past the row's last group (K is whole groups)
                ws = tl.load(tile_ws + groups * stride_wsk, mask=groups < K // 128, other=0.0)
            a = tl.reshape(q.to(tl.float32) * (group_scale * ws)[:, None], (BLOCK_K,))
        else:
            a = _fp8(hv, h_scale, _FP8_MAX).to(tl.float32)
        acc += _row_sums(_weights(w_ptrs + k * stride_wk, k_ok, EVEN_K) * a[None, :], BLOCK_N, BLOCK_K)
    y = tl.sum(acc, axis=1)
    if QUANT != 3:
        y = y * h_scale * tl.load(ws_base + offs_wn * stride_wsn)
    out_ty = y_ptr.dtype.element_ty
    result = y.to(out_ty)
    if BIAS:
        result = (result.to(tl.float32) + tl.load(bias_ptr + expert * stride_be + offs_wn).to(tl.float32)).to(out_ty)
    tl.store(y_ptr + row64 * stride_ym + offs_n, result, mask=n_ok)


def _weight_operand(w, what: str):
    """(kernel mode, scale, (stride_wse, stride_wsn, stride_wsk)) of fp8 weights [E, N_w, K], after
    refusing (naming the values) weights the GEMVs cannot take. ``GemvConfig`` keeps block widths
    within one 128-row block and steps of whole 128-column groups; fp8_block's rows and K must be
    whole groups too (one weight scale per tile and group)."""
    if not isinstance(w, QuantizedWeight):
        raise ValueError(f"{what}: takes fp8_tensor, fp8_token or fp8_block weights, got {type(w).__name__}")
    _, scale, _, strides, mode, _ = _w_operand(w)
    if mode not in GEMV_MODES:
        raise ValueError(f"{what}: takes fp8_tensor, fp8_token or fp8_block weights, got {w.scheme!r}")
    if w.data.stride(2) != 1:
        raise ValueError(f"{what}: weight rows must be contiguous along K, got strides {w.data.stride()}")
    e, n_w, k = w.data.shape
    if mode == 3 and (n_w % 128 or k % 128):
        raise ValueError(f"{what}: fp8_block weights take rows and K multiples of 128 (one weight scale per tile "
                         f"and group); got weights [{e}, {n_w}, {k}]")
    return mode, scale, strides


def _check_ids(ids: torch.Tensor, num_experts: int, device: torch.device, what: str) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.device != device or ids.stride(0) != 1:
        raise ValueError(f"{what}: expert_ids must be contiguous int32 or int64 [M] on {device}, got {ids.dtype} "
                         f"{list(ids.shape)} strides {ids.stride()} on {ids.device} ({num_experts} experts)")


def gate_up_gemv(x: QuantizedActivations, w: QuantizedWeight, expert_ids: torch.Tensor, h: torch.Tensor,
                 config: GemvConfig, *, activation: str, x_row_div: int, amax: torch.Tensor | None = None,
                 row_amax: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 pdl_launch: bool = False) -> torch.Tensor:
    """h[m] = act(x[m // x_row_div] @ gate_up[expert_ids[m]].T) for each routed row m; writes and
    returns h.

    x: fp8 activations [M / x_row_div, K] of w's scheme. w: gate_up weights [E, N_w, K] (gated
    kinds: gate rows then up rows, N_w = 2N). expert_ids: int32/int64 [M], -1 for a padding row
    (its h row is left as it is). h: [M, N] in the model dtype. amax: fp32 [E] zeroed (fp8_tensor:
    each expert's max |h| max-reduced into it); row_amax: fp32 [M] zeroed (fp8_token: each row's);
    not both. bias: None or [E, N_w] added to each product rounded to the model dtype, before the
    activation. pdl_launch: as ``moe_gemm``'s.
    """
    what = "gate_up_gemv"
    mode, w_scale, (s_wse, s_wsn, s_wsk) = _weight_operand(w, what)
    if not isinstance(x, QuantizedActivations) or x.scheme != w.scheme or x.data.dim() != 2:
        raise ValueError(f"{what}: x must be [rows, K] activations quantized as the weights ({w.scheme!r}), got "
                         f"{getattr(x, 'scheme', type(x).__name__)!r}")
    x_data, x_scale, _, s_xsm, s_xsk, _, _, _ = _a_operand(x)
    e, n_w, k = w.data.shape
    products = get_activation(activation, f"{what}: activation").products
    n = n_w // products
    M = expert_ids.shape[0]
    _check_ids(expert_ids, e, h.device, what)
    if n_w % products or x_data.shape[1] != k or x_data.shape[0] * x_row_div != M or x_row_div < 1:
        raise ValueError(f"{what}: x {list(x_data.shape)} with x_row_div={x_row_div}, weights [{e}, {n_w}, {k}] "
                         f"and {M} routed rows do not fit (rows * x_row_div == M, x's K == weights' K)")
    if h.dtype not in H_TYPES or tuple(h.shape) != (M, n) or h.stride(1) != 1:
        raise ValueError(f"{what}: h must be bf16/fp16/fp32 [{M}, {n}] with unit column stride, got {h.dtype} "
                         f"{list(h.shape)} strides {h.stride()}")
    if amax is not None and row_amax is not None:
        raise ValueError(f"{what}: amax (per expert) and row_amax (per row) are two ways of one scale; give one")
    for name, buf, size in (("amax", amax, e), ("row_amax", row_amax, M)):
        if buf is not None and (buf.dtype != torch.float32 or tuple(buf.shape) != (size,) or buf.stride(0) != 1):
            raise ValueError(f"{what}: {name} must be a contiguous float32 [{size}] buffer, got {buf.dtype} "
                             f"{list(buf.shape)} strides {buf.stride()}")
    if bias is not None and (tuple(bias.shape) != (e, n_w) or bias.stride(1) != 1):
        raise ValueError(f"{what}: bias must be [E={e}, N_w={n_w}] with unit column stride, got {list(bias.shape)} "
                         f"strides {bias.stride()}")
    bn, bk = config.gate_up_block_n, config.block_k
    if mode == 3 and n % 128:
        raise ValueError(f"{what}: fp8_block's up rows start at N={n}, not a multiple of 128")
    act_p0, act_p1 = act_constants(activation)
    track = 1 if amax is not None else 2 if row_amax is not None else 0
    grid = (M * triton.cdiv(n, bn),)
    _gate_up_gemv_kernel[grid](
        x_data, x_scale, w.data, w_scale, expert_ids, h, amax if amax is not None else row_amax if track else h,
        bias if bias is not None else h, n, k, n if products == 2 else 0, x_row_div,
        x_data.stride(0), x_data.stride(1), s_xsm, s_xsk,
        w.data.stride(0), w.data.stride(1), w.data.stride(2), s_wse, s_wsn, s_wsk,
        h.stride(0), bias.stride(0) if bias is not None else 0,
        QUANT=mode, ACT=act_mode(activation), ACT_P0=act_p0, ACT_P1=act_p1, UP=products == 2,
        BIAS=bias is not None, H_TY=H_TYPES[h.dtype], TRACK_AMAX=track, EVEN_K=k % bk == 0, PDL=pdl_launch,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=config.num_warps, **pdl.launch_options(pdl_launch))
    return h


def down_gemv(h: torch.Tensor, w: QuantizedWeight, expert_ids: torch.Tensor, y: torch.Tensor, config: GemvConfig,
              *, h_amax: torch.Tensor | None, bias: torch.Tensor | None = None,
              pdl_launch: bool = False) -> torch.Tensor:
    """y[m] = quantize(h[m]) @ down[expert_ids[m]].T for each routed row m; writes and returns y.

    h: [M, K] in the model dtype (``gate_up_gemv``'s). w: down weights [E, N, K]. y: [M, N] in the
    model dtype (rows of padding left as they are). h_amax: fp8_tensor's fp32 [E] per-expert amax
    of h, fp8_token's fp32 [M] row maxima, None for fp8_block (each 128-column group's own scale):
    h's rows are quantized bit for bit as ``quant.quantize_h`` would. bias: None or [E, N], added to
    the rounded output.
    """
    what = "down_gemv"
    mode, w_scale, (s_wse, s_wsn, s_wsk) = _weight_operand(w, what)
    e, n, k = w.data.shape
    M = expert_ids.shape[0]
    _check_ids(expert_ids, e, y.device, what)
    if h.dtype not in H_TYPES or tuple(h.shape) != (M, k) or h.stride(1) != 1:
        raise ValueError(f"{what}: h must be bf16/fp16/fp32 [{M}, {k}] with unit column stride, got {h.dtype} "
                         f"{list(h.shape)} strides {h.stride()}")
    if tuple(y.shape) != (M, n) or y.stride(1) != 1 or not y.is_floating_point():
        raise ValueError(f"{what}: y must be a float [{M}, {n}] tensor with unit column stride, got {y.dtype} "
                         f"{list(y.shape)} strides {y.stride()}")
    want = {1: e, 2: M}.get(mode)
    if want is None and h_amax is not None:
        raise ValueError(f"{what}: fp8_block scales each 128-column group of h by its own amax; h_amax must be None")
    if want is not None and (h_amax is None or h_amax.dtype != torch.float32 or tuple(h_amax.shape) != (want,)
                             or h_amax.stride(0) != 1):
        raise ValueError(f"{what}: {w.scheme} needs h_amax, a contiguous float32 [{want}] buffer "
                         f"({'per expert' if mode == 1 else 'per row'}), got "
                         f"{None if h_amax is None else (h_amax.dtype, list(h_amax.shape), h_amax.stride())}")
    if bias is not None and (tuple(bias.shape) != (e, n) or bias.stride(1) != 1):
        raise ValueError(f"{what}: bias must be [E={e}, N={n}] with unit column stride, got {list(bias.shape)} "
                         f"strides {bias.stride()}")
    bn, bk = config.down_block_n, config.block_k
    grid = (M * triton.cdiv(n, bn),)
    _down_gemv_kernel[grid](
        h, h_amax if h_amax is not None else h, w.data, w_scale, expert_ids, y, bias if bias is not None else y,
        n, k, h.stride(0), w.data.stride(0), w.data.stride(1), w.data.stride(2), s_wse, s_wsn, s_wsk,
        y.stride(0), bias.stride(0) if bias is not None else 0,
        QUANT=mode, BIAS=bias is not None, EVEN_K=k % bk == 0, PDL=pdl_launch, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=config.num_warps, **pdl.launch_options(pdl_launch))
    return y

"""Top-k combine: ``out[t] = sum_k w[t, k] * y[row(t, k)]`` in fp32, one pass.

``row(t, k)`` is ``t * K + k`` for the local backend (the K copies of token t are consecutive
rows of y, a strided reduction) or an index map ``rows [T, K]`` for backends whose expert outputs
come back in another order (each pair's row in the received buffer). One pass reads the rows
once and writes out once (the generic ``index_add_`` path materialises ``y.float() * w`` first
and accumulates with atomics). The sum runs over k in order, so the result is deterministic. It
may also add a [T, H] addend (the shared experts) and round to the model dtype as it stores, so
that neither the fp32 sum nor a separate cast pass reaches memory. Given the pairs' expert ids,
it skips the empty picks (id -1, ``Routing.empty_picks``): their rows, which no expert wrote, are
not read, and they add exactly nothing.

``combine_topk_backward`` is the backward of the token-major combine in one pass as well: per
token it reads dL/d(out) and its K rows once and writes both gradients (the torch path,
``dispatch.base.pair_rows_backward``, takes an fp32 copy of the rows, two products, a cast and a
reduction: about 3 ms of DeepSeek-V3's layer backward at 4096 tokens on one H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit
def _combine_kernel(y_ptr, w_ptr, rows_ptr, ids_ptr, add_ptr, out_ptr, H, stride_y, stride_w, stride_a, stride_o,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, GATHER: tl.constexpr, SKIP: tl.constexpr,
                    ADD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        weight = tl.load(w_ptr + t * stride_w + k)
        if GATHER:
            row = tl.load(rows_ptr + t * TOP_K + k)
        else:
            row = t * TOP_K + k
        if SKIP:  # an empty pick: its row is not read and its term is an exact zero
            picked = tl.load(ids_ptr + t * TOP_K + k) >= 0
            y = tl.load(y_ptr + row * stride_y + cols, mask=cols < tl.where(picked, H, 0), other=0.0)
            weight = tl.where(picked, weight, 0.0)
        else:
            y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0)
        acc += weight * y.to(tl.float32)
    if ADD:  # after the K terms, as the layer adds the shared experts to the finished sum
        acc += tl.load(add_ptr + t * stride_a + cols, mask=ok, other=0.0).to(tl.float32)
    # The store rounds to out's dtype (to nearest even, as torch's casts).
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine_topk(y: torch.Tensor, topk_weights: torch.Tensor, rows: torch.Tensor | None = None, *,
                 addend: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                 pair_ids: torch.Tensor | None = None) -> torch.Tensor:
    """y: [R, H] any float dtype; topk_weights: fp32 [T, K]; rows: int64 [T, K] row of y of each
    (token, k) pair, or None for token-major rows (R = T * K, pair (t, k) at row t * K + k);
    addend: [T, H] (any float dtype) added in fp32 after the K terms, or None; pair_ids: integer
    [T, K] expert id of each pair, or None: a pair of id < 0 (an empty pick) adds nothing, whatever
    its row of y and its weight hold -> [T, H] in out_dtype, the fp32 sum rounded once."""
    T, K = topk_weights.shape
    H = y.shape[1]
    out = torch.empty(T, H, dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    if y.stride(1) != 1 or topk_weights.stride(1) != 1:
        raise ValueError("combine_topk: y and topk_weights need contiguous rows")
    if rows is not None and (tuple(rows.shape) != (T, K) or not rows.is_contiguous()):
        raise ValueError(f"combine_topk: rows must be a contiguous [{T}, {K}] index, got {list(rows.shape)}")
    if addend is not None and (tuple(addend.shape) != (T, H) or addend.stride(1) != 1):
        raise ValueError(f"combine_topk: addend must be [{T}, {H}] with contiguous rows, got {list(addend.shape)}")
    if pair_ids is not None and (tuple(pair_ids.shape) != (T, K) or not pair_ids.is_contiguous()):
        raise ValueError(f"combine_topk: pair_ids must be a contiguous [{T}, {K}] index, got {list(pair_ids.shape)}")
    _combine_kernel[(T, triton.cdiv(H, BLOCK_H))](y, topk_weights, rows if rows is not None else topk_weights,
                                                  pair_ids if pair_ids is not None else topk_weights,
                                                  addend if addend is not None else out, out, H, y.stride(0),
                                                  topk_weights.stride(0), addend.stride(0) if addend is not None else 0,
                                                  out.stride(0), TOP_K=K, BLOCK_H=BLOCK_H, GATHER=rows is not None,
                                                  SKIP=pair_ids is not None, ADD=addend is not None, num_warps=4)
    return out


BACKWARD_BLOCK_H = 512


@triton.jit
def _combine_backward_kernel(g_ptr, p_ptr, w_ptr, gp_ptr, gw_ptr, H, stride_g, stride_p, stride_w, stride_gp,
                             TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_PAD)
    k_ok = ks < TOP_K
    w = tl.load(w_ptr + t * stride_w + ks, mask=k_ok, other=0.0)
    rows = t * TOP_K + ks
    acc = tl.zeros([K_PAD], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        ok = cols < H
        g = tl.load(g_ptr + t * stride_g + cols, mask=ok, other=0.0)
        both = k_ok[:, None] & ok[None, :]
        picked = tl.load(p_ptr + rows[:, None] * stride_p + cols[None, :], mask=both, other=0.0).to(tl.float32)
        acc += tl.sum(picked * g[None, :], axis=1)
        tl.store(gp_ptr + rows[:, None] * stride_gp + cols[None, :],
                 (w[:, None] * g[None, :]).to(gp_ptr.dtype.element_ty), mask=both)
    tl.store(gw_ptr + t * TOP_K + ks, acc, mask=k_ok)


def combine_topk_backward(grad_out: torch.Tensor, picked: torch.Tensor,
                          topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of ``combine_topk`` on token-major rows: grad_out fp32 [T, H]; picked
    [T * K, H] (any float dtype) the rows the combine weighed; topk_weights fp32 [T, K] ->
    (grad_picked [T * K, H] in picked's dtype, ``w[t, k] * grad_out[t]`` rounded once;
    grad_weights fp32 [T, K], ``<grad_out[t], picked[t * K + k]>`` summed in fp32), as
    ``dispatch.base.pair_rows_backward`` computes them."""
    T, K = topk_weights.shape
    H = grad_out.shape[1]
    if (grad_out.dtype != torch.float32 or topk_weights.dtype != torch.float32 or tuple(grad_out.shape) != (T, H)
            or tuple(picked.shape) != (T * K, H)):
        raise ValueError(f"combine_topk_backward: expected grad_out fp32 [T, H], picked [T * K, H] and topk_weights fp32 "
                         f"[T, K]; got {grad_out.dtype} {list(grad_out.shape)}, {list(picked.shape)}, "
                         f"{topk_weights.dtype} {list(topk_weights.shape)}")
    if grad_out.stride(1) != 1 or picked.stride(1) != 1 or topk_weights.stride(1) != 1:
        raise ValueError("combine_topk_backward: grad_out, picked and topk_weights need contiguous rows")
    grad_picked = torch.empty(T * K, H, dtype=picked.dtype, device=picked.device)
    grad_weights = torch.empty(T, K, dtype=torch.float32, device=picked.device)
    if T and K:
        _combine_backward_kernel[(T,)](grad_out, picked, topk_weights, grad_picked, grad_weights, H, grad_out.stride(0),
                                       picked.stride(0), topk_weights.stride(0), grad_picked.stride(0), TOP_K=K,
                                       K_PAD=triton.next_power_of_2(K), BLOCK_H=BACKWARD_BLOCK_H, num_warps=4)
    return grad_picked, grad_weights

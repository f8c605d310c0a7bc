"""Top-k combine: ``out[t] = sum_k w[t, k] * y[row(t, k)]`` in fp32, one pass.

``row(t, k)`` is ``t * K + k`` for the local backend (the K copies of token t are consecutive
rows of y, a strided reduction) or an index map ``rows [T, K]`` for backends whose expert outputs
come back in another order (each pair's row in the received buffer). One pass reads the rows
once and writes out once (the generic ``index_add_`` path materialises ``y.float() * w`` first
and accumulates with atomics). The sum runs over k in order, so the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit
def _combine_kernel(y_ptr, w_ptr, rows_ptr, out_ptr, H, stride_y, stride_w, stride_o,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, GATHER: tl.constexpr):
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
        y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0)
        acc += weight * y.to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc, mask=ok)


def combine_topk(y: torch.Tensor, topk_weights: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """y: [R, H] any float dtype; topk_weights: fp32 [T, K]; rows: int64 [T, K] row of y of each
    (token, k) pair, or None for token-major rows (R = T * K, pair (t, k) at row t * K + k)
    -> fp32 [T, H]."""
    T, K = topk_weights.shape
    H = y.shape[1]
    out = torch.empty(T, H, dtype=torch.float32, device=y.device)
    if T == 0:
        return out
    if y.stride(1) != 1 or topk_weights.stride(1) != 1:
        raise ValueError("combine_topk: y and topk_weights need contiguous rows")
    if rows is not None and (tuple(rows.shape) != (T, K) or not rows.is_contiguous()):
        raise ValueError(f"combine_topk: rows must be a contiguous [{T}, {K}] index, got {list(rows.shape)}")
    _combine_kernel[(T, triton.cdiv(H, BLOCK_H))](y, topk_weights, rows if rows is not None else topk_weights, out, H,
                                                  y.stride(0), topk_weights.stride(0), out.stride(0), TOP_K=K,
                                                  BLOCK_H=BLOCK_H, GATHER=rows is not None, num_warps=4)
    return out

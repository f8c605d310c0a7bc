"""Top-k indices of each row with ties to the lower index, in one pass (the router's selection).

    scores [T, E] (fp32) --one program per ROWS rows, the row in registers, K rounds--> ids int64 [T, K]

Round r takes the largest score among the columns not taken yet and, among equal scores, the
lowest column: the order of a stable descending sort (``torch.sort(..., descending=True,
stable=True)``), which ``moeshard.router`` uses everywhere else. NaN ranks above every number,
as in torch's sort, and -inf below every number but still counts as a score, so every id is a
real column. A stable sort of [T, E] costs more than the routing it serves (torch's radix sort of
DeepSeek-V3's [16384, 256] scores: 0.43 ms on one H200; the layer's experts take 14 ms); this
kernel reads each score once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COLUMNS = 1024  # the widest row held in registers (E of every family is far below)
ROWS = 16  # rows per program


@triton.jit(do_not_specialize=["T"])
def _topk_kernel(s_ptr, ids_ptr, T, E, stride_s, K: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    row_ok = rows < T
    col_ok = cols < E
    s = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_s + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    nan = s != s
    open_ = tl.broadcast_to(col_ok[None, :], (ROWS, COLS))  # columns still to be taken
    for k in tl.static_range(K):
        # NaN first (lowest column among them), then the largest number.
        nan_left = open_ & nan
        any_nan = tl.max(nan_left.to(tl.int32), axis=1) > 0
        best = tl.max(tl.where(open_ & ~nan, s, float("-inf")), axis=1)
        cand = tl.where(any_nan[:, None], nan_left, open_ & ~nan & (s == best[:, None]))
        pick = tl.min(tl.where(cand, cols[None, :], COLS), axis=1)
        tl.store(ids_ptr + rows.to(tl.int64) * K + k, pick.to(tl.int64), mask=row_ok)
        open_ = open_ & (cols[None, :] != pick[:, None])


def supported(scores: torch.Tensor, k: int) -> bool:
    """Whether ``topk_low_index_first`` runs this case: fp32 [T, E] on CUDA, 1 <= k <= E <= MAX_COLUMNS."""
    return (scores.is_cuda and scores.dtype == torch.float32 and scores.dim() == 2
            and 1 <= k <= scores.shape[1] <= MAX_COLUMNS)


def topk_low_index_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: fp32 [T, E] -> int64 [T, k]: the columns of the k largest scores of each row,
    largest first, equal scores lower column first (``torch.sort(scores, -1, descending=True,
    stable=True).indices[:, :k]``, NaN and infinities included). One launch, no host sync."""
    if not (scores.dim() == 2 and scores.dtype == torch.float32 and 1 <= k <= scores.shape[1] <= MAX_COLUMNS):
        raise ValueError(f"topk_low_index_first: needs fp32 [T, E] scores with 1 <= k <= E <= {MAX_COLUMNS}; got "
                         f"{scores.dtype} {list(scores.shape)}, k={k}")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    T, E = scores.shape
    ids = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    if T:
        _topk_kernel[(triton.cdiv(T, ROWS),)](scores, ids, T, E, scores.stride(0), K=k,
                                             COLS=max(16, triton.next_power_of_2(E)), ROWS=ROWS, num_warps=4)
    return ids

"""Top-k indices of each row with ties to the lower index, in one pass (the router's selection).

    scores [T, E] (fp32) --one program per ROWS rows, the row in registers, K rounds--> ids int64 [T, K]
    (``topk_with_weights``: and in the same pass weights fp32 [T, K] = values [t, ids] of a second
     [T, E] tensor, divided by max(their sum, floor) when renormalizing, times a scale;
     ``softmax_topk``: the scores are the softmax of logits the kernel reads, in any float dtype;
     ``sigmoid_topk``: the scores are the sigmoid of the logits, the choice those scores plus a
     correction bias, only the best groups of experts eligible: DeepSeek-V3's routing)

Round r takes the largest score among the columns not taken yet and, among equal scores, the
lowest column: the order of a stable descending sort (``torch.sort(..., descending=True,
stable=True)``), which ``moeshard.router`` uses everywhere else. NaN ranks above every number,
as in torch's sort, and -inf below every number but still counts as a score, so every id is a
real column. A stable sort of [T, E] costs more than the routing it serves (torch's radix sort of
DeepSeek-V3's [16384, 256] scores: 0.43 ms on one H200; the layer's experts take 14 ms); this
kernel reads each score once. The weights pass replaces a gather, a sum, a clamp, a division and a
multiplication over [T, K] (about 12 us of launches at Qwen3-30B-A3B's 4096 tokens); it sums the
K weights in order k = 0, 1, ... and divides rounding to nearest, as the torch ops do up to the
order of the sum (within an ulp of fp32).

Sigmoid routing with groups (``sigmoid_topk``) takes one launch where the torch ops that score
the groups and mask the others out take about a dozen in a row at every decode step (a top-2
per group, a gather, a sum, a top-k of the groups, a scatter, a repeat, a negation and a fill,
besides the sigmoid and the bias's add). The kernel computes the sigmoid as torch's CUDA kernel
does (``1 / (1 + expf(-x))``, the accurate exponential and a correctly rounded division), so its
scores are the torch path's bit for bit on the GPU, and with them its picks; its weights are
too, up to the order of the K weights' sum when renormalizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MAX_COLUMNS = 1024  # the widest row held in registers (E of every family is far below)
ROWS = 16  # rows per program of rows narrower than WIDE_ROW
WARPS = 4  # warps per program of rows narrower than WIDE_ROW
# Rows of at least WIDE_ROW columns (after rounding up to a power of two): WIDE_TILE, (rows, warps).
# One H200, scripts/topk_study.py (results/h200/topk_study-2026-12-04-697169e.json): at 256
# columns (DeepSeek-V3's selection with weights) 16 rows on 4 warps took 64.8 us at 16384 tokens
# and 16.1 us at one token, 2 rows on one warp 44.8 and 8.5 us; at 128 columns (Qwen3-30B-A3B's
# softmax) 18.9 against 18.8 us and 7.3 against 6.1 us. At 16 columns (Mixtral's 8 experts) 2 rows
# on one warp was slower (9.6 against 6.5 us at 16384 tokens). Every variant gave the same bits.
WIDE_ROW = 128
WIDE_TILE = (2, 1)
_TAKEN: tl.constexpr = tl.constexpr(-(2**63))  # the key of a taken or padding column


def tile(columns: int) -> tuple[int, int]:
    """(rows per program, warps) for rows of ``columns`` scores (``COLS``, a power of two)."""
    return WIDE_TILE if columns >= WIDE_ROW else (ROWS, WARPS)


@triton.jit
def _order_keys(s, cols, col_ok, COLS: tl.constexpr):
    """int64 [ROWS, COLS] keys of the scores s, ordered as the scores with ties to the lower
    column (see below): one max per round picks."""
    # The score's order bits (its fp32 bits with the magnitude of negatives inverted, which order
    # as signed integers as the floats do; -0.0 made +0.0, an equal score; every NaN the largest)
    # << 32, or'ed with COLS - 1 - column, so that equal scores go to the lower column. Padding
    # columns get the smallest int64, below every score's key (-inf's included).
    # Integer tests on the bits (a float compare with zero may be folded away with the sign of zero).
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 -> +0.0
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    order = tl.where(nan, 0x7FFFFFFF, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits))
    key = (order.to(tl.int64) << 32) | (COLS - 1 - cols).to(tl.int64)[None, :]
    return tl.where(col_ok[None, :], key, _TAKEN)


@triton.jit
def _key_value(key):
    """The fp32 score a key (or a max of keys) was made from (-0.0 as +0.0, a NaN as a NaN)."""
    o = (key >> 32).to(tl.int32)
    return tl.where(o < 0, o ^ 0x7FFFFFFF, o).to(tl.float32, bitcast=True)


@triton.jit
def _best_groups(s, cols, col_ok, COLS: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, GROUP_MAX: tl.constexpr):
    """bool [ROWS, COLS]: True for the columns of the TOPK_GROUP best of GROUPS equal groups of
    columns. A group's score is its best score (GROUP_MAX) or the sum of its best two; the best
    groups are taken as the scores are (NaN first, ties to the lower group)."""
    GS: tl.constexpr = COLS // GROUPS
    key = tl.reshape(_order_keys(s, cols, col_ok, COLS), [ROWS, GROUPS, GS])
    best = tl.max(key, axis=2)
    group_score = _key_value(best)
    if not GROUP_MAX:
        # The second best: the best once the best column (one key: keys are distinct) is taken.
        second = tl.max(tl.where(key == best[:, :, None], _TAKEN, key), axis=2)
        group_score = group_score + _key_value(second)
    g = tl.arange(0, GROUPS)
    gkey = _order_keys(group_score, g, g < GROUPS, GROUPS)
    keep = tl.zeros([ROWS, GROUPS], dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        pick = (GROUPS - 1) - (tl.max(gkey, axis=1) & 65535).to(tl.int32)
        hit = g[None, :] == pick[:, None]
        keep = tl.where(hit, 1, keep)
        gkey = tl.where(hit, _TAKEN, gkey)
    return tl.reshape(tl.broadcast_to(keep[:, :, None], [ROWS, GROUPS, GS]), [ROWS, COLS]) != 0


@triton.jit(do_not_specialize=["T"])
def _topk_kernel(s_ptr, ids_ptr, w_src_ptr, w_ptr, bias_ptr, T, E, stride_s, stride_w, floor, scale,
                 K: tl.constexpr, KP: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
                 WEIGHTS: tl.constexpr, RENORM: tl.constexpr, SCALE: tl.constexpr, SOFTMAX: tl.constexpr,
                 SIGMOID: tl.constexpr = False, BIAS: tl.constexpr = False, GROUPS: tl.constexpr = 1,
                 TOPK_GROUP: tl.constexpr = 1, GROUP_MAX: tl.constexpr = False):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    row_ok = rows < T
    col_ok = cols < E
    s = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_s + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if SIGMOID:
        # s holds logits: the scores are torch's CUDA sigmoid of them, 1 / (1 + expf(-x)) with
        # the accurate exponential and a correctly rounded division, read as the weights.
        s = tl.math.div_rn(tl.full([ROWS, COLS], 1.0, tl.float32), 1.0 + libdevice.exp(-s))
    if SOFTMAX:
        # s holds logits: the scores are p = exp(s - max) / sum, selected on and gathered as the
        # weights. A NaN logit makes its row's sum, so every p of the row, NaN (as torch's softmax).
        row_max = tl.max(tl.where(col_ok[None, :], s, float("-inf")), axis=1)
        e = tl.where(col_ok[None, :], tl.exp(s - row_max[:, None]), 0.0)
        s = tl.math.div_rn(e, tl.broadcast_to(tl.sum(e, axis=1)[:, None], (ROWS, COLS)))
    # The weight of a pick is its choice score read back from its key where the choice is the
    # score (softmax without bias or groups), else the pick's column of src.
    VALUE_IS_SCORE: tl.constexpr = SOFTMAX and not BIAS and GROUPS == 1
    if WEIGHTS:
        if SIGMOID or SOFTMAX:
            src = s  # the weights are the unbiased, unmasked scores
        else:
            src = tl.load(w_src_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :],
                          mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        ks = tl.arange(0, KP)
        w = tl.zeros([ROWS, KP], dtype=tl.float32)
        total = tl.zeros([ROWS], dtype=tl.float32)
    if BIAS:  # the choice: the scores plus the correction bias
        s = s + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GROUPS > 1:
        # Experts outside the best groups can never win: -inf is below any score (as torch's
        # masked_fill before the selection).
        s = tl.where(_best_groups(s, cols, col_ok, COLS, ROWS, GROUPS, TOPK_GROUP, GROUP_MAX), s, float("-inf"))
    # One int64 key per score, so that one max per round picks (``_order_keys``); taken columns
    # get the smallest int64.
    key = _order_keys(s, cols, col_ok, COLS)
    for k in tl.static_range(K):
        top = tl.max(key, axis=1)
        pick = (COLS - 1) - (top & 65535).to(tl.int32)
        tl.store(ids_ptr + rows.to(tl.int64) * K + k, pick.to(tl.int64), mask=row_ok)
        key = tl.where(cols[None, :] == pick[:, None], _TAKEN, key)
        if WEIGHTS:
            if VALUE_IS_SCORE:
                # The weight is the score picked: its bits back from the key (NaN stays NaN).
                wk = _key_value(top)
            else:
                # The one column equal to pick: a sum of one value and zeros is that value.
                wk = tl.sum(tl.where(cols[None, :] == pick[:, None], src, 0.0), axis=1)
            w = tl.where(ks[None, :] == k, wk[:, None], w)
            total = total + wk
    if WEIGHTS:
        if RENORM:
            denom = tl.maximum(total, floor)
            w = tl.math.div_rn(w, tl.broadcast_to(denom[:, None], (ROWS, KP)))
        if SCALE:
            w = w * scale
        tl.store(w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], w, mask=row_ok[:, None] & (ks[None, :] < K))


def supported(scores: torch.Tensor, k: int) -> bool:
    """Whether ``topk_low_index_first`` runs this case: fp32 [T, E] on CUDA, 1 <= k <= E <= MAX_COLUMNS."""
    return (scores.is_cuda and scores.dtype == torch.float32 and scores.dim() == 2
            and 1 <= k <= scores.shape[1] <= MAX_COLUMNS)


def _check_scores(what: str, scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores as the kernel reads them (unit column stride), or a refusal naming ``what``."""
    if not (scores.dim() == 2 and scores.dtype == torch.float32 and 1 <= k <= scores.shape[1] <= MAX_COLUMNS):
        raise ValueError(f"{what}: needs fp32 [T, E] scores with 1 <= k <= E <= {MAX_COLUMNS}; got "
                         f"{scores.dtype} {list(scores.shape)}, k={k}")
    return scores if scores.stride(1) == 1 else scores.contiguous()


@dataclass(frozen=True)
class Groups:
    """Group-limited selection: the E experts in ``count`` equal groups of consecutive ids, only
    the ``keep`` best groups eligible; a group scored by its best choice score (``by_max``) or by
    the sum of its best two. ``count`` 1: no groups."""

    count: int = 1
    keep: int = 1
    by_max: bool = False


NO_GROUPS = Groups()


def _launch(choice: torch.Tensor, k: int, scores: torch.Tensor | None, renormalize: bool = False,
            floor: float = 1.0, scale: float = 1.0, softmax: bool = False,
            rows_warps: tuple[int, int] | None = None, sigmoid: bool = False, bias: torch.Tensor | None = None,
            groups: Groups = NO_GROUPS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``_topk_kernel`` launch over [T, E] ``choice`` (with ``softmax``: logits, whose
    softmax is both the choice and the scores; with ``sigmoid``: logits, whose sigmoid is the
    scores, plus ``bias`` [E] the choice): (ids int64 [T, k], and with ``scores``, ``softmax`` or
    ``sigmoid`` the gathered weights fp32 [T, k], else None). groups: only the best groups'
    columns eligible (E the power of two the kernel holds). rows_warps: (rows per program,
    warps), ``tile``'s unless a study gives others (scripts/topk_study.py)."""
    T, E = choice.shape
    cols = max(16, triton.next_power_of_2(E))
    rows, warps = rows_warps or tile(cols)
    ids = torch.empty(T, k, dtype=torch.int64, device=choice.device)
    gather = scores is not None or softmax or sigmoid
    weights = torch.empty(T, k, dtype=torch.float32, device=choice.device) if gather else None
    if T:
        _topk_kernel[(triton.cdiv(T, rows),)](
            choice, ids, choice if scores is None else scores, ids if weights is None else weights,
            choice if bias is None else bias, T, E,
            choice.stride(0), 0 if scores is None else scores.stride(0), float(floor), float(scale), K=k,
            KP=triton.next_power_of_2(k), COLS=cols, ROWS=rows,
            WEIGHTS=gather, RENORM=renormalize, SCALE=scale != 1.0, SOFTMAX=softmax, SIGMOID=sigmoid,
            BIAS=bias is not None, GROUPS=groups.count, TOPK_GROUP=groups.keep, GROUP_MAX=groups.by_max,
            num_warps=warps)
    return ids, weights


def topk_low_index_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: fp32 [T, E] -> int64 [T, k]: the columns of the k largest scores of each row,
    largest first, equal scores lower column first (``torch.sort(scores, -1, descending=True,
    stable=True).indices[:, :k]``, NaN and infinities included). One launch, no host sync."""
    return _launch(_check_scores("topk_low_index_first", scores, k), k, None)[0]


def topk_with_weights(choice: torch.Tensor, scores: torch.Tensor, k: int, renormalize: bool, floor: float,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """choice, scores: fp32 [T, E] on one CUDA device -> (ids int64 [T, k], weights fp32 [T, k]):
    ids = ``topk_low_index_first(choice, k)``; weights = scores[t, ids], divided by
    max(their sum, floor) when ``renormalize``, times ``scale`` unless it is 1 (the router's
    ``select_experts`` on these tensors, without autograd). One launch, no host sync."""
    choice = _check_scores("topk_with_weights: choice", choice, k)
    if scores.shape != choice.shape or scores.dtype != torch.float32 or scores.device != choice.device:
        raise ValueError(f"topk_with_weights: scores must be fp32 {list(choice.shape)} on {choice.device}, got "
                         f"{scores.dtype} {list(scores.shape)} on {scores.device}")
    ids, weights = _launch(choice, k, scores if scores.stride(1) == 1 else scores.contiguous(), renormalize, floor,
                           scale)
    assert weights is not None  # _launch gathers weights whenever it is given scores
    return ids, weights


LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _softmax_shape_ok(logits: torch.Tensor, k: int) -> bool:
    """[T, E] of ``LOGIT_DTYPES`` with 1 <= k <= E <= MAX_COLUMNS."""
    return logits.dim() == 2 and logits.dtype in LOGIT_DTYPES and 1 <= k <= logits.shape[1] <= MAX_COLUMNS


def routing_supported(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None,
                      groups: Groups = NO_GROUPS) -> bool:
    """Whether ``softmax_topk`` and ``sigmoid_topk`` run this case: logits on CUDA (bias too) and
    the shapes ``_scored_shape_ok`` takes."""
    return logits.is_cuda and (bias is None or bias.device == logits.device) and _scored_shape_ok(
        logits, k, bias, groups)


def _scored_shape_ok(logits: torch.Tensor, k: int, bias: torch.Tensor | None, groups: Groups) -> bool:
    """[T, E] of ``LOGIT_DTYPES``, 1 <= k <= E <= MAX_COLUMNS, bias None or [E]; with groups, E a
    power of two (at least 16: the kernel's narrowest row) that ``groups.count`` divides and
    1 <= keep <= count."""
    if not _softmax_shape_ok(logits, k):
        return False
    E = logits.shape[1]
    if bias is not None and tuple(bias.shape) != (E,):
        return False
    if groups.count == 1:
        return True
    return (E >= 16 and E & (E - 1) == 0 and groups.count > 1 and E % groups.count == 0
            and 1 <= groups.keep <= groups.count)


def _scored_topk(where: str, logits: torch.Tensor, k: int, renormalize: bool, floor: float, scale: float,
                 bias: torch.Tensor | None, groups: Groups, sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax_topk`` (sigmoid False) or ``sigmoid_topk``: the shape check, named ``where`` in
    its refusal, and the launch."""
    if not _scored_shape_ok(logits, k, bias, groups):
        raise ValueError(f"{where}: needs [T, E] logits of {[str(d) for d in LOGIT_DTYPES]} with 1 <= k <= E <= "
                         f"{MAX_COLUMNS}, bias None or [E], and for groups E a power of two >= 16 that the group "
                         f"count divides and 1 <= keep <= count; got {logits.dtype} {list(logits.shape)}, k={k}, "
                         f"bias {None if bias is None else list(bias.shape)}, {groups}")
    ids, weights = _launch(logits if logits.stride(1) == 1 else logits.contiguous(), k, None, renormalize, floor,
                           scale, softmax=not sigmoid, sigmoid=sigmoid,
                           bias=None if bias is None else bias.contiguous(), groups=groups)
    assert weights is not None  # _launch gathers weights with either score
    return ids, weights


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, floor: float, scale: float,
                 bias: torch.Tensor | None = None, groups: Groups = NO_GROUPS) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32, bf16 or fp16) -> (ids int64 [T, k], weights fp32 [T, k]): the router's
    softmax routing in one pass, p = softmax(logits in fp32) over each row, the choice p + bias
    ([E], any float dtype, or None) with only the ``groups.keep`` best groups' experts eligible
    (the others' choice -inf), ids = ``topk_low_index_first(choice, k)``, weights = p[t, ids]
    renormalized and scaled as ``topk_with_weights``. The softmax, and no fp32 copy of the
    logits, is computed in the kernel; p is torch's softmax up to rounding (the exponential is
    the GPU's fast one, and the sum's order differs), so where two experts' choices differ by
    that much the pick may differ from the torch ops'. One launch, no host sync."""
    return _scored_topk("softmax_topk", logits, k, renormalize, floor, scale, bias, groups, sigmoid=False)


def sigmoid_topk(logits: torch.Tensor, k: int, renormalize: bool, floor: float, scale: float,
                 bias: torch.Tensor | None = None, groups: Groups = NO_GROUPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax_topk`` with sigmoid scores (DeepSeek-V3's routing): s = sigmoid(logits in fp32),
    the choice s + bias with only the best groups eligible, weights s[t, ids] renormalized and
    scaled. The router's torch ops on the same device (``router.select_experts``) give the same
    ids and, up to the order of the K weights' sum, the same weights: the sigmoid is computed as
    torch's CUDA kernel computes it. One launch, no host sync."""
    return _scored_topk("sigmoid_topk", logits, k, renormalize, floor, scale, bias, groups, sigmoid=True)

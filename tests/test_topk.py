"""The router's one-pass top-k (``moeshard.kernels.topk``) through Triton's CPU interpreter,
against the stable descending sort it stands in for on CUDA: ties (scores rounded to a quarter,
as bf16 logits tie; -0.0 and 0.0), NaN and infinities, one column, k = E, and the input checks."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (37, 128, 8), (5, 256, 8), (40, 32, 2), (3, 8, 8), (17, 60, 5),
                                   (2, 1, 1)])
def test_topk_equals_the_stable_sort(interpreted_kernels, T, E, k):
    topk = interpreted_kernels.topk
    g = torch.Generator().manual_seed(T * E + k)
    s = (torch.randn(T, E, generator=g) * 4).round() / 4
    if E > 4:
        s[0, 1] = float("nan")  # NaN ranks first, lower column first
        s[0, 3] = -s[0, 1]  # a NaN with its sign bit set ranks as any NaN
        s[1 % T, 2] = float("inf")
        s[-1, : E // 2] = float("-inf")  # -inf columns are still scores, taken last
    if T > 3:
        s[2] = torch.where(torch.arange(E) % 3 == 0, -0.0, 0.0)  # -0.0 and 0.0 are equal scores
    want = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(topk.topk_low_index_first(s, k), want)
    assert torch.equal(topk.topk_low_index_first(s.t().contiguous().t(), k), want)  # a column-major view


def test_topk_refuses_what_it_cannot_run(interpreted_kernels):
    topk = interpreted_kernels.topk
    with pytest.raises(ValueError, match=r"1 <= k <= E <= 1024; got torch.float32 \[2, 4\], k=5"):
        topk.topk_low_index_first(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="got torch.float16"):
        topk.topk_low_index_first(torch.zeros(2, 4, dtype=torch.float16), 1)
    assert topk.topk_low_index_first(torch.zeros(0, 4), 2).shape == (0, 2)
    assert not topk.supported(torch.zeros(2, 4), 2)  # CPU scores keep the sort


@pytest.mark.parametrize("T,E,k,renormalize,scale", [(37, 128, 8, True, 1.0), (5, 256, 8, True, 2.5),
                                                     (40, 8, 2, True, 1.0), (17, 60, 5, False, 1.0),
                                                     (9, 64, 6, False, 16.0), (3, 8, 8, True, 1.0)])
def test_topk_with_weights_is_the_routers_selection(interpreted_kernels, T, E, k, renormalize, scale):
    """The weights pass: ids from the choice scores (DeepSeek-V3 selects on biased, group-masked
    scores), weights read from the unbiased scores, renormalized and scaled as
    ``router.select_experts`` does with torch ops: the same ids, weights within an ulp (the sum of
    the K weights may be added in another order)."""
    topk = interpreted_kernels.topk
    g = torch.Generator().manual_seed(T * E + k)
    scores = torch.rand(T, E, generator=g)
    scores[0, : E // 2] = scores[0, 0]  # ties go to the lower column
    choice = scores + (torch.randn(E, generator=g) * 0.1).view(1, -1)
    choice[-1, ::2] = float("-inf")  # a masked group: -inf never wins unless nothing else is left
    ids, weights = topk.topk_with_weights(choice, scores, k, renormalize, 1e-20, scale)
    want_ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    want = scores.gather(1, want_ids)
    if renormalize:
        want = want / want.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if scale != 1.0:
        want = want * scale
    assert torch.equal(ids, want_ids)
    assert weights.dtype == torch.float32 and torch.allclose(weights, want, rtol=2 * 2.0**-23, atol=0)
    # One scores tensor for both, as softmax routing passes it.
    ids_same, w_same = topk.topk_with_weights(scores, scores, k, False, 1e-20, 1.0)
    assert torch.equal(w_same, scores.gather(1, ids_same))


def test_topk_with_weights_refuses_mismatched_scores(interpreted_kernels):
    topk = interpreted_kernels.topk
    with pytest.raises(ValueError, match=r"scores must be fp32 \[2, 8\] on cpu, got torch.float32 \[2, 4\]"):
        topk.topk_with_weights(torch.zeros(2, 8), torch.zeros(2, 4), 2, True, 1e-20, 1.0)
    ids, w = topk.topk_with_weights(torch.zeros(0, 8), torch.zeros(0, 8), 2, True, 1e-20, 1.0)
    assert ids.shape == w.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("T,E,k,renormalize,scale", [(37, 128, 8, True, 1.0), (40, 8, 2, True, 1.0),
                                                     (17, 60, 5, False, 1.0), (9, 64, 6, True, 2.5), (1, 1, 1, True, 1.0)])
def test_softmax_topk_is_the_routers_softmax_routing(interpreted_kernels, dtype, T, E, k, renormalize, scale):
    """Softmax routing in one pass from the logits as the router computed them (the model dtype
    under ``router_dtype="model"``): the ids of the stable sort of torch's fp32 softmax (ties
    among equal logits to the lower column; logits rounded to halves tie often), weights within
    a few ulps of the torch ops' (the exponential and the sum's order differ), a row with a NaN
    logit all NaN (ids 0..k-1, as the sort ranks NaN first), -inf logits taken last, and a
    column-major view read as its values."""
    topk = interpreted_kernels.topk
    g = torch.Generator().manual_seed(T * E + k)
    logits = ((torch.randn(T, E, generator=g) * 6).round() / 2).to(dtype)
    if T > 2:
        logits[1, 1] = float("nan")
        logits[2, : E // 2] = float("-inf")
    p = torch.softmax(logits.float(), dim=-1)
    want_ids = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :k]
    want = p.gather(1, want_ids)
    if renormalize:
        want = want / want.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    want = want * scale
    for view in (logits, logits.t().contiguous().t()):
        ids, weights = topk.softmax_topk(view, k, renormalize, 1e-20, scale)
        assert torch.equal(ids, want_ids)
        assert weights.dtype == torch.float32
        torch.testing.assert_close(weights, want, rtol=8 * 2.0**-23, atol=0, equal_nan=True)
    if T > 2:
        assert weights[1].isnan().all() and torch.equal(ids[1], torch.arange(k))


def test_softmax_topk_refuses_what_it_cannot_run(interpreted_kernels):
    topk = interpreted_kernels.topk
    with pytest.raises(ValueError, match=r"softmax_topk: needs \[T, E\] logits of .* got torch.int32 \[2, 4\], k=1"):
        topk.softmax_topk(torch.zeros(2, 4, dtype=torch.int32), 1, True, 1e-20, 1.0)
    with pytest.raises(ValueError, match=r"got torch.float32 \[2, 4\], k=5"):
        topk.softmax_topk(torch.zeros(2, 4), 5, True, 1e-20, 1.0)
    ids, w = topk.softmax_topk(torch.zeros(0, 8, dtype=torch.bfloat16), 2, True, 1e-20, 1.0)
    assert ids.shape == w.shape == (0, 2)
    assert not topk.routing_supported(torch.zeros(2, 4), 2)  # CPU logits keep the torch ops


def test_rows_of_128_scores_or_more_take_the_measured_tile(interpreted_kernels):
    """The tile follows scripts/topk_study.py: 2 rows on one warp from 128 columns (Qwen3's and
    DeepSeek-V3's rows, faster there), 16 rows on 4 warps below (Mixtral's, where the small tile
    was slower)."""
    topk = interpreted_kernels.topk
    assert [topk.tile(c) for c in (16, 32, 64)] == [(topk.ROWS, topk.WARPS)] * 3
    assert [topk.tile(c) for c in (128, 256, 1024)] == [topk.WIDE_TILE] * 3 == [(2, 1)] * 3


@pytest.fixture
def interpreter_exp(interpreted_kernels, monkeypatch):
    """Triton's interpreter has no libdevice: the kernel's accurate exponential (``__nv_expf``
    on the GPU, where tests/gpu compares the sigmoid's bits with torch's) runs as ``tl.exp`` here."""
    import types

    import triton.language as tl

    monkeypatch.setattr(interpreted_kernels.topk, "libdevice", types.SimpleNamespace(exp=lambda x: tl.exp(x)))


def _torch_sigmoid_routing(logits, k, bias, groups, renormalize, scale):
    """The router's torch ops for sigmoid routing (``router.select_experts``): scores, the biased
    choice, the groups' scores (best one, or the sum of the best two), the best groups kept by a
    stable sort, the others masked to -inf, the stable sort's top k, the unbiased weights."""
    T, E = logits.shape
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float().view(1, -1)
    if groups.count > 1:
        grouped = choice.view(T, groups.count, E // groups.count)
        top2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2]
        group_scores = top2[..., 0] if groups.by_max else top2.sum(dim=-1)
        keep = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :groups.keep]
        mask = torch.zeros(T, groups.count, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(E // groups.count, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return ids, weights * scale


@pytest.mark.parametrize("T,E,k,count,keep,by_max,with_bias,renormalize,scale", [
    (37, 256, 8, 8, 4, False, True, True, 2.5),  # DeepSeek-V3
    (9, 64, 6, 8, 3, True, True, False, 1.0),
    (17, 32, 4, 4, 2, False, False, True, 1.0),
    (3, 16, 12, 2, 1, False, True, True, 1.0),  # k past the kept experts: masked (-inf) ones taken last
    (5, 128, 8, 1, 1, False, True, True, 1.0),  # no groups (GLM-4.5's routing)
    (4, 60, 5, 1, 1, False, False, False, 1.0),
])
def test_sigmoid_topk_is_the_routers_sigmoid_routing(interpreted_kernels, interpreter_exp, T, E, k, count, keep,
                                                     by_max, with_bias, renormalize, scale):
    """Sigmoid routing in one pass (DeepSeek-V3's: the groups' scores, the best groups kept, the
    top k of the biased choice among them, the unbiased weights) picks what the router's torch ops
    pick: ties in the logits (rounded to a quarter), among the groups' scores (two equal groups)
    and among the scores; weights within an ulp of the sum's order. The sigmoid here is the
    interpreter's, not the GPU's, so the test compares its own scores' picks (the GPU test compares
    the bits with torch's CUDA ops)."""
    topk = interpreted_kernels.topk
    g = torch.Generator().manual_seed(T * E + k)
    logits = (torch.randn(T, E, generator=g) * 8).round() / 4
    if count > 1 and T > 1:
        logits[1, E // count:2 * E // count] = logits[1, :E // count]  # two groups with equal scores
    bias = (torch.randn(E, generator=g) * 0.05).round(decimals=3) if with_bias else None
    groups = topk.Groups(count, keep, by_max)
    ids, weights = topk.sigmoid_topk(logits, k, renormalize, 1e-20, scale, bias, groups)
    want_ids, want = _torch_sigmoid_routing(logits, k, bias, groups, renormalize, scale)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == torch.float32 and torch.allclose(weights, want, rtol=4 * 2.0**-23, atol=0)
    # bf16 logits are read as they are and widened in the kernel.
    ids16, _ = topk.sigmoid_topk(logits.bfloat16(), k, renormalize, 1e-20, scale, bias, groups)
    assert torch.equal(ids16, _torch_sigmoid_routing(logits.bfloat16(), k, bias, groups, renormalize, scale)[0])


def test_sigmoid_topk_refuses_what_it_cannot_run(interpreted_kernels, interpreter_exp):
    topk = interpreted_kernels.topk
    with pytest.raises(ValueError, match=r"sigmoid_topk: needs .* got torch.float32 \[2, 48\], k=2, bias None, "
                                         r"Groups\(count=4, keep=2, by_max=False\)"):
        topk.sigmoid_topk(torch.zeros(2, 48), 2, True, 1e-20, 1.0, None, topk.Groups(4, 2))  # 48: not a power of two
    with pytest.raises(ValueError, match=r"bias \[8\]"):
        topk.sigmoid_topk(torch.zeros(2, 16), 2, True, 1e-20, 1.0, torch.zeros(8))
    with pytest.raises(ValueError, match=r"Groups\(count=4, keep=5"):
        topk.sigmoid_topk(torch.zeros(2, 16), 2, True, 1e-20, 1.0, None, topk.Groups(4, 5))
    ids, w = topk.sigmoid_topk(torch.zeros(0, 16), 2, True, 1e-20, 1.0, None, topk.Groups(4, 2))
    assert ids.shape == w.shape == (0, 2)
    assert not topk.routing_supported(torch.zeros(2, 16), 2)  # CPU logits keep the torch ops


@pytest.mark.parametrize("T,E,k,count,keep,by_max,with_bias", [
    (33, 64, 6, 8, 3, True, False),  # DeepSeek-V2: groups scored by their best
    (9, 64, 8, 1, 1, False, True),  # ERNIE 4.5: a selection bias, no groups
    (17, 128, 8, 4, 2, False, True),  # softmax with both
])
def test_softmax_topk_with_bias_and_groups(interpreted_kernels, T, E, k, count, keep, by_max, with_bias):
    """Softmax routing with a selection bias or groups in one pass: the torch ops' picks from
    torch's softmax (the kernel's differs by rounding only; logits rounded to halves, so two
    experts' choices never sit an ulp apart unless equal), the weights the unbiased p within a
    few ulps."""
    topk = interpreted_kernels.topk
    g = torch.Generator().manual_seed(T * E + k)
    logits = (torch.randn(T, E, generator=g) * 6).round() / 2
    bias = (torch.randn(E, generator=g) * 0.05).round(decimals=3) if with_bias else None
    groups = topk.Groups(count, keep, by_max)
    p = torch.softmax(logits, dim=-1)
    choice = p if bias is None else p + bias.view(1, -1)
    if count > 1:
        grouped = choice.view(T, count, E // count)
        top2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2]
        group_scores = top2[..., 0] if by_max else top2.sum(dim=-1)
        kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :keep]
        mask = torch.zeros(T, count, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(E // count, dim=1), float("-inf"))
    want_ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    want = p.gather(1, want_ids)
    want = want / want.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    ids, weights = topk.softmax_topk(logits, k, True, 1e-20, 1.0, bias, groups)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want, rtol=8 * 2.0**-23, atol=0)

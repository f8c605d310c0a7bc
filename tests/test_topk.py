"""The router's one-pass top-k (``moeshard.kernels.topk``) through Triton's CPU interpreter,
against the stable descending sort it stands in for on CUDA: ties (scores rounded to a quarter,
as bf16 logits tie), NaN and infinities, one column, k = E, and the input checks."""

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
        s[0, 1] = s[0, 3] = float("nan")  # NaN ranks first, lower column first
        s[1 % T, 2] = float("inf")
        s[-1, : E // 2] = float("-inf")  # -inf columns are still scores, taken last
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

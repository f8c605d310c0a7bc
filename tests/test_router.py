"""Router against hand-computed cases."""

import math

import pytest
import torch

from moeshard.config import MoEConfig
from moeshard.router import route, route_tokens, router_logits


def cfg(**kw):
    base = dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    base.update(kw)
    return MoEConfig(**base)


def test_softmax_renormalized_mixtral():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    r = route(logits, cfg(renormalize=True))
    assert r.topk_ids.tolist() == [[1, 2]]
    # softmax then renormalise over the two chosen: e^3 / (e^3 + e^2), e^2 / (e^3 + e^2)
    w1 = math.exp(3) / (math.exp(3) + math.exp(2))
    assert r.topk_weights.dtype == torch.float32
    assert r.topk_weights[0].tolist() == pytest.approx([w1, 1 - w1], rel=1e-6)


def test_softmax_not_renormalized_qwen():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    r = route(logits, cfg(renormalize=False))
    z = sum(math.exp(v) for v in (1, 3, 2, 0))
    assert r.topk_ids.tolist() == [[1, 2]]
    assert r.topk_weights[0].tolist() == pytest.approx([math.exp(3) / z, math.exp(2) / z], rel=1e-6)


def test_ties_go_to_lower_index():
    logits = torch.tensor([[2.0, 5.0, 5.0, 5.0], [1.0, 1.0, 1.0, 1.0]])
    r = route(logits, cfg())
    assert r.topk_ids.tolist() == [[1, 2], [0, 1]]
    assert r.topk_weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_bf16_logits_give_fp32_weights():
    r = route(torch.randn(5, 4, dtype=torch.bfloat16), cfg())
    assert r.topk_weights.dtype == torch.float32 and r.topk_ids.dtype == torch.int64
    assert torch.allclose(r.topk_weights.sum(-1), torch.ones(5))


def test_sigmoid_bias_selects_but_does_not_weigh():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    c = cfg(scoring="sigmoid", use_correction_bias=True, renormalize=False)
    r = route(logits, c, bias)
    # biased: [0.5, 0.73, 0.88, 5.27] -> experts 3 and 2; weights are the unbiased sigmoids
    assert r.topk_ids.tolist() == [[3, 2]]

    def sig(v: float) -> float:
        return 1 / (1 + math.exp(-v))

    assert r.topk_weights[0].tolist() == pytest.approx([sig(-1.0), sig(2.0)], rel=1e-6)


def test_grouped_topk_and_scaling_deepseek():
    # 8 experts in 4 groups of 2; keep the best 2 groups (scored by the sum of their top-2).
    logits = torch.tensor([[0.0, 0.1, 3.0, -3.0, 1.0, 1.0, -1.0, 2.5]])
    c = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, scoring="sigmoid",
                  n_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5)
    r = route(logits, c)
    s = torch.sigmoid(logits[0]).tolist()
    groups = [s[0] + s[1], s[2] + s[3], s[4] + s[5], s[6] + s[7]]
    # group sums: g0=1.025, g1=1.000, g2=1.462, g3=1.193 -> keep g2, g3; expert 2 (best overall) is excluded
    assert sorted(range(4), key=lambda g: -groups[g])[:2] == [2, 3]
    assert r.topk_ids.tolist() == [[7, 4]]
    w = [s[7] / (s[7] + s[4]) * 2.5, s[4] / (s[7] + s[4]) * 2.5]
    assert r.topk_weights[0].tolist() == pytest.approx(w, rel=1e-6)


def test_grouped_topk_group_tie_lower_group_wins():
    logits = torch.zeros(1, 8)
    c = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, scoring="sigmoid",
                  n_group=4, topk_group=1, renormalize=False)
    assert route(logits, c).topk_ids.tolist() == [[0, 1]]


def test_zero_tokens():
    r = route(torch.zeros(0, 4), cfg())
    assert r.topk_ids.shape == (0, 2) and r.topk_weights.shape == (0, 2)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="num_experts=4"):
        route(torch.zeros(3, 5), cfg())
    with pytest.raises(ValueError, match="correction_bias"):
        route(torch.zeros(3, 4), cfg(scoring="sigmoid", use_correction_bias=True))


def test_router_precision_fp32_or_the_model_dtype():
    """router_dtype "fp32": the fp32 product; "model": the product in the model dtype, rounded to
    it (bias inside), widened: what F.linear in bf16 computes. In an fp32 model both agree."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g).bfloat16()
    w = (torch.randn(8, 32, generator=g) / 4).bfloat16()
    b = torch.randn(8, generator=g).bfloat16()
    wide = router_logits(x, w, "fp32")
    assert wide.dtype == torch.float32 and torch.equal(wide, x.float() @ w.float().T)
    rounded = router_logits(x, w, "model", b)
    assert rounded.dtype == torch.float32 and torch.equal(rounded, torch.nn.functional.linear(x, w, b).float())
    assert torch.equal(rounded, rounded.bfloat16().float()) and not torch.equal(rounded, wide + b.float())
    assert torch.equal(router_logits(x.float(), w.float(), "model"), router_logits(x.float(), w.float(), "fp32"))
    # widen=False keeps the model dtype (what route_tokens hands select_experts): the same values.
    narrow = router_logits(x, w, "model", b, widen=False)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow.float(), rounded)
    assert router_logits(x, w, "fp32", widen=False).dtype == torch.float32
    with pytest.raises(ValueError, match=r"router_logits: router_dtype 'bf16' is not one of \['fp32', 'model'\]"):
        router_logits(x, w, "bf16")


def test_route_tokens_routes_the_logits_of_the_configs_precision():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=g).bfloat16()
    w = torch.randn(8, 32, generator=g).bfloat16()
    for router_dtype in ("fp32", "model"):
        c = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=8, router_dtype=router_dtype)
        got = route_tokens(x, w, c)
        want = route(router_logits(x, w, router_dtype), c)
        assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_weights, want.topk_weights)
        # Off CUDA, model-dtype logits are widened before routing: the Routing carries fp32 logits.
        assert got.logits is not None and got.logits.dtype == torch.float32
    # bf16 logits tie often (ties go to the lower index): the two precisions choose differently
    model = route_tokens(x, w, MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=8,
                                         router_dtype="model"))
    fp32 = route_tokens(x, w, MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=8))
    assert (model.topk_ids != fp32.topk_ids).any()
    with pytest.raises(ValueError, match=r"route_tokens: the router weight must be \[num_experts=4, H\], got \(8, 32\)"):
        route_tokens(x, w, cfg())

"""The routing kinds of ERNIE 4.5 (``softmax_bias``), Phi-3.5-MoE (``sparsemixer``) and
Cohere2-MoE's sigmoid selection (``topk_sigmoid``): routes computed by hand, the same routes as
transformers' own routers, their refusals, and the layer against the reference on each kind."""

import math

import pytest
import torch

from moeshard.config import MoEConfig
from moeshard.layer import MoELayer
from moeshard.presets import PRESETS
from moeshard.reference import reference_forward
from moeshard.router import route
from moeshard.routing import RoutingKind, get_routing, register_routing
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights


def cfg(scoring: str, **kw) -> MoEConfig:
    defaults = {"softmax_bias": dict(use_correction_bias=True), "sparsemixer": dict(renormalize=False),
                "topk_sigmoid": {}}[scoring]
    return MoEConfig(**{"num_experts": 4, "top_k": 2, "hidden_size": 8, "intermediate_size": 8, "scoring": scoring,
                        **defaults, **kw})


def test_softmax_bias_selects_on_biased_scores_and_weighs_the_unbiased():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    p = logits[0].softmax(dim=-1).tolist()  # [0.032, 0.087, 0.237, 0.644]
    r = route(logits, cfg("softmax_bias"), correction_bias=torch.tensor([0.9, 0.0, 0.0, 0.0]))
    # biased [0.932, 0.087, 0.237, 0.644]: experts 0 and 3; weights p0, p3 renormalized
    assert r.topk_ids.tolist() == [[0, 3]]
    assert r.topk_weights[0].tolist() == pytest.approx([p[0] / (p[0] + p[3]), p[3] / (p[0] + p[3])], rel=1e-6)
    with pytest.raises(ValueError, match="use_correction_bias is True but no correction_bias was given"):
        route(logits, cfg("softmax_bias"))


def test_softmax_bias_divides_by_the_floor_when_the_chosen_weights_are_tiny():
    # The bias picks experts 1 and 2, whose probabilities are e^-40 / (1 + 3 e^-40) ~ 4.2e-18 each:
    # their sum is below ERNIE's moe_norm_min 1e-12, so the weights are p / 1e-12, not 1/2 each.
    logits = torch.tensor([[0.0, -40.0, -40.0, -40.0]])
    r = route(logits, cfg("softmax_bias"), correction_bias=torch.tensor([0.0, 2.0, 2.0, 0.0]))
    p = math.exp(-40) / (1 + 3 * math.exp(-40))
    assert r.topk_ids.tolist() == [[1, 2]]
    assert get_routing("softmax_bias").weight_floor == 1e-12
    assert r.topk_weights[0].tolist() == pytest.approx([p / 1e-12] * 2, rel=1e-5)


def test_sparsemixer_by_hand():
    logits = torch.tensor([[1.0, 0.995, 0.5, -2.0], [-1.0, -1.01, -3.0, -1.005]])
    r = route(logits, cfg("sparsemixer"))
    # Row 0, round 1: m = 1 (expert 0); (m - s) / max(|s|, m) = [0, .005, .5, 1.5]; experts 0, 1 lie
    # within 2 * 0.01: weight softmax([1, .995])[0]. Round 2: m = .995 (expert 1); expert 0 is
    # taken, 2 and 3 are far: weight 1.
    # Row 1, round 1: m = -1 (expert 0); distances / |s| = [0, .0099, .667, .004975]: experts 0, 1, 3;
    # round 2: m = -1.005 (expert 3); expert 1 at .00495 stays: weight softmax([-1.01, -1.005])[1].
    assert r.topk_ids.tolist() == [[0, 1], [0, 3]]
    assert r.topk_weights.tolist()[0] == pytest.approx([1 / (1 + math.exp(-0.005)), 1.0], rel=1e-6)
    assert r.topk_weights.tolist()[1] == pytest.approx(
        [1 / (1 + math.exp(-0.01) + math.exp(-0.005)), 1 / (1 + math.exp(-0.005))], rel=1e-6)


def test_sparsemixer_equals_transformers_phimoe():
    phimoe = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    g = torch.Generator().manual_seed(0)
    # Logits with a shared part, so that many rows have several experts within the window.
    logits = 3 * torch.randn(256, 1, generator=g) + 0.03 * torch.randn(256, 16, generator=g)
    c = MoEConfig(num_experts=16, top_k=2, hidden_size=8, intermediate_size=8, scoring="sparsemixer",
                  renormalize=False)
    r = route(logits, c)
    weights, ids = phimoe.sparsemixer(logits, jitter_eps=0.01, training=False, top_k=2)
    assert torch.equal(r.topk_ids, ids)
    assert torch.allclose(r.topk_weights, weights, rtol=1e-6, atol=0)
    assert (r.topk_weights < 0.9).float().mean() > 0.2  # the window matters for many rows


def test_softmax_bias_equals_transformers_ernie_router():
    ernie = pytest.importorskip("transformers.models.ernie4_5_moe.modeling_ernie4_5_moe")
    tf = pytest.importorskip("transformers")
    config = tf.Ernie4_5_MoeConfig(hidden_size=16, moe_num_experts=8, moe_k=3)
    router = ernie.Ernie4_5_MoeTopKRouter(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
        router.moe_statics.e_score_correction_bias.copy_(torch.rand(1, 8, generator=g) / 4)
    x = torch.randn(64, 16, generator=g)
    logits, weights, ids = router(x)
    c = MoEConfig(num_experts=8, top_k=3, hidden_size=16, intermediate_size=8, scoring="softmax_bias",
                  use_correction_bias=True)
    r = route(logits, c, correction_bias=router.moe_statics.e_score_correction_bias.detach().reshape(-1))
    assert torch.equal(r.topk_ids, ids)
    assert torch.allclose(r.topk_weights, weights, rtol=1e-6, atol=0)
    unbiased = route(logits, c, correction_bias=torch.zeros(8)).topk_ids
    assert (unbiased != ids).any()  # the bias changed some choices


def test_topk_sigmoid_by_hand_and_as_cohere2_moe_routes():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    s2, s1 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(-1))
    r = route(logits, cfg("topk_sigmoid", renormalize=False))
    assert r.topk_ids.tolist() == [[1, 3]] and r.topk_weights[0].tolist() == pytest.approx([s2, s1], rel=1e-6)
    r = route(logits, cfg("topk_sigmoid"))
    assert r.topk_weights[0].tolist() == pytest.approx([s2 / (s1 + s2), s1 / (s1 + s2)], rel=1e-6)
    cohere = pytest.importorskip("transformers.models.cohere2_moe.modeling_cohere2_moe")
    tf = pytest.importorskip("transformers")
    config = tf.Cohere2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, expert_selection_fn="sigmoid")
    router = cohere.Cohere2MoeTopKRouter(config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
    logits, weights, ids = router(torch.randn(64, 16, generator=g))
    c = MoEConfig(num_experts=8, top_k=3, hidden_size=16, intermediate_size=8, scoring="topk_sigmoid")
    got = route(logits, c)
    assert torch.equal(got.topk_ids, ids) and torch.allclose(got.topk_weights, weights, rtol=1e-6, atol=0)


def test_kinds_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="routed_scaling_factor: scoring='softmax_bias' has no routed scaling"):
        cfg("softmax_bias", routed_scaling_factor=2.0)
    with pytest.raises(ValueError, match="n_group: scoring='sparsemixer' has no group top-k"):
        cfg("sparsemixer", n_group=2)
    with pytest.raises(ValueError, match="use_correction_bias: only defined for"):
        cfg("sparsemixer", use_correction_bias=True)
    base = get_routing("sparsemixer")
    with pytest.raises(ValueError, match="order 'masked_rounds' selects on the logits alone"):
        register_routing(RoutingKind("bad", "softmax", "masked_rounds", "max", False, False, False, 1e-20, False, "x",
                                     mask_eps=0.01))
    with pytest.raises(ValueError, match="mask_eps must be a float in \\(0, 1\\) with order 'masked_rounds' and 0.0 "
                                         "otherwise, got 0.0 with order 'masked_rounds'"):
        register_routing(RoutingKind("bad", base.scores, base.order, None, False, False, False, 1e-20, False, "x"))
    with pytest.raises(ValueError, match="got 0.01 with order 'score_then_topk'"):
        register_routing(RoutingKind("bad", "softmax", "score_then_topk", None, False, False, False, 1e-20, False, "x",
                                     mask_eps=0.01))


@pytest.mark.parametrize("preset", ["ernie-4.5-21b-a3b", "phi-3.5-moe", "cohere2-moe"])
def test_layer_equals_reference(preset):
    c = PRESETS[preset].config("small")
    torch.manual_seed(0)
    w = MoEWeights.random(c)
    x = torch.randn(24, c.hidden_size)
    layer = MoELayer.from_state_dict(w.state_dict(), c)
    assert compare(layer(x), reference_forward(x, w, c), c.dtype, "none")[3]

"""Routing kinds are a registry read by MoEConfig and the router: hand-computed routes of the
kinds beyond today's softmax / sigmoid ones, refusals naming the values, and a kind added as data."""

import math
import re

import pytest
import torch

from moeshard.config import MoEConfig
from moeshard.layer import MoELayer
from moeshard.reference import reference_forward
from moeshard.router import route
from moeshard.routing import RoutingKind, get_routing, register_routing, routing_names, unregister_routing
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights


def cfg(**kw) -> MoEConfig:
    return MoEConfig(**{"num_experts": 4, "top_k": 2, "hidden_size": 8, "intermediate_size": 8, **kw})


def test_builtin_kinds():
    assert routing_names()[:4] == ("softmax", "sigmoid", "topk_softmax", "group_limited_greedy")


def test_topk_softmax_scores_only_the_selected_logits():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0], [1.0, 3.0, 2.0, 3.0]])
    r = route(logits, cfg(scoring="topk_softmax", renormalize=False))
    # row 0: top logits 2 (expert 1), 1 (expert 3); weights softmax([2, 1]) = [e / (e + 1), 1 / (e + 1)]
    # row 1: experts 1 and 3 tie at 3.0 (lower index first); softmax([3, 3]) = [1/2, 1/2]
    assert r.topk_ids.tolist() == [[1, 3], [1, 3]]
    e = math.e
    assert r.topk_weights.tolist()[0] == pytest.approx([e / (e + 1), 1 / (e + 1)], rel=1e-6)
    assert r.topk_weights.tolist()[1] == [0.5, 0.5]
    # softmax over all four experts without renormalization gives other weights for the same ids
    full = route(logits, cfg(scoring="softmax", renormalize=False))
    assert full.topk_ids.tolist() == r.topk_ids.tolist()
    assert full.topk_weights[0].tolist() == pytest.approx([e**2 / (1 + e**2 + e**-1 + e), e / (1 + e**2 + e**-1 + e)])
    assert r.topk_weights.dtype == torch.float32


def test_group_limited_greedy_scores_a_group_by_its_best_expert():
    # 8 experts in 4 groups of 2, keep 2 groups. Best expert per group: g0 0.1, g1 3.0, g2 2.0, g3 2.5
    # -> keep g1, g3 -> experts 2 (3.0) and 7 (2.5). Scored by the sum of the best two (the softmax
    # kind's grouping), g2 (2 x e^2 = 14.8) beats g3 (e^-1 + e^2.5 = 12.6): experts 2 and 4.
    logits = torch.tensor([[0.0, 0.1, 3.0, -3.0, 2.0, 2.0, -1.0, 2.5]])
    shape = dict(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, n_group=4, topk_group=2,
                 renormalize=False)
    greedy = route(logits, MoEConfig(scoring="group_limited_greedy", **shape))
    summed = route(logits, MoEConfig(scoring="softmax", **shape))
    p = logits[0].softmax(dim=-1).tolist()
    assert greedy.topk_ids.tolist() == [[2, 7]] and summed.topk_ids.tolist() == [[2, 4]]
    assert greedy.topk_weights[0].tolist() == pytest.approx([p[2], p[7]], rel=1e-6)


def test_config_refuses_what_a_kind_cannot_do():
    with pytest.raises(ValueError, match=r"MoEConfig.scoring: 'tanh' is not one of \['softmax', 'sigmoid', 'topk_softmax'"):
        cfg(scoring="tanh")
    with pytest.raises(ValueError, match=r"n_group: scoring='topk_softmax' has no group top-k, got n_group=2"):
        cfg(scoring="topk_softmax", n_group=2)
    with pytest.raises(ValueError, match=r"use_correction_bias: only defined for scoring='sigmoid'( or '\w+')*, "
                                         r"got scoring='topk_softmax'"):
        cfg(scoring="topk_softmax", use_correction_bias=True)
    # A group scored by its best two needs two experts, whichever scores the kind computes: softmax
    # with one expert per group was accepted and then failed inside the forward (top-2 of one).
    for scoring in ("softmax", "sigmoid"):
        with pytest.raises(ValueError, match=rf"n_group: {scoring} grouped top-k scores a group by its best two "
                                             r"experts, but n_group=4 leaves 1 expert per group"):
            cfg(scoring=scoring, n_group=4, topk_group=2)
    cfg(scoring="group_limited_greedy", n_group=4, topk_group=2)  # scored by its best one: one expert will do


def test_topk_sigmoid_biased_selects_on_the_biased_logits_and_weighs_the_unbiased():
    """Kolibri-1's routing: the selection bias is added to the logits (not to the sigmoid scores,
    as DeepSeek-V3's sigmoid kind adds it), and the weights are the sigmoid of the chosen
    experts' unbiased logits."""
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    bias = torch.tensor([0.6, 0.0, 0.0, 0.0])
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    r = route(logits, cfg(scoring="topk_sigmoid_biased", use_correction_bias=True, renormalize=False), bias)
    # biased logits [0.6, 2, -1, 1]: experts 1 and 3, weighed sigmoid(2) and sigmoid(1)
    assert r.topk_ids.tolist() == [[1, 3]]
    assert r.topk_weights[0].tolist() == pytest.approx([sig(2.0), sig(1.0)], rel=1e-6)
    normed = route(logits, cfg(scoring="topk_sigmoid_biased", use_correction_bias=True, renormalize=True), bias)
    assert normed.topk_weights[0].tolist() == pytest.approx([sig(2.0) / (sig(2.0) + sig(1.0)),
                                                             sig(1.0) / (sig(2.0) + sig(1.0))], rel=1e-6)
    # The same bias on the sigmoid scores [0.5, 0.88, 0.27, 0.73] picks experts 0 and 1 instead.
    scores = route(logits, cfg(scoring="sigmoid", use_correction_bias=True, renormalize=False), bias)
    assert scores.topk_ids.tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="cfg.use_correction_bias is True but no correction_bias was given"):
        route(logits, cfg(scoring="topk_sigmoid_biased", use_correction_bias=True))
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        cfg(scoring="topk_sigmoid_biased", use_correction_bias=True, routed_scaling_factor=2.0)
    with pytest.raises(ValueError, match="a selection bias \\(correction_bias=True\\) has no place in its rounds"):
        register_routing(RoutingKind("bad", "softmax", "masked_rounds", None, True, False, False, 1e-20, False, "x",
                                     mask_eps=0.01))


def test_a_kind_added_as_data():
    """A router with a bias (gpt-oss's router linear): registered here, route requires the bias."""
    base = get_routing("topk_softmax")
    kind = register_routing(RoutingKind("toy_biased", base.scores, base.order, None, False, True, True,
                                        base.weight_floor, False, "topk_softmax on logits + router bias"))
    try:
        c = cfg(scoring=kind.name, renormalize=False)
        logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
        with pytest.raises(ValueError, match="has router_bias=True, but a router bias was not given"):
            route(logits, c)
        r = route(logits, c, router_bias=torch.tensor([0.0, 0.0, 5.0, 0.0]))
        assert r.topk_ids.tolist() == [[2, 1]]  # biased logits [0, 2, 4, 1]
        assert r.topk_weights[0].tolist() == pytest.approx([math.e**2 / (math.e**2 + 1), 1 / (math.e**2 + 1)])
        with pytest.raises(ValueError, match="a routing kind of that name is registered already"):
            register_routing(kind)
        with pytest.raises(ValueError, match="order 'topk_then_score' selects on the logits alone"):
            register_routing(RoutingKind("bad", "softmax", "topk_then_score", "max", False, False, True, 1e-20,
                                         False, "groups need all scores"))
    finally:
        unregister_routing("toy_biased")


@pytest.mark.parametrize("scoring", ["topk_softmax", "group_limited_greedy"])
def test_new_kinds_through_layer_and_reference(scoring):
    c = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32, scoring=scoring,
                  n_group=4 if scoring == "group_limited_greedy" else 1, topk_group=2 if scoring != "topk_softmax" else 1,
                  renormalize=False)
    torch.manual_seed(0)
    w = MoEWeights.random(c)
    x = torch.randn(10, 16)
    layer = MoELayer.from_state_dict(w.state_dict(), c)
    assert compare(layer(x), reference_forward(x, w, c), c.dtype, "none")[3]


def test_renormalize_follows_the_kinds_rule():
    """A config that omits ``renormalize`` gets what its routing kind does. The trap this guards:
    Llama-4's top-1 sigmoid, renormalized, would weight every token's expert by exactly 1.0."""
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    llama4 = cfg(top_k=1, scoring="topk_sigmoid_input")
    assert llama4.renormalize is False
    r = route(logits, llama4)
    assert r.topk_ids.tolist() == [[2]]
    assert r.topk_weights[0].tolist() == pytest.approx([1 / (1 + math.exp(-2.0))], rel=1e-6)
    assert cfg(scoring="softmax").renormalize is True  # Mixtral's default, as before
    assert cfg(scoring="softmax_bias").renormalize is True
    for name in ("topk_softmax", "topk_softmax_bias", "sparsemixer"):
        assert cfg(scoring=name).renormalize is False
    assert cfg(scoring="softmax", renormalize=False).renormalize is False  # Qwen's norm_topk_prob=False


@pytest.mark.parametrize("scoring,value,message", [
    ("topk_sigmoid_input", True, "routing kind 'topk_sigmoid_input' never renormalizes its weights"),
    ("topk_softmax", True, "routing kind 'topk_softmax' never renormalizes its weights"),
    ("sparsemixer", True, "routing kind 'sparsemixer' never renormalizes its weights"),
    ("softmax_bias", False, "routing kind 'softmax_bias' always renormalizes its weights, got False"),
    ("softmax", "yes", "MoEConfig.renormalize: must be a bool, got 'yes'"),
])
def test_renormalize_the_kind_does_not_allow_is_refused(scoring, value, message):
    with pytest.raises(ValueError) as info:
        cfg(scoring=scoring, renormalize=value)
    assert str(info.value).startswith("MoEConfig.renormalize: ") and message in str(info.value)


@pytest.mark.parametrize("field, value, allowed", [("renormalize", "sometimes", "['optional', 'always', 'never']"),
                                                   ("score_dtype", "bf16", "['fp32', 'model']")])
def test_a_kinds_rules_are_checked_at_registration(field, value, allowed):
    base = get_routing("softmax")
    with pytest.raises(ValueError, match=rf"register_routing\('bad'\): {field} '{value}' is not one of "
                                         rf"{re.escape(allowed)}"):
        register_routing(RoutingKind("bad", base.scores, base.order, None, False, False, True, base.weight_floor,
                                     False, "x", **{field: value}))
    assert "bad" not in routing_names()


def test_replace_carries_renormalize_and_none_takes_the_new_kinds_rule():
    """The resolved value is stored, so ``replace`` carries it to a new scoring; ``None`` asks for
    the new kind's rule (a carried True is refused by a kind that never renormalizes)."""
    from dataclasses import replace

    mixtral = cfg(scoring="softmax")
    with pytest.raises(ValueError, match="routing kind 'topk_softmax' never renormalizes its weights"):
        replace(mixtral, scoring="topk_softmax")
    assert replace(mixtral, scoring="topk_softmax", renormalize=None).renormalize is False
    assert replace(cfg(scoring="topk_softmax"), scoring="softmax", renormalize=None).renormalize is True


# -- kinds that score in the model dtype (DBRX, LFM2-MoE) --------------------------------------
def _bf16(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16)


def test_sigmoid_bias_model_divides_by_the_sum_plus_its_floor():
    """fp32 model: s = sigmoid(logits) = [0.119, 0.881, 0.269, 0.731]; with the bias [0, 0, 0.7,
    0.3] the choice is [0.119, 0.881, 0.969, 1.031], so experts 3 and 2 (1 and 3 without it);
    the weights are their unbiased s over (s3 + s2 + 1e-6), times 1.5: the added 1e-6 moves each
    weight by about 1e-6 relative, which a max(sum, floor) denominator would not."""
    logits = torch.tensor([[-2.0, 2.0, -1.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 0.7, 0.3])
    c = cfg(scoring="sigmoid_bias_model", use_correction_bias=True, routed_scaling_factor=1.5, router_dtype="model")
    r = route(logits, c, bias)
    s = [1 / (1 + math.exp(-v)) for v in (-2.0, 2.0, -1.0, 1.0)]
    assert r.topk_ids.tolist() == [[3, 2]]
    total = s[3] + s[2] + 1e-6
    assert r.topk_weights[0].tolist() == pytest.approx([1.5 * s[3] / total, 1.5 * s[2] / total], rel=2e-7, abs=0)
    clamped = [1.5 * s[3] / (s[3] + s[2]), 1.5 * s[2] / (s[3] + s[2])]
    assert all(abs(a - b) > 5e-7 * b for a, b in zip(r.topk_weights[0].tolist(), clamped, strict=True))


def test_sigmoid_bias_model_rounds_every_step_to_the_model_dtype():
    """bf16 model: each step rounds to bf16 as LFM2-MoE's router computes it (sigmoid, the sum,
    the sum plus 1e-6, the quotient, the scaling); the bias is added in fp32 (an fp32 buffer)."""
    logits = _bf16([[0.3, 1.7, -0.4, 1.1, 0.9, -2.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0])
    c = MoEConfig(num_experts=6, top_k=3, hidden_size=8, intermediate_size=8, scoring="sigmoid_bias_model",
                  use_correction_bias=True, routed_scaling_factor=2.5, router_dtype="model", dtype=torch.bfloat16)
    r = route(logits, c, bias)
    rnd = lambda v: float(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16))  # noqa: E731
    s = [rnd(1 / (1 + math.exp(-float(v)))) for v in logits[0]]
    assert r.topk_ids.tolist() == [[1, 4, 3]]  # s(1.7); s(0.9) + 0.05 = 0.761 over s(1.1) = 0.750; not s(0.3)
    total = rnd(rnd(s[1] + s[4] + s[3]) + 1e-6)
    want = [rnd(rnd(s[e] / total) * 2.5) for e in (1, 4, 3)]
    assert r.topk_weights.dtype == torch.float32 and r.topk_weights[0].tolist() == want
    wide = MoEConfig(num_experts=6, top_k=3, hidden_size=8, intermediate_size=8, scoring="sigmoid",
                     use_correction_bias=True, routed_scaling_factor=2.5, router_dtype="model", dtype=torch.bfloat16)
    assert route(logits, wide, bias).topk_weights[0].tolist() != want  # fp32 scoring: other weights


def test_softmax_model_selects_on_the_rounded_probabilities():
    """bf16 softmax probabilities of two different logits can round to one value: the kind then
    ties them and takes the lower expert, where fp32 scoring takes the larger logit; the weights
    are the bf16 probabilities over their bf16 sum."""
    logits = _bf16([[0.0, -2.0, 2.0**-10, -3.0]])  # expert 2's logit above expert 0's
    c = MoEConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8, scoring="softmax_model",
                  renormalize=False, router_dtype="model", dtype=torch.bfloat16)
    p = logits.softmax(dim=-1)
    assert p[0, 0] == p[0, 2] and logits[0, 0] < logits[0, 2]
    r = route(logits, c)
    assert r.topk_ids.tolist() == [[0]] and r.topk_weights[0].tolist() == [float(p[0, 0])]
    fp32 = MoEConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8, scoring="softmax",
                     renormalize=False, router_dtype="model", dtype=torch.bfloat16)
    assert route(logits, fp32).topk_ids.tolist() == [[2]]
    two = route(logits, MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, scoring="softmax_model",
                                  router_dtype="model", dtype=torch.bfloat16))
    rnd = lambda v: float(torch.tensor(v).to(torch.bfloat16))  # noqa: E731
    total = rnd(2 * float(p[0, 0]))
    assert two.topk_ids.tolist() == [[0, 2]] and two.topk_weights[0].tolist() == [rnd(float(p[0, 0]) / total)] * 2


def test_a_kind_that_scores_in_the_model_dtype_needs_model_dtype_logits():
    with pytest.raises(ValueError, match=r"MoEConfig.router_dtype: scoring='softmax_model' scores in the model dtype, "
                                         r"from logits computed in it; router_dtype must be 'model', got 'fp32'"):
        cfg(scoring="softmax_model")


@pytest.mark.parametrize("scoring", ["softmax_model", "sigmoid_bias_model"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_dtype_kinds_through_layer_and_reference(scoring, dtype):
    c = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32, scoring=scoring,
                  use_correction_bias=scoring == "sigmoid_bias_model", router_dtype="model", dtype=dtype,
                  routed_scaling_factor=1.5 if scoring == "sigmoid_bias_model" else 1.0)
    torch.manual_seed(0)
    w = MoEWeights.random(c)
    x = torch.randn(10, 16).to(dtype)
    layer = MoELayer.from_state_dict(w.state_dict(), c)
    assert compare(layer(x), reference_forward(x, w, c), c.dtype, "none")[3]

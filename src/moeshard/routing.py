"""Routing kinds: how router logits become top-k experts and their weights, one descriptor each.

``MoEConfig.scoring`` names a registered kind; ``MoEConfig`` validates its other routing fields
against the kind (which of groups, correction bias, scaling it allows), and ``router.route``
(the layer, the reference and the harness all route through it) dispatches on the kind's fields.

=====================  ==========================================================================
kind                   selection and weights (E experts, K top_k, G = n_group groups)
=====================  ==========================================================================
softmax                p = softmax(logits); top K of p; optional renormalization (Mixtral,
                       Qwen2/Qwen3-MoE ``norm_topk_prob``)
sigmoid                s = sigmoid(logits); top K of s + correction bias (selection only), the
                       weights are s; groups scored by their best two; optional
                       renormalization; routed scaling (DeepSeek-V3 ``noaux_tc``)
topk_softmax           top K of the logits; weights = softmax over the K selected logits
                       (gpt-oss, Granite)
group_limited_greedy   p = softmax(logits); groups scored by their best expert, the best
                       ``topk_group`` kept; top K of p among them (DeepSeek-V2)
topk_softmax_bias      logits = x W^T + b (the router has a bias); then as topk_softmax (gpt-oss)
topk_sigmoid_input     top K of the logits; weights = sigmoid of the K selected logits, applied to
                       the expert's *input*: expert(w * x), not w * expert(x) (Llama-4)
topk_sigmoid           top K of the logits; weights = sigmoid of the K selected logits, optional
                       renormalization (Cohere2-MoE ``expert_selection_fn="sigmoid"``)
topk_sigmoid_biased    top K of the logits + selection bias; weights = sigmoid of the K selected
                       unbiased logits, optional renormalization (Kolibri-1)
softmax_bias           p = softmax(logits); top K of p + correction bias (selection only), the
                       weights are p, renormalized with the floor 1e-12 (ERNIE 4.5
                       ``moe_statics.e_score_correction_bias``, ``moe_norm_min``)
sparsemixer            K rounds on the logits s: the best remaining expert i (logit m) is picked
                       and weighted by its softmax share among the remaining experts j with
                       (m - s_j) / max(|s_j|, m) <= 2 * mask_eps, mask_eps 0.01 (Phi-3.5-MoE in
                       eval: sparsemixer without its training-time sampling)
softmax_model          as softmax, every step in the model dtype (DBRX: ``softmax(logits,
                       dtype=logits.dtype)``, top K, divided by their sum, the 1-norm)
softmax_group_model    as softmax_model, with DeepSeek-V3's group top-k (groups scored by their best
                       two, the best ``topk_group`` kept), the weights divided by their sum plus
                       1e-20 and routed scaling, every step in the model dtype (Mistral Small 4)
sigmoid_bias_model     s = sigmoid(logits) in the model dtype; top K of s + selection bias (the
                       sum in fp32), the weights are s; optionally divided by their sum plus
                       1e-6; routed scaling; every other step in the model dtype (LFM2-MoE)
sqrtsoftplus_bias_     s = sqrt(softplus(logits)) in the model dtype; top K of s + selection bias
model                  (the sum in fp32); the weights are s divided by their sum plus 1e-20;
                       routed scaling; every step but the selection in the model dtype
                       (DeepSeek-V4's learned routers)
=====================  ==========================================================================

``router_bias``: the router is a linear with a bias, ``route`` needs the bias and adds it to the
logits. ``weights_on_input``: the weight scales the expert's input (rounded to the model dtype,
as the family does) and the expert's output is summed unweighted; the layer, the reference and
the harness apply it. ``weight_floor`` is the floor of the renormalization's denominator, or
(``floor_added``) a constant added to it.

``score_dtype``: "fp32" computes everything after the logits in fp32 (most families: their
routers widen the logits first); "model" computes the scores, the renormalization and the
scaling with torch's ops in the model dtype, each rounding to it, as the family's router does
(``router.select_experts``; a selection bias is added in fp32, where the layer holds it), and
only the final weights are widened.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeshard.registry import Registry

SCORES = ("softmax", "sigmoid", "sqrt_softplus")
# score_then_topk: select on the scores of all E experts; topk_then_score: select on the logits,
# then score the K selected among themselves; masked_rounds: K rounds, each selecting the best
# remaining logit and scoring it among the remaining logits near it (``mask_eps``).
ORDERS = ("score_then_topk", "topk_then_score", "masked_rounds")
# How a group of experts is scored for group top-k: the sum of its best two, or its best one.
GROUP_SCORES = ("top2_sum", "max")
# Whether the K weights may be divided by their sum: the config's choice, always, or never.
RENORMALIZATION = ("optional", "always", "never")
# The precision of the scores and weights: fp32, or the model dtype (each op rounding to it).
SCORE_DTYPES = ("fp32", "model")


@dataclass(frozen=True)
class RoutingKind:
    """One routing kind.

    name: the ``MoEConfig.scoring`` value.
    scores: ``SCORES`` ("softmax" | "sigmoid" | "sqrt_softplus": sqrt(softplus(x))), applied to the
      fp32 logits [T, E] (or, with
      ``order="topk_then_score"``, to the K selected logits [T, K]).
    order: ``ORDERS``.
    groups: None (``n_group`` must be 1) or how a group is scored (``GROUP_SCORES``).
    correction_bias: ``use_correction_bias`` is allowed (a bias [E] added for selection only: to
      the scores with ``order="score_then_topk"``, to the logits with ``"topk_then_score"``).
    router_bias: the logits come from a router with a bias [E]; ``route`` requires it.
    scaling: ``routed_scaling_factor`` other than 1 is allowed.
    weight_floor: renormalization divides by ``max(sum of the K weights, weight_floor)``, or with
      ``floor_added`` by ``sum + weight_floor`` (LFM2-MoE's ``sum + 1e-6``, which moves an fp32
      weight by a relative 1e-6).
    weights_on_input: the weight multiplies the expert's input rather than its output.
    summary: one line for listings.
    mask_eps: with ``order="masked_rounds"``, a round scores the picked expert among the
      remaining ones whose logit s_j is near the pick's m: ``(m - s_j) / max(|s_j|, m) <= 2 *
      mask_eps``; 0 for the other orders.
    renormalize: ``RENORMALIZATION``: whether ``MoEConfig.renormalize`` is the family's choice
      ("optional"; True when not given, as Mixtral), fixed on ("always": the family always
      divides by the sum) or fixed off ("never": the weights are final as scored, e.g. a
      softmax over the selected logits already sums to 1, and Llama-4's top-1 sigmoid would
      become 1.0). ``MoEConfig`` fills in an omitted ``renormalize`` from it and refuses a
      contradiction.
    score_dtype: ``SCORE_DTYPES``: "model" computes the scores and weights in the model dtype
      (``MoEConfig.dtype``) from logits rounded to it, so it needs ``router_dtype="model"``; the
      one-pass Triton routing is fp32 and does not take such a kind.
    floor_added: see ``weight_floor``.
    """

    name: str
    scores: str
    order: str
    groups: str | None
    correction_bias: bool
    router_bias: bool
    scaling: bool
    weight_floor: float
    weights_on_input: bool
    summary: str
    mask_eps: float = 0.0
    renormalize: str = "optional"
    score_dtype: str = "fp32"
    floor_added: bool = False


_REGISTRY: Registry[RoutingKind] = Registry()


def register_routing(kind: RoutingKind) -> RoutingKind:
    """Adds ``kind`` after checking its fields; returns it. ValueError names the field and value."""
    where = f"register_routing({kind.name!r})"
    if not isinstance(kind.name, str) or not kind.name.isidentifier():
        raise ValueError(f"{where}: name must be an identifier, got {kind.name!r}")
    if kind.name in _REGISTRY:
        raise ValueError(f"{where}: a routing kind of that name is registered already")
    for field, value, allowed in (("scores", kind.scores, SCORES), ("order", kind.order, ORDERS),
                                  ("groups", kind.groups, (None, *GROUP_SCORES))):
        if value not in allowed:
            raise ValueError(f"{where}: {field} {value!r} is not one of {list(allowed)}")
    if kind.order != "score_then_topk" and kind.groups is not None:
        raise ValueError(f"{where}: order {kind.order!r} selects on the logits alone; groups={kind.groups!r} need "
                         f"scores over all experts")
    if kind.order == "masked_rounds" and kind.correction_bias:
        raise ValueError(f"{where}: order 'masked_rounds' scores each pick among the logits near it; a selection "
                         f"bias (correction_bias=True) has no place in its rounds")
    rounds = kind.order == "masked_rounds"
    if not (isinstance(kind.mask_eps, float) and (0 < kind.mask_eps < 1 if rounds else kind.mask_eps == 0)):
        raise ValueError(f"{where}: mask_eps must be a float in (0, 1) with order 'masked_rounds' and 0.0 otherwise, "
                         f"got {kind.mask_eps!r} with order {kind.order!r}")
    if kind.renormalize not in RENORMALIZATION:
        raise ValueError(f"{where}: renormalize {kind.renormalize!r} is not one of {list(RENORMALIZATION)}")
    if kind.score_dtype not in SCORE_DTYPES:
        raise ValueError(f"{where}: score_dtype {kind.score_dtype!r} is not one of {list(SCORE_DTYPES)}")
    if not isinstance(kind.floor_added, bool):
        raise ValueError(f"{where}: floor_added must be a bool, got {kind.floor_added!r}")
    if not (isinstance(kind.weight_floor, float) and 0 < kind.weight_floor < 1):
        raise ValueError(f"{where}: weight_floor must be a float in (0, 1), got {kind.weight_floor!r}")
    _REGISTRY.add(kind.name, kind)
    return kind


def unregister_routing(name: str) -> None:
    """Removes a kind (tests that register one of their own clean up with this)."""
    _REGISTRY.remove(name)


def routing_names() -> tuple[str, ...]:
    """Every registered kind, in registration order."""
    return _REGISTRY.names()


def get_routing(name: str, where: str = "scoring") -> RoutingKind:
    """The descriptor of ``name``; ValueError naming ``where``, the value and the known kinds."""
    return _REGISTRY.get(name, where)


_FLOOR = 1e-20  # a sum of K positive fp32 weights is far above it; it only keeps 0 / 0 away
for _kind in (
    RoutingKind("softmax", "softmax", "score_then_topk", "top2_sum", False, False, True, _FLOOR, False,
                "softmax over all experts, top-k, optional renormalization"),
    RoutingKind("sigmoid", "sigmoid", "score_then_topk", "top2_sum", True, False, True, _FLOOR, False,
                "sigmoid, selection bias, group top-k by best two, routed scaling"),
    RoutingKind("topk_softmax", "softmax", "topk_then_score", None, False, False, True, _FLOOR, False,
                "top-k of the logits, softmax over the selected", renormalize="never"),
    RoutingKind("group_limited_greedy", "softmax", "score_then_topk", "max", False, False, True, _FLOOR, False,
                "softmax, groups scored by their best expert, top-k in the kept groups"),
    # ERNIE 4.5 divides by max(sum, moe_norm_min); its configs' moe_norm_min is 1e-12.
    RoutingKind("softmax_bias", "softmax", "score_then_topk", None, True, False, False, 1e-12, False,
                "softmax, top-k on the scores plus a selection bias, renormalized", renormalize="always"),
    RoutingKind("sparsemixer", "softmax", "masked_rounds", None, False, False, False, _FLOOR, False,
                "top-1 of the remaining logits per round, softmax among the logits near it", mask_eps=0.01,
                renormalize="never"),
):
    register_routing(_kind)


# Kinds whose router or weights differ in more than the scoring: a router bias (gpt-oss), the
# weight applied to the expert's input (Llama-4).
for _kind in (
    RoutingKind("topk_softmax_bias", "softmax", "topk_then_score", None, False, True, True, _FLOOR, False,
                "router with a bias, top-k of the logits, softmax over the selected", renormalize="never"),
    RoutingKind("topk_sigmoid_input", "sigmoid", "topk_then_score", None, False, False, False, _FLOOR, True,
                "top-k of the logits, sigmoid of the selected, applied to the expert's input", renormalize="never"),
):
    register_routing(_kind)

# Cohere2-MoE with expert_selection_fn="sigmoid" (its "softmax" is topk_softmax); Kolibri-1 selects
# on its logits plus a selection bias and weighs by the sigmoid of the unbiased selected logits.
for _kind in (
    RoutingKind("topk_sigmoid", "sigmoid", "topk_then_score", None, False, False, True, _FLOOR, False,
                "top-k of the logits, sigmoid of the selected, optional renormalization"),
    RoutingKind("topk_sigmoid_biased", "sigmoid", "topk_then_score", None, True, False, False, _FLOOR, False,
                "top-k of the logits plus a selection bias, sigmoid of the selected unbiased logits, optional "
                "renormalization"),
):
    register_routing(_kind)

# Routers that score in the model dtype: DBRX (``softmax(logits, dtype=logits.dtype)``, its
# weights divided by their 1-norm, the sum for these non-negative weights), Mistral Small 4
# (softmax, group top-k, divided by ``sum + 1e-20``, ``routed_scaling_factor``), LFM2-MoE (sigmoid
# scores, an expert bias for selection, divided by ``sum + 1e-6``, ``routed_scaling_factor``).
for _kind in (
    RoutingKind("softmax_model", "softmax", "score_then_topk", None, False, False, False, _FLOOR, False,
                "softmax in the model dtype, top-k, optional renormalization", score_dtype="model"),
    RoutingKind("softmax_group_model", "softmax", "score_then_topk", "top2_sum", False, False, True, 1e-20, False,
                "softmax in the model dtype, group top-k by best two, renormalized by the sum plus 1e-20, routed "
                "scaling", score_dtype="model", floor_added=True),
    RoutingKind("sigmoid_bias_model", "sigmoid", "score_then_topk", None, True, False, True, 1e-6, False,
                "sigmoid in the model dtype, selection bias, renormalized by the sum plus 1e-6, routed scaling",
                score_dtype="model", floor_added=True),
):
    register_routing(_kind)

# DeepSeek-V4's learned routers: ``sqrtsoftplus`` scores of model-dtype logits, a selection bias
# added in fp32, the weights always divided by their sum plus 1e-20 (``weights.sum() + 1e-20``,
# whatever ``norm_topk_prob``) and scaled, in the model dtype.
register_routing(RoutingKind("sqrtsoftplus_bias_model", "sqrt_softplus", "score_then_topk", None, True, False, True,
                             _FLOOR, False, "sqrt(softplus) in the model dtype, selection bias, renormalized by the "
                             "sum plus 1e-20, routed scaling", renormalize="always", score_dtype="model",
                             floor_added=True))

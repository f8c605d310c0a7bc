"""Laguna (laguna): sigmoid scores of model-dtype logits, a selection bias, always renormalized.

transformers' router (``gate``: weight [E, H] in the model dtype, its logits widened to fp32)
chooses the top ``num_experts_per_tok`` of s = sigmoid(logits) + ``e_score_correction_bias`` and
divides the unbiased s by their sum (routing kind ``sigmoid``, one group); its block multiplies
the experts' sum by ``moe_routed_scaling_factor`` (folded into the weights here: the same
product) and adds an ungated shared MLP of ``shared_expert_intermediate_size``. Dense layers:
``mlp_layer_types``, else layer 0. The checkpoint keeps the bias as
``mlp.experts.e_score_correction_bias`` and the shared MLP as ``mlp.shared_expert.``, and stores
the experts per expert. A tanh soft cap on the logits (``moe_router_logit_softcapping`` > 0) and
the weights applied to the experts' input are refused: no routing kind has them.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    cap = f.get("moe_router_logit_softcapping")
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap != 0:
        raise ValueError(f"{f.source}: moe_router_logit_softcapping={cap!r}; moeshard routes laguna blocks without a "
                         f"soft cap on the logits (0.0)")
    if f.bool("moe_apply_router_weight_on_input"):
        raise ValueError(f"{f.source}: moe_apply_router_weight_on_input=true; laguna blocks are read with the weights "
                         f"on the experts' output")
    shared = f.int("shared_expert_intermediate_size", minimum=0)
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=True,
                     routed_scaling_factor=f.float("moe_routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=True, num_shared_experts=1 if shared else 0, shared_intermediate_size=shared)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, 1)


register_family(ModelFamily("laguna", {"hidden_act": "silu", "moe_routed_scaling_factor": 1.0,
                                       "moe_router_logit_softcapping": 0.0, "moe_apply_router_weight_on_input": False,
                                       "mlp_layer_types": None},
                            _moe, _dense_layers, routing="sigmoid", bias_aliases=("experts.e_score_correction_bias",),
                            formats=("bf16",), router_dtype="model"))

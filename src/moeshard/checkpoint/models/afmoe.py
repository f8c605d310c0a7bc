"""AFMoE: sigmoid-scored experts chosen with an expert bias, renormalized and scaled, plus shared
experts; the first ``num_dense_layers`` layers dense.

transformers' block (``AfmoeSparseMoeBlock``): s = sigmoid(logits), the logits computed in the
model dtype (``router_dtype="model"``) and widened to fp32; the top ``num_experts_per_tok`` of
s + ``expert_bias`` chosen, their unbiased s divided by their sum, times ``route_scale`` (routing
kind ``sigmoid`` with one group, ``renormalize``, ``routed_scaling_factor = route_scale``), plus
``num_shared_experts`` shared experts of ``moe_intermediate_size`` fused into one MLP. Its router
module ``router`` wraps a linear, so the router weight is ``router.gate.weight``; the bias
``expert_bias`` is the block's own parameter, passed to the router (``block_bias``) with the
block's input as given, [batch, seq, H] (``router_input="block"``).

Hunyuan 3 (hy_v3) has the same block under other names, on the same reader: its router ``gate``
(weight [E, H] kept in fp32, fp32 logits: ``router_dtype="fp32"``) is passed the block's own
``e_score_correction_bias``, its scale is ``router_scaling_factor`` and its renormalization adds
1e-20 to the sum; its dense layers are ``mlp_layer_types``, else layer 0. Its checkpoint names the
router ``router.gate.weight``, the bias ``expert_bias`` and the shared MLP ``shared_mlp.``, which
transformers renames as it loads them, and stores the experts per expert.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

_SCALE = {"afmoe": "route_scale", "hy_v3": "router_scaling_factor"}


def _moe(f: ConfigFields) -> MoEConfig:
    I = f.int("moe_intermediate_size")
    shared = f.int("num_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=f.family.routing, renormalize=True,
                     routed_scaling_factor=f.float(_SCALE[f.family.model_type], 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=True, num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    first = f.int("num_dense_layers", minimum=0)
    return DenseLayers(num_layers, lambda layer: f"layer < num_dense_layers={first}" if layer < first else None)


register_family(ModelFamily("afmoe", {"hidden_act": "silu", "num_dense_layers": 1, "num_shared_experts": 2,
                                      "route_scale": 1.0},
                            _moe, _dense_layers, routing="sigmoid", router="router", router_weight="gate.weight",
                            block_bias="expert_bias", router_dtype="model", router_input="block"))


def _hy_v3_dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, 1)


register_family(ModelFamily("hy_v3", {"hidden_act": "silu", "num_shared_experts": 1, "router_scaling_factor": 2.826,
                                      "mlp_layer_types": None}, _moe, _hy_v3_dense_layers, routing="sigmoid",
                            block_bias="e_score_correction_bias", bias_aliases=("expert_bias",),
                            stored_names={"gate.weight": "router.gate.weight"},
                            shared_prefixes=("shared_mlp.", "shared_experts."), formats=("bf16",),
                            router_dtype="fp32"))

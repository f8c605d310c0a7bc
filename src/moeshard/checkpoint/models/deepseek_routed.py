"""Families with DeepSeek-V3's router and no shared experts: MiMo-V2-Flash (mimo_v2_flash) and
Beam (beam).

Their transformers router (``gate``: weight [E, H] kept in fp32, fp32 logits) is DeepSeek-V3's
``noaux_tc`` (routing kind ``sigmoid``): s = sigmoid(logits), selection on s +
``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups, the unbiased s
renormalized (+ 1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``. Beam's block
multiplies the experts' sum by that factor instead, which moeshard folds into the weights (the
same product, rounded once). The checkpoints store the experts per expert.

=============  ================  =======  ============  ====================================
model_type     experts field     groups   scale         dense layers
=============  ================  =======  ============  ====================================
mimo_v2_flash  n_routed_experts  1 of 1   1.0 (null on  ``mlp_layer_types``, else layer 0
                                          the hub)
beam           num_experts       4 of 8   2.5           ``mlp_layer_types``, else the first 3
=============  ================  =======  ============  ====================================

MiMo-V2-Flash's checkpoint stores the attention's sinks as ``self_attn.attention_sink_bias``
(transformers' ``self_attn.sinks``).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

_EXPERTS = {"mimo_v2_flash": "n_routed_experts", "beam": "num_experts"}
_FIRST_DENSE = {"mimo_v2_flash": 1, "beam": 3}


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int(_EXPERTS[f.family.model_type]), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"),
                     n_group=f.int("n_group"), topk_group=f.int("topk_group"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=True)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, min(_FIRST_DENSE[f.family.model_type], num_layers))


_DEFAULTS = {"hidden_act": "silu", "norm_topk_prob": True, "mlp_layer_types": None}
for _family in (
    ModelFamily("mimo_v2_flash", {**_DEFAULTS, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
                _moe, _dense_layers, routing="sigmoid",
                dense_renames=(("self_attn.sinks", "self_attn.attention_sink_bias"),), formats=("bf16",),
                router_dtype="fp32"),
    ModelFamily("beam", {**_DEFAULTS, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
                _moe, _dense_layers, routing="sigmoid", formats=("bf16",), router_dtype="fp32"),
):
    register_family(_family)

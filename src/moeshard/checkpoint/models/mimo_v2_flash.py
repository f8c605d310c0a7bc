"""MiMo-V2-Flash (mimo_v2_flash): DeepSeek-V3's router without shared experts.

transformers' router (``gate``: weight [E, H] kept in fp32, fp32 logits) is DeepSeek-V3's
``noaux_tc`` (routing kind ``sigmoid``): s = sigmoid(logits), selection on s +
``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups, the unbiased s
renormalized when ``norm_topk_prob``, times ``routed_scaling_factor`` (null on the hub: 1.0).
Dense layers: ``mlp_layer_types``, else layer 0. The checkpoint stores the experts per expert and
the attention's sinks as ``self_attn.attention_sink_bias`` (transformers' ``self_attn.sinks``).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"),
                     n_group=f.int("n_group"), topk_group=f.int("topk_group"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=True)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, 1)


register_family(ModelFamily("mimo_v2_flash", {"hidden_act": "silu", "n_group": 1, "topk_group": 1,
                                              "norm_topk_prob": True, "routed_scaling_factor": 1.0,
                                              "mlp_layer_types": None},
                            _moe, _dense_layers, routing="sigmoid",
                            dense_renames=(("self_attn.sinks", "self_attn.attention_sink_bias"),), formats=("bf16",),
                            router_dtype="fp32"))

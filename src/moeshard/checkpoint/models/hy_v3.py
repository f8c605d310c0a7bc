"""Hunyuan 3 (hy_v3): MiniMax-M2's block with DeepSeek-V3's scale and shared experts.

transformers' block (``HYV3MoE``): its router ``gate`` (weight [E, H] kept in fp32, fp32 logits)
scores s = sigmoid(logits), chooses the top ``num_experts_per_tok`` of s + the block's own
``e_score_correction_bias`` (passed to the router: ``block_bias``), divides the unbiased s by
their sum (+ 1e-20) and scales them by ``router_scaling_factor`` (routing kind ``sigmoid``, one
group, renormalized); ``num_shared_experts`` ungated shared experts of ``moe_intermediate_size``
are fused into one MLP. Dense layers: ``mlp_layer_types``, else layer 0. The checkpoint names
the router ``router.gate.weight``, the bias ``expert_bias`` and the shared MLP ``shared_mlp.``,
which transformers renames as it loads them; the experts are stored per expert.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    I = f.int("moe_intermediate_size")
    shared = f.int("num_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=f.family.routing, renormalize=True,
                     routed_scaling_factor=f.float("router_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=True, num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, 1)


register_family(ModelFamily("hy_v3", {"hidden_act": "silu", "num_shared_experts": 1, "router_scaling_factor": 2.826,
                                      "mlp_layer_types": None}, _moe, _dense_layers, routing="sigmoid",
                            block_bias="e_score_correction_bias", bias_aliases=("expert_bias",),
                            stored_names={"gate.weight": "router.gate.weight"},
                            shared_prefixes=("shared_mlp.", "shared_experts."), formats=("bf16",),
                            router_dtype="fp32"))

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
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    I = f.int("moe_intermediate_size")
    shared = f.int("num_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=f.family.routing, renormalize=True,
                     routed_scaling_factor=f.float("route_scale", 0.0, MAX_ROUTED_SCALING), use_correction_bias=True,
                     num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    first = f.int("num_dense_layers", minimum=0)
    return DenseLayers(num_layers, lambda layer: f"layer < num_dense_layers={first}" if layer < first else None)


register_family(ModelFamily("afmoe", {"hidden_act": "silu", "num_dense_layers": 1, "num_shared_experts": 2,
                                      "route_scale": 1.0},
                            _moe, _dense_layers, routing="sigmoid", router="router", router_weight="gate.weight",
                            block_bias="expert_bias", router_dtype="model", router_input="block"))

"""LFM2-MoE: sigmoid-scored experts chosen with an expert bias, every routing step in the model
dtype; the first ``num_dense_layers`` layers dense (their feed-forward is transformers' MLP).

transformers' block (``Lfm2MoeSparseMoeBlock``, the decoder layer's ``feed_forward``): the logits
in the model dtype (``router_dtype="model"``), s = their sigmoid in the model dtype, the top
``num_experts_per_tok`` of s + ``expert_bias`` (an fp32 buffer of the block, passed to the router:
``block_bias``; absent with ``use_expert_bias`` false), their unbiased s divided by their sum plus
1e-6 when ``norm_topk_prob``, times ``routed_scaling_factor``, each step rounding to the model
dtype (routing kind ``sigmoid_bias_model``). Experts ``moe_intermediate_size`` wide, always SiLU
(the config has no ``hidden_act``), no shared expert. Hub checkpoints store the experts per expert
(``feed_forward.experts.{e}.w1/w3/w2``), transformers 5 fused (``gate_up_proj``, ``down_proj``).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation="silu", scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=f.bool("use_expert_bias"), router_dtype=f.family.router_dtype)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    first = f.int("num_dense_layers", minimum=0)
    return DenseLayers(num_layers, lambda layer: f"layer < num_dense_layers={first}" if layer < first else None)


register_family(ModelFamily("lfm2_moe", {"num_dense_layers": 2, "use_expert_bias": True, "routed_scaling_factor": 1.0,
                                         "norm_topk_prob": True},
                            _moe, _dense_layers, routing="sigmoid_bias_model", block_prefixes=("feed_forward.",),
                            block_bias="expert_bias", router_dtype="model", formats=("bf16",)))

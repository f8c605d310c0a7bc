"""OLMoE and FlexOlmo: every layer an MoE block of softmax top-k routing, renormalized when
``norm_topk_prob`` (default False), no shared expert; experts ``intermediate_size`` wide.

Checkpoint: ``model.layers.{L}.mlp.gate.weight`` [E, H] and per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (transformers 5 holds them fused).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig


def olmoe_moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"))


_DEFAULTS = {"hidden_act": "silu", "norm_topk_prob": False}
for _model_type in ("olmoe", "flex_olmo"):
    register_family(ModelFamily(_model_type, _DEFAULTS, olmoe_moe, every_layer, formats=("bf16",), router_dtype="model"))

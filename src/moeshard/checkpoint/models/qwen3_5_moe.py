"""Qwen3.5-MoE's text model (``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``): softmax top-k,
always renormalized, plus one shared expert gated by ``sigmoid(shared_expert_gate(x))`` in every
layer; its gated-delta-net (linear attention) layers stay transformers'. Checkpoint names as
Qwen2-MoE's (``mlp.gate``, ``mlp.experts.{e}.*``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``). The published vision-language ``qwen3_5_moe`` checkpoint (its text
model under ``model.language_model``) is read as this text model (``hf_config.text_model_config``).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    shared = f.int("shared_expert_intermediate_size")
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=True, num_shared_experts=1,
                     shared_intermediate_size=shared, shared_expert_gate=True)


register_family(ModelFamily("qwen3_5_moe_text", {"hidden_act": "silu"}, _moe, every_layer, formats=("bf16",),
                            router_dtype="model"))

"""Gemma 4 (gemma4_text): the decoder layer routes and calls its experts itself
(``ModelFamily.experts_only``); moeshard runs its experts, on the routing transformers computed.

Each decoder layer with ``enable_moe_block`` holds, beside a dense MLP that stays transformers',
a router ``router`` (``Gemma4TextRouter``: the residual stream through its own RMS norm, times a
learned ``scale`` [H] and H^-0.5, then ``proj.weight`` [E, H]; softmax over the E logits in fp32,
the top ``top_k_experts``, renormalized, each weight times a learned ``per_expert_scale[e]``) and
experts ``experts`` (``gate_up_proj`` [E, 2I, H] gate rows first, ``down_proj`` [E, H, I]), which
it calls on another norm of the residual, ``pre_feedforward_layernorm_2``. The router reads an
input the experts do not, so moeshard takes its ids and weights as given (``MoEExperts``) and
replaces only ``experts``; the router, its norms and scales load as dense tensors. The routing
kind below describes the router's selection (softmax, renormalized), not the scales it adds.
The activation is ``hidden_activation`` (``gelu_pytorch_tanh``: GELU's tanh approximation).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MoEConfig

HIDDEN_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


def _moe(f: ConfigFields) -> MoEConfig:
    if not f.bool("enable_moe_block"):
        raise ValueError(f"{f.source}: enable_moe_block=false: the model has no MoE block")
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("top_k_experts"), hidden_size=f.int("hidden_size"),
                     intermediate_size=f.int("moe_intermediate_size"), activation=f.activation(),
                     scoring=f.family.routing, renormalize=True)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    moe = f.bool("enable_moe_block")
    return DenseLayers(num_layers, lambda layer: None if moe else "enable_moe_block=false")


register_family(ModelFamily("gemma4_text", {"enable_moe_block": False, "hidden_act": "gelu_pytorch_tanh"}, _moe,
                            _dense_layers, routing="softmax", block_prefixes=("",), router="router",
                            router_weight="proj.weight", experts_only=True, hidden_acts=HIDDEN_ACTS,
                            formats=("bf16",), router_dtype="model"))

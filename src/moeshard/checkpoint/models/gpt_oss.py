"""gpt-oss (``model_type`` ``gpt_oss``): a router with a bias, softmax over the top-k logits,
experts with biases and the clamped SwiGLU, gate and up interleaved, MXFP4 checkpoints.

What transformers' ``GptOssMLP`` computes, and where moeshard has it:

=======================================  ===========================================================
transformers                             moeshard
=======================================  ===========================================================
``router``: logits = x W^T + b; top-k    routing kind ``topk_softmax_bias`` (``moeshard.routing``)
of the logits; softmax over those k
``experts.gate_up_proj`` [E, H, 2I],     fused layout ``transposed_interleaved``
gate columns 0::2, up 1::2               (``checkpoint.fused``), read into gate rows then up rows
``gate_up_proj_bias`` [E, 2I],           ``MoEConfig.expert_bias`` (``ExpertWeights.gate_up_bias``,
``down_proj_bias`` [E, H]                ``down_bias``)
``_apply_gate``: clamp, (up + 1) *       activation ``swiglu_clamped`` (``moeshard.activations``),
gate * sigmoid(alpha * gate)             alpha 1.702, limit 7.0
MXFP4 ``*_blocks`` / ``*_scales``        checkpoint format ``mxfp4``, dequantized at load
=======================================  ===========================================================

``hidden_act`` (``silu`` in every config) is not what the experts compute, so it is not read;
``swiglu_alpha`` and ``swiglu_limit`` must be the activation kind's parameters (every published
gpt-oss has 1.702 and 7.0), else the config is refused naming the field. Every layer has an MoE
block; the block returns ``(output, router scores)``.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig

ACTIVATION = "swiglu_clamped"


def clamped_swiglu(f: ConfigFields, published: str) -> str:
    """``ACTIVATION``, once config.json's ``swiglu_alpha`` and ``swiglu_limit`` are checked to be
    its parameters (``published``: whose published models have them, for the refusal)."""
    return f.fixed_activation(ACTIVATION, {"swiglu_alpha": "alpha", "swiglu_limit": "limit"},
                              f"the value of every published {published}")


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("intermediate_size"),
                     activation=clamped_swiglu(f, "gpt-oss"), scoring=f.family.routing, renormalize=False,
                     expert_bias=True)


register_family(ModelFamily(
    "gpt_oss", {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}, _moe, every_layer, routing="topk_softmax_bias",
    router="router", fused_layout="transposed_interleaved", formats=("bf16", "mxfp4"), returns_router_output=1,
    router_dtype="model"))

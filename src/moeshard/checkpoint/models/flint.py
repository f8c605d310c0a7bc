"""Flint (flint): Qwen's layout with sigmoid scores and an ungated shared expert.

transformers' router (``gate``: weight [E, H] kept in fp32, fp32 logits) takes the top
``num_experts_per_tok`` of s = sigmoid(logits), without a selection bias, groups or scaling, and
divides them by their sum when ``norm_topk_prob`` (routing kind ``sigmoid``); the shared expert
(``shared_expert``, ``shared_expert_intermediate_size`` wide) is added whole, without a gate.
Dense layers follow Qwen's rule (``mlp_only_layers``, by default [0, 1], and
``decoder_sparse_step``). The checkpoint stores the experts per expert and the attention's sinks
as ``self_attn.softmax_offset`` (transformers' ``self_attn.sinks``).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, qwen_dense_layers, qwen_layout_moe, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return qwen_layout_moe(f, "ungated")


register_family(ModelFamily("flint", {"hidden_act": "silu", "norm_topk_prob": True, "decoder_sparse_step": 1,
                                      "mlp_only_layers": [0, 1]}, _moe, qwen_dense_layers, routing="sigmoid",
                            dense_renames=(("self_attn.sinks", "self_attn.softmax_offset"),), formats=("bf16",),
                            router_dtype="fp32"))

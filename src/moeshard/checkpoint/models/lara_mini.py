"""LaraMini: every layer an MoE block of softmax-routed experts (fp32 logits, renormalized when
``norm_topk_prob``) plus an ungated shared expert, beside gated-delta-net and attention layers
whose weights transformers splits and renames as it loads the checkpoint.

The block (``LaraMiniSparseMoeBlock``, the decoder layer's ``mlp``): the logits of an fp32 product
(``router_dtype="fp32"``), softmax, the top ``num_experts_per_tok``, divided by their sum when
``norm_topk_prob`` (routing kind ``softmax``), plus ``shared_expert`` of
``shared_expert_intermediate_size``, added in full. Experts ``moe_intermediate_size`` wide.

The checkpoint fuses each gated delta net's input projections into one ``linear_attn.in_proj``,
rows [qkv | z | b | a], which transformers splits into ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b`` and ``in_proj_a`` (``dense_split``), and names its output norm ``out_norm`` for
the model's ``norm`` (``dense_renames``).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, qwen_layout_moe, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return qwen_layout_moe(f, "ungated")


register_family(ModelFamily(
    "lara_mini", {"hidden_act": "silu", "norm_topk_prob": True}, _moe, every_layer, router_dtype="fp32",
    formats=("bf16",), dense_renames=(("linear_attn.norm.", "linear_attn.out_norm."),),
    dense_split={"linear_attn.in_proj.weight": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                                "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")}))

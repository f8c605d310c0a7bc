"""Kolibri-1 (kolibri1): top-k of the logits plus a selection bias, weighed by the sigmoid of the
chosen experts' unbiased logits, and a shared MLP on every layer.

transformers' router (``gate``: weight [E, H], its logits computed in fp32) chooses the top
``num_experts_per_tok`` of logits + ``e_score_correction_bias`` (an fp32 buffer [E]) and weighs
each by sigmoid(logit), divided by their sum when ``norm_topk_prob`` (routing kind
``topk_sigmoid_biased``); its block adds a gated MLP of ``shared_expert_intermediate_size`` with
no gate of its own. Every layer is an MoE layer. The checkpoint keeps the bias outside the block,
as ``model.layers.{L}.moe.router.expert_bias`` (``layer_bias_aliases``), stores the experts per
expert (``mlp.experts.{e}.{gate,up,down}_proj``) and two of the decoder layer's norms under other
names (``post_attn_norm``, ``post_ffn_norm``: ``dense_renames``); transformers' own saves write
those names too.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    shared = f.int("shared_expert_intermediate_size", minimum=0)
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"),
                     use_correction_bias=True, num_shared_experts=1 if shared else 0, shared_intermediate_size=shared)


register_family(ModelFamily("kolibri1", {"hidden_act": "silu", "norm_topk_prob": False}, _moe, every_layer,
                            routing="topk_sigmoid_biased", router_dtype="fp32",
                            layer_bias_aliases=("moe.router.expert_bias",),
                            dense_renames=(("post_self_attn_layernorm", "post_attn_norm"),
                                           ("post_mlp_layernorm", "post_ffn_norm")),
                            formats=("bf16",)))

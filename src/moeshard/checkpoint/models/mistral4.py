"""Mistral Small 4 (``mistral4``): DeepSeek-V3's block with a softmax router that groups its
experts and computes in the model dtype.

What transformers' ``Mistral4MoE`` computes, and where moeshard has it:

==========================================  =====================================================
transformers                                moeshard
==========================================  =====================================================
``gate`` (``Mistral4TopkRouter``): logits   routing kind ``softmax_group_model``,
= x W^T and p = softmax(logits) in the      ``router_dtype`` "model"; ``n_group`` /
model dtype; groups scored by the sum of    ``topk_group``; ``renormalize`` =
their best two p, the ``topk_group`` best   ``norm_topk_prob``; ``routed_scaling_factor``
kept; top K of p among them; the K p
divided by their sum + 1e-20 when
``norm_topk_prob``; times the scaling
``experts.gate_up_proj`` [E, 2I, H] (gate   fused layout ``gate_up_rows``; ``hidden_act``
rows first), ``down_proj`` [E, H, I]
``shared_experts``: one MLP                 ``n_shared_experts`` shared experts fused
``n_shared_experts`` x I wide, added
==========================================  =====================================================

transformers masks the dropped groups' p with 0 before the top K, moeshard with -inf: the two pick
differently only where fewer than K of the kept groups' p are above 0, which takes p underflowing
in the model dtype. Dense layers: those below ``first_k_dense_replace``. transformers' causal LM of
it (``Mistral4ForCausalLM``) is listed under its image-text-to-text auto class only, where
``hf_model.model_class`` finds it; its tensors are held and saved under the same names.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    I, shared = f.int("moe_intermediate_size"), f.int("n_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"), n_group=f.int("n_group"),
                     topk_group=f.int("topk_group"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     num_shared_experts=shared, shared_intermediate_size=I if shared else 0,
                     router_dtype=f.family.router_dtype)


def _first_k_dense(f: ConfigFields, num_layers: int) -> DenseLayers:
    first = f.int("first_k_dense_replace", minimum=0)
    return DenseLayers(num_layers, lambda layer: f"layer < first_k_dense_replace={first}" if layer < first else None)


# The transformers-5 defaults of Mistral4Config's fields read here.
register_family(ModelFamily("mistral4", {"hidden_act": "silu", "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                                         "routed_scaling_factor": 1.0, "norm_topk_prob": True,
                                         "first_k_dense_replace": 0},
                            _moe, _first_k_dense, routing="softmax_group_model", router_dtype="model",
                            formats=("bf16",)))

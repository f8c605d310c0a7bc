"""Cohere2-MoE: top-k of the logits, then softmax over the K selected (``expert_selection_fn``
``softmax``: routing kind ``topk_softmax``) or sigmoid of each, renormalized when
``norm_topk_prob`` (``sigmoid``: ``topk_sigmoid``); ``num_shared_experts`` shared experts (one MLP
of ``num_shared_experts * intermediate_size``) added to the routed sum (``"sum"``);
``mlp_layer_types[L]`` says which layers are dense. The ``"average"`` combination halves the sum
of the routed and shared outputs, which moeshard's block does not do: refused with shared experts.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, register_family
from moeshard.checkpoint.models.mellum import dense_by_layer_types
from moeshard.config import MoEConfig

# expert_selection_fn -> routing kind
SELECTION = {"softmax": "topk_softmax", "sigmoid": "topk_sigmoid"}


def _moe(f: ConfigFields) -> MoEConfig:
    selection = f.get("expert_selection_fn")
    if selection not in SELECTION:
        raise ValueError(f"{f.source}: expert_selection_fn={selection!r} is not one of {list(SELECTION)}")
    I, shared = f.int("intermediate_size"), f.int("num_shared_experts", minimum=0)
    strategy = f.get("shared_expert_combination_strategy")
    if shared and strategy != "sum":
        raise ValueError(f"{f.source}: shared_expert_combination_strategy={strategy!r} with num_shared_experts="
                         f"{shared}: moeshard adds the shared experts' output to the routed sum ('sum') and cannot "
                         f"halve both ('average')")
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=SELECTION[selection], renormalize=selection == "sigmoid" and f.bool("norm_topk_prob"),
                     num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


register_family(ModelFamily("cohere2_moe", {"hidden_act": "silu", "expert_selection_fn": "softmax",
                                            "num_shared_experts": 0, "shared_expert_combination_strategy": "average",
                                            "norm_topk_prob": True},
                            _moe, dense_by_layer_types, routing="topk_softmax", formats=("bf16",)))

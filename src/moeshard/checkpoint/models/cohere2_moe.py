"""Cohere2-MoE: the top-k of the router logits, scored among themselves; shared experts summed
with or averaged against the routed ones; dense first layers.

transformers' block (``Cohere2MoeSparseMoeBlock``) selects the top ``num_experts_per_tok``
logits, then weighs them with ``expert_selection_fn``: ``"softmax"`` over the selected (routing
kind ``topk_softmax``; it sums to 1, ``norm_topk_prob`` is not read) or ``"sigmoid"`` of each
(``topk_sigmoid``), divided by their sum when ``norm_topk_prob``. Routed experts and the
``num_shared_experts`` shared ones all have ``intermediate_size``. With shared experts,
``shared_expert_combination_strategy`` ``"sum"`` adds them, ``"average"`` (the config class's
default) returns (routed + shared) / 2: ``routed_scaling_factor=0.5`` and ``shared_scale=0.5``,
both exact (a power of two). Dense layers: ``mlp_layer_types``, else the first
``first_k_dense_replace`` (default 0).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MoEConfig

# expert_selection_fn -> routing kind
SELECTION = {"softmax": "topk_softmax", "sigmoid": "topk_sigmoid"}
COMBINATION = {"sum": 1.0, "average": 0.5}  # -> the scale of both the routed and the shared part


def _moe(f: ConfigFields) -> MoEConfig:
    selection = f.get("expert_selection_fn")
    if selection not in SELECTION:
        raise ValueError(f"{f.source}: expert_selection_fn={selection!r} is not one of {list(SELECTION)}")
    I = f.int("intermediate_size")
    shared = f.int("num_shared_experts", minimum=0)
    scale = 1.0
    if shared:
        strategy = f.get("shared_expert_combination_strategy")
        if strategy not in COMBINATION:
            raise ValueError(f"{f.source}: shared_expert_combination_strategy={strategy!r} is not one of "
                             f"{list(COMBINATION)}")
        scale = COMBINATION[strategy]
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=SELECTION[selection],
                     renormalize=selection == "sigmoid" and f.bool("norm_topk_prob"),
                     routed_scaling_factor=scale, num_shared_experts=shared, shared_intermediate_size=I if shared else 0,
                     shared_scale=scale)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, "first_k_dense_replace")


# routing: the kind of the default expert_selection_fn; _moe picks the configured one.
register_family(ModelFamily("cohere2_moe", {"hidden_act": "silu", "expert_selection_fn": "softmax",
                                            "norm_topk_prob": True, "num_shared_experts": 0,
                                            "shared_expert_combination_strategy": "average",
                                            "first_k_dense_replace": 0, "mlp_layer_types": None},
                            _moe, _dense_layers, routing="topk_softmax", router_dtype="model"))

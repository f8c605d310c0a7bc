"""Mellum: softmax top-k routing renormalized when ``norm_topk_prob`` (default True), experts
``moe_intermediate_size`` wide, no shared expert; ``mlp_layer_types[L]`` says whether layer L
has an MoE block (``"sparse"``) or a dense MLP (``"dense"``); default every layer sparse.

Checkpoint: as Qwen3-MoE (``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``).
Multi-token-prediction layers (``mtp.*``) are not part of the causal LM and are not read.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MoEConfig

LAYER_KINDS = ("sparse", "dense")


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"))


def dense_by_layer_types(f: ConfigFields, num_layers: int) -> DenseLayers:
    """``mlp_layer_types[L]``: ``"dense"`` or ``"sparse"`` (absent: every layer sparse)."""
    kinds = f.raw.get("mlp_layer_types")
    if kinds is None:
        return DenseLayers(num_layers, lambda layer: None)
    if not (isinstance(kinds, list) and len(kinds) == num_layers and all(k in LAYER_KINDS for k in kinds)):
        raise ValueError(f"{f.source}: mlp_layer_types must list {list(LAYER_KINDS)} once per layer "
                         f"(num_hidden_layers={num_layers}), got {kinds!r}")
    return DenseLayers(num_layers, lambda layer: "mlp_layer_types says 'dense'" if kinds[layer] == "dense" else None)


register_family(ModelFamily("mellum", {"hidden_act": "silu", "norm_topk_prob": True}, _moe, dense_by_layer_types,
                            formats=("bf16",), router_dtype="model"))

"""Jamba: softmax top-k routing without renormalization, no shared expert, experts
``intermediate_size`` wide; its Mamba and attention layers stay transformers'.

Layer L has an MoE block iff ``L % expert_layer_period == expert_layer_offset`` and
``num_experts > 1`` (otherwise its ``feed_forward`` is a dense MLP). The block is the decoder
layer's ``feed_forward``, its router ``router``: ``model.layers.{L}.feed_forward.router.weight``
and ``feed_forward.experts.{e}.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=False)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    period, offset = f.int("expert_layer_period"), f.int("expert_layer_offset", minimum=0)
    experts = f.int("num_experts")

    def why(layer: int) -> str | None:
        if experts == 1:
            return "num_experts=1"
        if layer % period != offset:
            return f"layer % expert_layer_period={period} != expert_layer_offset={offset}"
        return None
    return DenseLayers(num_layers, why)


register_family(ModelFamily("jamba", {"hidden_act": "silu", "expert_layer_period": 2, "expert_layer_offset": 1},
                            _moe, _dense_layers, block_prefixes=("feed_forward.",), router="router",
                            formats=("bf16",), router_dtype="model"))

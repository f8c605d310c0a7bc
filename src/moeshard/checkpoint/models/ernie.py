"""ERNIE 4.5 MoE: p = softmax(logits) in fp32; the top K of p + ``e_score_correction_bias``
(selection only) are chosen, their weights p renormalized with the floor ``moe_norm_min``
(routing kind ``softmax_bias``); ``moe_num_shared_experts`` shared experts (one MLP of
``moe_num_shared_experts * moe_intermediate_size``), ungated. Layer L has an MoE block iff
``(L + 1) % moe_layer_interval == 0`` and ``moe_layer_start_index <= L <= moe_layer_end_index``
(-1: the last layer).

The bias lives in the router's ``moe_statics`` module, [1, E]: the model's
``mlp.gate.moe_statics.e_score_correction_bias`` is stored ``mlp.moe_statics.e_score_correction_bias``.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MoEConfig
from moeshard.routing import get_routing

ROUTING = "softmax_bias"
_BIAS = "moe_statics.e_score_correction_bias"


def _moe(f: ConfigFields) -> MoEConfig:
    if f.bool("use_bias"):
        raise ValueError(f"{f.source}: use_bias=true gives the shared experts' projections biases, which moeshard's "
                         f"shared MLP does not have")
    floor = get_routing(ROUTING).weight_floor
    if f.float("moe_norm_min", 0.0, 1.0) != floor:
        raise ValueError(f"{f.source}: moe_norm_min={f.get('moe_norm_min')!r}; routing kind {ROUTING!r} renormalizes "
                         f"with the floor {floor:g}")
    I, shared = f.int("moe_intermediate_size"), f.int("moe_num_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("moe_num_experts"), top_k=f.int("moe_k"), hidden_size=f.int("hidden_size"),
                     intermediate_size=I, activation=f.activation(), scoring=ROUTING, renormalize=True,
                     use_correction_bias=True, num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    interval, start = f.int("moe_layer_interval"), f.int("moe_layer_start_index", minimum=0)
    end = f.get("moe_layer_end_index")
    end = num_layers - 1 if end == -1 else f.int("moe_layer_end_index", minimum=0)

    def why(layer: int) -> str | None:
        if (layer + 1) % interval:
            return f"(layer + 1) % moe_layer_interval={interval} != 0"
        if not start <= layer <= end:
            return f"outside moe_layer_start_index={start} .. moe_layer_end_index={end}"
        return None
    return DenseLayers(num_layers, why)


register_family(ModelFamily("ernie4_5_moe", {"hidden_act": "silu", "use_bias": False, "moe_norm_min": 1e-12,
                                             "moe_layer_interval": 1, "moe_layer_start_index": 1,
                                             "moe_layer_end_index": -1, "moe_num_shared_experts": 2},
                            _moe, _dense_layers, routing=ROUTING, correction_bias=_BIAS,
                            stored_names={f"gate.{_BIAS}": _BIAS}, formats=("bf16",), router_dtype="fp32"))

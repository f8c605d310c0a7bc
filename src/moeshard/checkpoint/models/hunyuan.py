"""Hunyuan-MoE v1 (Hunyuan-A13B): softmax top-k (``moe_topk``), always renormalized, over
``num_experts`` experts; the router is ``gate.wg``, an fp32 linear; every layer's block adds an
ungated shared MLP (``shared_mlp``). Experts and shared MLP are ``intermediate_size`` wide, as
transformers builds them. ``num_experts``/``moe_topk`` may be per-layer lists in transformers;
moeshard reads one block shape per model, so a list must hold one value.

Checkpoint: ``model.layers.{L}.mlp.gate.wg.weight`` [E, H], ``mlp.experts.{e}.{gate,up,down}_proj``,
``mlp.shared_mlp.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig
from moeshard.validate import is_int


def _one_value(f: ConfigFields, key: str) -> int:
    """``key`` as an int, or a per-layer list holding one value."""
    value = f.get(key)
    if isinstance(value, list) and value and all(is_int(v) for v in value):
        if len(set(value)) != 1:
            raise ValueError(f"{f.source}: {key}={value!r} differs between layers; moeshard reads one MoE block "
                             f"shape per model")
        return f.family.fields({key: value[0]}, f.source).int(key)
    return f.int(key)


def _moe(f: ConfigFields) -> MoEConfig:
    I = f.int("intermediate_size")
    return MoEConfig(num_experts=_one_value(f, "num_experts"), top_k=_one_value(f, "moe_topk"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=f.family.routing, renormalize=True, num_shared_experts=1, shared_intermediate_size=I)


# transformers holds wg in fp32 (even in a bf16 model) and widens hidden_states to it: an fp32 router.
register_family(ModelFamily("hunyuan_v1_moe", {"hidden_act": "silu"}, _moe, every_layer, router_weight="wg.weight",
                            shared_prefixes=("shared_mlp.",), formats=("bf16",), router_dtype="fp32"))

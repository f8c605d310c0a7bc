"""Llama-4's text model (``model_type`` ``llama4_text``): sigmoid router scores applied to the
expert's input, top-1, a shared expert on every token, MoE on interleaved layers.

What transformers' ``Llama4TextMoe`` computes, and where moeshard has it:

=======================================  ===========================================================
transformers                             moeshard
=======================================  ===========================================================
``router`` (no bias): top-k of the       routing kind ``topk_sigmoid_input`` (``moeshard.routing``):
logits, scores sigmoid of those k; the   each (token, k) is a row x * w of its own, routed to its
experts run on x * score, summed         expert with weight 1 (``router.weighted_rows``)
unweighted
``experts.gate_up_proj`` [E, H, 2I]      fused layout ``transposed`` (``checkpoint.fused``)
(gate columns first), down [E, I, H]
``shared_expert`` (``intermediate_size``)  one shared expert of the routed experts' width, ungated
=======================================  ===========================================================

The block lives at ``feed_forward`` and returns ``(output, router logits)``. Layer L has an MoE
block when it is listed in ``moe_layers`` or, without that list, when
``(L + 1) % interleave_moe_layer_step == 0`` (transformers' rule); the others hold a dense MLP of
``intermediate_size_mlp``, which stays transformers'. Only the text model is read: a
``llama4`` (vision + text) checkpoint is another model type.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    I = f.int("intermediate_size")
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=f.family.routing, renormalize=False, num_shared_experts=1, shared_intermediate_size=I)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    if f.raw.get("moe_layers") is not None:
        listed = frozenset(f.int_list("moe_layers"))
        return DenseLayers(num_layers, lambda layer: None if layer in listed else
                           f"not in moe_layers={sorted(listed)[:8]}{' ...' if len(listed) > 8 else ''}")
    step = f.int("interleave_moe_layer_step")
    return DenseLayers(num_layers, lambda layer: None if (layer + 1) % step == 0 else
                       f"(layer + 1) % interleave_moe_layer_step={step} != 0")


register_family(ModelFamily(
    "llama4_text", {"hidden_act": "silu", "num_experts_per_tok": 1, "interleave_moe_layer_step": 1}, _moe,
    _dense_layers, routing="topk_sigmoid_input", block_prefixes=("feed_forward.",), router="router",
    fused_layout="transposed", shared_prefixes=("shared_expert.",), formats=("bf16",), returns_router_output=1,
    router_dtype="model"))

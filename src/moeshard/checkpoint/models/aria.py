"""Aria's text model (``aria_text``): top-k of the model-dtype logits, softmax over the K selected
(routing kind ``topk_softmax``), ``moe_num_experts`` experts ``intermediate_size`` wide, and
``moe_num_shared_experts`` shared experts fused into one MLP (``shared_experts``), in every layer.

The routed experts are stored transposed, as ``grouped_mm`` takes them: ``experts.fc1.weight``
[E, H, 2I] (gate columns first; the model's ``experts.gate_up_proj``) and ``experts.fc2.weight``
[E, I, H] (``experts.down_proj``), fused layout ``transposed``. transformers runs the routed experts
with SiLU whatever ``hidden_act`` says and the shared experts with ``hidden_act``; moeshard's block
runs one activation for both, so another ``hidden_act`` is refused, as are biases on the shared
experts (``mlp_bias``).

The vision-language ``aria`` (Aria, Aria-Chat) is a family of its own (``text_config``): its
config.json holds this text model in ``text_config``, and transformers builds the whole
image-text-to-text model, whose decoder layers sit at ``model.language_model.layers`` and whose
vision tower and projector, transformers', sit at ``model.vision_tower`` and
``model.multi_modal_projector``. Its checkpoints, the published ones and transformers' own saves
alike, keep the text model under ``language_model.model.`` (which ``SafetensorsCheckpoint`` names
as the causal LM's ``model.``: ``text_model``), ``language_model.lm_head.`` and the other two
without ``model.`` (``dense_renames``).
"""

from __future__ import annotations

from dataclasses import replace

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig

_STORED = {"experts.gate_up_proj": "experts.fc1.weight", "experts.down_proj": "experts.fc2.weight"}


def _moe(f: ConfigFields) -> MoEConfig:
    act = f.activation()
    if act != "silu":
        raise ValueError(f"{f.source}: hidden_act={f.get('hidden_act')!r}; Aria runs its routed experts with SiLU and "
                         f"its shared experts with hidden_act, and moeshard's block runs one activation for both")
    if f.bool("mlp_bias"):
        raise ValueError(f"{f.source}: mlp_bias=true puts biases on Aria's shared experts; moeshard's shared experts "
                         f"have none")
    I, shared = f.int("intermediate_size"), f.int("moe_num_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("moe_num_experts"), top_k=f.int("moe_topk"), hidden_size=f.int("hidden_size"),
                     intermediate_size=I, activation=act, scoring=f.family.routing, renormalize=False,
                     num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


# The transformers-5 defaults of AriaTextConfig's fields read here.
ARIA_TEXT = ModelFamily("aria_text", {"hidden_act": "silu", "mlp_bias": False, "moe_num_shared_experts": 2},
                        _moe, every_layer, routing="topk_softmax", router="router", fused_layout="transposed",
                        stored_names=_STORED, formats=("bf16",), router_dtype="model")
register_family(ARIA_TEXT)
register_family(replace(ARIA_TEXT, model_type="aria", text_config=True, text_model="model.language_model",
                        dense_renames=(("model.vision_tower.", "vision_tower."),
                                       ("model.multi_modal_projector.", "multi_modal_projector."))))

"""Qwen3-VL-MoE's text model (``qwen3_vl_moe_text``, the ``text_config`` of the vision-language
``qwen3_vl_moe``: Qwen3-VL-30B-A3B, -235B-A22B): Qwen3-MoE's block (softmax top-k, always
renormalized: its router has no ``norm_topk_prob``) and its dense-layer rule (``mlp_only_layers``,
``decoder_sparse_step``).

transformers builds no causal LM of it: the whole model is its image-text-to-text class
(``Qwen3VLMoeForConditionalGeneration``), whose decoder layers sit at ``model.language_model.layers``
(``ModelFamily.model_layers``) beside the vision tower (``model.visual``, transformers'), and which
generates from text alone as well (``hf_model.model_class``). The checkpoint stores the text model
under ``model.language_model.``, which ``SafetensorsCheckpoint`` names as a causal LM's
(``model.``; ``text_model`` maps the model's names onto those), and the routed experts fused:
the published checkpoints transposed (``gate_up_proj`` [E, H, 2I] with gate columns first,
``down_proj`` [E, I, H]: ``stored_fused_layouts`` ``transposed``), transformers' own saves as it
holds them (``gate_up_rows``); the stored shape tells which. Full-precision checkpoints only.
"""

from __future__ import annotations

from dataclasses import replace

from moeshard.checkpoint.families import FAMILIES, register_family

_QWEN3 = FAMILIES["qwen3_moe"]
register_family(replace(_QWEN3, model_type="qwen3_vl_moe_text", defaults={**_QWEN3.defaults, "norm_topk_prob": True},
                        stored_fused_layouts=("transposed",),
                        text_model="model.language_model", formats=("bf16",)))

"""DeepSeek-OCR 2's text model (``deepseek_ocr2_text``, the ``text_config`` of the vision-language
``deepseek_ocr2``): DeepSeek-V2's block (``models.deepseek_v2``: fp32 softmax over every routed
expert, the top K of it, ``topk_method`` ``greedy`` or ``group_limited_greedy``, never
renormalized, times ``routed_scaling_factor``; ``n_shared_experts`` shared experts as one MLP)
in front of plain multi-head attention. Its dense layers are exactly those ``mlp_layer_types``
marks ``"dense"``; transformers builds no model of a config without that list, so moeshard refuses
one, naming the field.

transformers builds no causal LM of it: the whole model is its image-text-to-text class
(``DeepseekOcr2ForConditionalGeneration``), whose decoder layers sit at
``model.language_model.layers`` beside the SAM and Qwen2 vision encoders (transformers') and which
generates from text alone as well. The checkpoint, transformers' own saves included, stores the
text model as a causal LM's (``model.layers.{L}.``: ``text_model`` maps the model's names onto
those) and the routed experts per expert (``experts.{e}.gate_proj.weight``, ``up_proj``,
``down_proj``); the vision encoders, the projector and the view separator keep the release's names
(``sam_model.blocks``, ``qwen2_model.model.model``, ``projector.layers``, ``view_seperator``:
``DENSE_RENAMES``, transformers' conversion mapping run backwards). Full-precision checkpoints only.
"""

from __future__ import annotations

import re
from dataclasses import replace

from moeshard.checkpoint.families import ConfigFields, DenseLayers, DenseRename, register_family
from moeshard.checkpoint.models.deepseek_v2 import FAMILY as DEEPSEEK_V2
from moeshard.checkpoint.models.layer_types import mlp_layer_types

_SAM, _STORED_SAM = "model.vision_tower.sam_encoder.", "model.sam_model."
# (model part, stored part): the SAM encoder's names in the model -> the release's, each a whole
# part (Unlimited OCR's release stores it the same way).
SAM_RENAMES: tuple[DenseRename, ...] = (
    *((f"{_SAM}{a}", f"{_STORED_SAM}{b}") for a, b in (
        ("neck.conv1.", "neck.0."), ("neck.layer_norm1.", "neck.1."), ("neck.conv2.", "neck.2."),
        ("neck.layer_norm2.", "neck.3."), ("proj.conv1.", "net_2."), ("proj.conv2.", "net_3."),
        ("patch_embed.projection.", "patch_embed.proj."), ("pos_embed", "pos_embed"))),
    (re.compile(re.escape(_SAM) + r"layers\.(\d+)\.layer_norm([12])\."), _STORED_SAM + r"blocks.\1.norm\2."),
    (f"{_SAM}layers.", f"{_STORED_SAM}blocks."),
)
# ... and the rest of the vision tower, the projector and the view separator.
DENSE_RENAMES: tuple[DenseRename, ...] = (
    *SAM_RENAMES,
    ("model.vision_tower.vision_encoder.", "model.qwen2_model.model.model."),
    ("model.vision_tower.query_768_resolution.", "model.qwen2_model.query_768."),
    ("model.vision_tower.query_1024_resolution.", "model.qwen2_model.query_1024."),
    ("model.multi_modal_projector.", "model.projector.layers."),
    ("model.view_separator", "model.view_seperator"),
)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    """The layers ``mlp_layer_types`` marks ``"dense"``; ValueError naming the field without it."""
    types = mlp_layer_types(f, num_layers)
    if types is None:
        raise ValueError(f"{f.source}: mlp_layer_types is missing; DeepSeek-OCR 2's text model builds each layer's "
                         f"MLP from it ('dense' or 'sparse' per layer), and transformers cannot build one without it")
    return DenseLayers(num_layers, lambda layer: "mlp_layer_types[layer] is 'dense'" if types[layer] == "dense" else None)


FAMILY = register_family(replace(DEEPSEEK_V2, model_type="deepseek_ocr2_text",
                                 defaults={"hidden_act": "silu", "topk_method": "greedy", "routed_scaling_factor": 1.0,
                                           "n_shared_experts": 2, "mlp_layer_types": None},
                                 dense_layers=_dense_layers, text_model="model.language_model",
                                 dense_renames=DENSE_RENAMES, formats=("bf16",)))

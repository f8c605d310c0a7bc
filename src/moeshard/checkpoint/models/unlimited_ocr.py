"""Unlimited OCR's text model (``unlimited_ocr_text``, the ``text_config`` of the vision-language
``unlimited_ocr``): DeepSeek-OCR 2's block (``models.deepseek_ocr2``: DeepSeek-V2's fp32 softmax
router, ``greedy`` or ``group_limited_greedy``, never renormalized, ``routed_scaling_factor``;
``n_shared_experts`` shared experts as one MLP) in front of multi-head attention over a sliding
window that also keeps the image and prompt tokens (``reference_sliding_attention``, transformers').
Its dense layers are those ``mlp_layer_types`` marks ``"dense"``, else the first
``first_k_dense_replace`` (1), as transformers' config class fills the list in.

It runs as transformers' image-text-to-text model (``UnlimitedOcrForConditionalGeneration``),
its decoder layers at ``model.language_model.layers``; the checkpoint, transformers' own saves
included, stores the text model as a causal LM's (``model.layers.{L}.``) with per-expert tensors,
the SAM encoder as DeepSeek-OCR 2's release does, the CLIP-style encoder under
``model.vision_model.transformer.`` with each attention's q, k and v rows in one ``qkv_proj``
(``dense_split``; the text attention's are stored apart, and are read as such), the projector and
the view separator under the release's names (``DENSE_RENAMES``). Full-precision checkpoints
only. The original release's config.json holds the text model in ``language_config`` (and its
``sliding_window`` at the top level, for transformers' config class, which builds the attention);
it is read as this family, as transformers reads it (``release_text_config``).
"""

from __future__ import annotations

from dataclasses import replace

from moeshard.checkpoint.families import ConfigFields, DenseLayers, DenseRename, register_family
from moeshard.checkpoint.models.deepseek_ocr2 import FAMILY as DEEPSEEK_OCR2
from moeshard.checkpoint.models.deepseek_ocr2 import SAM_RENAMES
from moeshard.checkpoint.models.layer_types import listed_or_first_dense

DENSE_RENAMES: tuple[DenseRename, ...] = (
    *SAM_RENAMES,
    ("model.vision_tower.vision_encoder.encoder.", "model.vision_model.transformer."),
    ("model.vision_tower.vision_encoder.", "model.vision_model."),
    ("model.multi_modal_projector.", "model.projector.layers."),
    ("model.view_separator", "model.view_seperator"),
)
# The vision encoder's attention: q, k and v rows stored as one tensor, in that order.
DENSE_SPLIT = {f"self_attn.qkv_proj.{kind}": tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv")
               for kind in ("weight", "bias")}


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, "first_k_dense_replace")


register_family(replace(DEEPSEEK_OCR2, model_type="unlimited_ocr_text",
                        defaults={"hidden_act": "silu", "topk_method": "greedy", "routed_scaling_factor": 1.0,
                                  "n_shared_experts": 2, "n_group": 1, "topk_group": 1, "mlp_layer_types": None,
                                  "first_k_dense_replace": 1},
                        dense_layers=_dense_layers, dense_renames=DENSE_RENAMES, dense_split=DENSE_SPLIT,
                        release_text_config=("unlimited_ocr", "language_config")))

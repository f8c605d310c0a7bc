"""MiniMax-M3's text model (``model_type`` ``minimax_m3_vl_text``): sigmoid-scored experts with a
selection bias and the clamped SwiGLU, one shared expert, dense and MoE layers listed per layer.

What transformers' ``MiniMaxM3VLSparseMoeBlock`` computes, and where moeshard has it:

=========================================  ======================================================
transformers                               moeshard
=========================================  ======================================================
``gate``: logits = x W^T in the model      routing kind ``sigmoid``, one group, ``renormalize``,
dtype; s = sigmoid(logits); top-k of s +   ``use_correction_bias``; ``router_dtype`` "model"
``e_score_correction_bias``; their s
renormalized to sum 1
experts' sum times ``routed_scaling_factor`` ``MoEConfig.routed_scaling_factor``
``experts.gate_up_proj`` [E, 2I, H] (gate  fused layout ``gate_up_rows``; activation
rows, then up), ``_apply_gate``: the        ``swiglu_clamped`` (alpha 1.702, limit 7.0, the values
clamped SwiGLU of gpt-oss                  of the published model; others are refused by name)
``shared_experts`` (one MLP of width        one shared expert of ``shared_intermediate_size``,
``shared_intermediate_size``, the same      the same activation; its fused ``gate_up_proj``
clamped SwiGLU), added after the scaling   [2S, H] is read as gate and up (``checkpoint.names``)
``mlp_layer_types``: "dense" layers run    dense layers (``layer_types.mlp_layer_types``; the hub
a dense MLP                                config's per-layer ``moe_layer_freq`` list, which
                                           transformers turns into it, is read too)
=========================================  ======================================================

The checkpoint MiniMax publishes keeps the block under ``block_sparse_moe.`` with per-expert
``w1`` / ``w3`` / ``w2``, the shared MLP's ``gate_proj`` / ``up_proj`` apart, and the selection
bias on the block (``block_sparse_moe.e_score_correction_bias``); transformers holds it under
``mlp.`` with the bias on ``gate``. Both are read. ``hidden_act`` is not what the MLPs compute
(transformers sets it to silu whatever config.json says), so it is not read. The attention, its
block-sparse indexer and the dense MLPs stay transformers'.

The published checkpoint is the vision-language ``minimax_m3_vl``, a family of its own
(``text_config``): config.json holds this text model in ``text_config``, and transformers builds
the whole image-text-to-text model, its decoder layers at ``model.language_model.layers``. The
checkpoint, published or saved by transformers, keeps the text model under ``language_model.model.``
(which ``SafetensorsCheckpoint`` names as the causal LM's ``model.``: ``text_model``), the
indexer's tensors as ``self_attn.index_q_proj`` (transformers' ``self_attn.indexer.q_proj``), the
dense MLPs' gate and up apart (transformers' fused ``mlp.gate_up_proj``: ``dense_concat``), and the
vision tower and projector under the names of the release (``dense_renames``); transformers' own
model names are read as well, and so are transformers 5.17's saves, which hold the dense layers' and
the vision tower's MLPs under ``block_sparse_moe.`` too.
"""

from __future__ import annotations

from dataclasses import replace

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.gpt_oss import clamped_swiglu
from moeshard.checkpoint.models.layer_types import listed_or_first_dense, moe_layer_list
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("intermediate_size"),
                     activation=clamped_swiglu(f, "MiniMax-M3"), scoring=f.family.routing, renormalize=True,
                     use_correction_bias=True,
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     num_shared_experts=1, shared_intermediate_size=f.int("shared_intermediate_size"))


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    """``mlp_layer_types``'s "dense" layers; without it, the zeros of a per-layer
    ``moe_layer_freq`` list (the hub config's spelling); without either, none."""
    if f.get("moe_layer_freq") is None or f.get("mlp_layer_types") is not None:
        return listed_or_first_dense(f, num_layers, 0)
    sparse = moe_layer_list(f, num_layers)
    return DenseLayers(num_layers, lambda layer: None if sparse[layer] else "moe_layer_freq[layer] is 0")


MINIMAX_M3_TEXT = ModelFamily(
    "minimax_m3_vl_text", {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "routed_scaling_factor": 2.0,
                           "shared_intermediate_size": 3072, "intermediate_size": 3072, "num_local_experts": 128,
                           "num_experts_per_tok": 4, "mlp_layer_types": None, "moe_layer_freq": None},
    _moe, _dense_layers, routing="sigmoid", block_prefixes=("block_sparse_moe.", "mlp."),
    bias_aliases=("e_score_correction_bias",), router_dtype="model")
register_family(MINIMAX_M3_TEXT)

# (the whole model's name part, as the release stores it)
_VL_RENAMES = (*((f".self_attn.indexer.{t}.", f".self_attn.index_{t}.") for t in ("q_proj", "k_proj", "q_norm", "k_norm")),
               ("model.vision_tower.embeddings.proj.", "vision_tower.vision_model.embeddings.patch_embedding."),
               ("model.vision_tower.layers.", "vision_tower.vision_model.encoder.layers."),
               ("model.vision_tower.", "vision_tower.vision_model."),
               ("model.multi_modal_projector.merge_linear_", "patch_merge_mlp.linear_"),
               ("model.multi_modal_projector.", "multi_modal_projector."),
               # transformers 5.17's saves: its rename of the block's mlp. reached the dense layers' and
               # the tower's MLPs too
               (".mlp.", ".block_sparse_moe."))
register_family(replace(MINIMAX_M3_TEXT, model_type="minimax_m3_vl", text_config=True,
                        text_model="model.language_model",
                        dense_renames=_VL_RENAMES,
                        dense_concat={".mlp.gate_up_proj.weight": (".mlp.gate_proj.weight", ".mlp.up_proj.weight")}))

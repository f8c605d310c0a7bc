"""HY-V4 (hy_v4): DeepSeek-V3's routing, routed experts that clamp their SwiGLU, and a shared MLP
that does not.

transformers' router (``gate``: an fp32 weight [E, H] on widened hidden states) takes sigmoid
scores, selects on scores + ``e_score_correction_bias`` within the best ``topk_group`` of
``n_group`` groups, renormalizes when ``norm_topk_prob`` (dividing by the sum plus 1e-20, the same
fp32 quotient as a floor of 1e-20 for these positive sums) and multiplies by
``routed_scaling_factor``: routing kind ``sigmoid``. Its routed experts compute
silu(min(gate, swiglu_limit)) * clamp(up, -swiglu_limit, swiglu_limit) (activation
``silu_clamped``, whose limit config.json's ``swiglu_limit`` must equal), its shared MLP
(``n_shared_experts`` x ``moe_intermediate_size`` wide) plain ``hidden_act``
(``MoEConfig.shared_activation``). Dense layers: ``mlp_layer_types``, else layer 0.

The hyper-connections around the attention and the block, the indexed attention with its sinks
and output gate, and the model's hyper-connection head stay transformers'. The checkpoint keeps
the hub's names for those (``hc_pre.hc_attn_layer.hc_fn`` for the model's ``attn_hc.fn``,
``learnable_sink_param`` for ``sinks``, ``linear_gate`` for every ``gate_proj``, the shared
MLP's included: ``dense_renames``, ``stored_names``), which transformers' own saves write too;
the routed experts are stored fused.

HY-V4-VL's text model (``hy_v4_vl_text``, the ``text_config`` of the vision-language ``hy_v4_vl``)
is HY-V4's block exactly, in a model transformers builds only as image-text-to-text
(``hf_model.model_class``; decoder layers at ``model.language_model.layers``). Its checkpoints
(the release and transformers' saves alike) keep the text model as a causal LM's, ``model.layers.*``
(``text_model`` maps the model's names onto those), the head's tensors as
``hc_head.hc_pre.hc_head_fn`` (read beside the text model's spelling), and the vision tower under
``vit.`` with the release's inner names (``input_layernorm`` for the model's ``layer_norm1``, the
patch merger as ``perceive``), each tower tensor renamed by every rename that applies
(``ModelFamily.dense_sources``).
"""

from __future__ import annotations

from dataclasses import replace

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

ACTIVATION = "silu_clamped"


def _moe(f: ConfigFields) -> MoEConfig:
    activation = f.fixed_activation(ACTIVATION, {"swiglu_limit": "limit"}, "transformers' HYV4Config default")
    shared = f.int("n_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=activation, shared_activation=f.activation() if shared else None,
                     scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     n_group=f.int("n_group"), topk_group=f.int("topk_group"), use_correction_bias=True,
                     num_shared_experts=shared, shared_intermediate_size=f.int("moe_intermediate_size") if shared else 0)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, 1)


_HYPER = tuple((f"{model}.{part}", f"hc_pre.{stored}.hc_{part}")
               for model, stored in (("attn_hc", "hc_attn_layer"), ("ffn_hc", "hc_mlp_layer"))
               for part in ("fn", "base", "scale"))
_HEAD = tuple((f"hc_head.hc_{part}", f"hc_pre.hc_head.hc_head_{part}") for part in ("fn", "base", "scale"))

HY_V4 = ModelFamily(
    "hy_v4", {"hidden_act": "silu", "swiglu_limit": 10.0, "n_shared_experts": 1, "routed_scaling_factor": 2.827,
              "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "mlp_layer_types": None},
    _moe, _dense_layers, routing="sigmoid", router_dtype="fp32",
    stored_names={"shared_experts.gate_proj.weight": "shared_experts.linear_gate.weight"},
    dense_renames=(*_HYPER, *_HEAD, ("self_attn.sinks", "self_attn.learnable_sink_param"),
                   ("self_attn.gate_proj", "self_attn.linear_gate"), ("mlp.gate_proj", "mlp.linear_gate")),
    formats=("bf16",))
register_family(HY_V4)

# HY-V4-VL's head and vision tower as its checkpoints name them; the tower's prefix last, so that
# an inner rename composes with it.
_VL_HEAD = tuple((f"hc_head.hc_{part}", f"hc_head.hc_pre.hc_head_{part}") for part in ("fn", "base", "scale"))
_VISION = (("model.vision_tower.patch_merger.before_rms.", "vit.perceive.norm."),
           ("model.vision_tower.patch_merger.proj_conv.", "vit.perceive.proj.0."),
           ("model.vision_tower.patch_merger.proj_out.", "vit.perceive.proj.2."),
           ("model.vision_tower.patch_merger.", "vit.perceive."),
           (".layer_norm1.", ".input_layernorm."), (".layer_norm2.", ".post_attention_layernorm."),
           (".mlp.fc1.", ".mlp.dense_h_to_4h."), (".mlp.fc2.", ".mlp.dense_4h_to_h."),
           ("model.vision_tower.", "vit."))
register_family(replace(HY_V4, model_type="hy_v4_vl_text",
                        text_model="model.language_model", dense_renames=(*HY_V4.dense_renames, *_VL_HEAD, *_VISION)))

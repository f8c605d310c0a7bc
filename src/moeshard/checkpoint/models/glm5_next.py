"""GLM-5.3-Flash's text model (``glm5_next_text``, the ``text_config`` of the vision-language
``glm5_next``): HY-V4's router and clamped SwiGLU experts, with a shared MLP that clamps too.

What transformers' ``Glm5NextTextMoE`` computes, and where moeshard has it:

==========================================  =====================================================
transformers                                moeshard
==========================================  =====================================================
``gate``: fp32 logits (an fp32 weight on    routing kind ``sigmoid``, ``router_dtype`` "fp32":
widened rows); sigmoid scores; top-k of     ``use_correction_bias``, ``n_group`` / ``topk_group``,
scores + ``e_score_correction_bias``        ``renormalize`` = ``norm_topk_prob``,
within the best ``topk_group`` of           ``routed_scaling_factor``
``n_group`` groups; unbiased scores over
their sum + 1e-20; times the scaling
routed experts: ``gate_up_proj`` [E, 2I,    fused layout ``gate_up_rows``; activation
H], silu(min(gate, L)) * clamp(up, -L, L)   ``silu_clamped`` (config.json's ``swiglu_limit``
with L = ``swiglu_limit``                   must be its limit, 10)
``shared_experts``: one MLP                 ``n_shared_experts`` shared experts fused, the same
``n_shared_experts`` x I wide, the same     ``silu_clamped`` (``shared_activation``); hence
clamp with ``hidden_act``                   ``hidden_act`` must be silu
==========================================  =====================================================

Dense layers: ``mlp_layer_types``, else the first three. transformers builds only the whole
image-text-to-text model (``hf_model.model_class``): decoder layers at
``model.language_model.layers``, the vision tower at ``model.visual``, both as the checkpoint names
them but for the text model's part (``text_model``). The linear attention, the indexed attention,
the hyper-connections and the dense MLPs stay transformers'; the checkpoint keeps the release's
names for some (``hc_attn_fn`` for the model's ``attn_hc.fn``, the forget gate's tensors outside
``forget_gate.``: ``dense_renames``) and the linear attention's convolution as three
(``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, stacked in the model: ``dense_concat``), which
transformers' own saves write too; the routed experts per expert. A config.json of model type
``glm5_next`` with the text fields at its top level and no ``text_config`` (what transformers'
config class calls a flat, text-only GLM-5.3-Flash checkpoint) is refused
(``models/refusals.py``): its checkpoint holds no vision tower for the model transformers builds.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

ACTIVATION = "silu_clamped"


def _moe(f: ConfigFields) -> MoEConfig:
    if f.get("hidden_act") != "silu":
        raise ValueError(f"{f.source}: hidden_act={f.get('hidden_act')!r}; GLM-5.3-Flash's shared MLP clamps "
                         f"hidden_act's SwiGLU as its routed experts clamp silu's, and moeshard has that clamp for "
                         f"silu only ({ACTIVATION!r})")
    activation = f.fixed_activation(ACTIVATION, {"swiglu_limit": "limit"}, "transformers' Glm5NextTextConfig default")
    shared, I = f.int("n_shared_experts", minimum=0), f.int("moe_intermediate_size")
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I,
                     activation=activation, shared_activation=activation if shared else None,
                     scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     n_group=f.int("n_group"), topk_group=f.int("topk_group"), use_correction_bias=True,
                     num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, 3)


_HYPER = tuple((f".{hc}_hc.{part}", f".hc_{hc}_{part}") for hc in ("attn", "ffn") for part in ("fn", "base", "scale"))

# The transformers-5 defaults of Glm5NextTextConfig's fields read here.
register_family(ModelFamily(
    "glm5_next_text", {"hidden_act": "silu", "swiglu_limit": 10.0, "n_shared_experts": 1,
                       "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                       "mlp_layer_types": None},
    _moe, _dense_layers, routing="sigmoid", router_dtype="fp32",
    text_model="model.language_model",
    dense_renames=(*_HYPER, (".self_attn.forget_gate.", ".self_attn.")),
    dense_concat={".self_attn.conv1d.weight": tuple(f".self_attn.{p}_conv1d.weight" for p in "qkv")},
    formats=("bf16",)))

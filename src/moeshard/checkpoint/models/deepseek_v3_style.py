"""Families whose blocks are DeepSeek-V3's: GLM-4-MoE, GLM-4-MoE-Lite, dots1, EXAONE-MoE,
DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``; their attention, with its indexer, stays
transformers'), Solar Open, A.X-K2 (whose gated norms and attention stay transformers'), A.X-K1
(whose block ends in an RMS norm of its output, ``post_mlp_layernorm``: ``ModelFamily.output_norm``,
which the hub and transformers' saves keep under the decoder layer), and
Sarvam's two: ``sarvam_moe`` and ``sarvam_mla``, which transformers builds as GLM-4-MoE and as
DeepSeek-V3, and GLM-4.5V's text model (``glm4v_moe_text``, the ``text_config`` of the
vision-language ``glm4v_moe``), GLM-4-MoE's block in a model transformers builds only whole: its
image-text-to-text class runs (``hf_model.model_class``), the decoder layers at
``model.language_model.layers`` (``model_layers``), the vision tower transformers'; the checkpoint's
text model, under ``model.language_model.``, is named as a causal LM's by ``SafetensorsCheckpoint``
(``text_model`` maps the model's names onto those), its experts per expert as GLM-4.5V publishes
them or fused as transformers saves them.

Their transformers router is DeepSeek-V3's ``noaux_tc`` (routing kind ``sigmoid``):
s = sigmoid(fp32 logits), selection on s + ``e_score_correction_bias`` within the ``topk_group``
best of ``n_group`` groups (a group scored by its best two), weights the unbiased s of the
chosen experts, renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``. A block
adds ``n_shared`` shared experts of ``moe_intermediate_size`` fused into one MLP. transformers
reads neither ``scoring_func`` nor ``topk_method`` for these model types, so neither is read here.

=============  ===================================  ==============  =====  =============================
model_type     experts / shared experts fields      norm_topk_prob  scale  dense layers
=============  ===================================  ==============  =====  =============================
glm4_moe       n_routed_experts / n_shared_experts  True            1.0    L < first_k_dense_replace (1)
glm4v_moe_     n_routed_experts / n_shared_experts  True            1.0    L < first_k_dense_replace (1)
text
glm4_moe_lite  n_routed_experts / n_shared_experts  True            1.8    mlp_layer_types, else layer 0
dots1          n_routed_experts / n_shared_experts  False           1.0    L < first_k_dense_replace (0)
exaone_moe     num_experts / num_shared_experts     True            2.5    mlp_layer_types, else
                                                                           L < first_k_dense_replace (1)
deepseek_v32   n_routed_experts / n_shared_experts  True            2.5    mlp_layer_types, else
                                                                           L < first_k_dense_replace (3)
glm_moe_dsa    n_routed_experts / n_shared_experts  True            2.5    mlp_layer_types, else
                                                                           L < first_k_dense_replace (3)
solar_open     n_routed_experts / n_shared_experts  True            1.0    none (its config class has no
                                                                           first_k_dense_replace)
axk2           n_routed_experts / n_shared_experts  True            2.5    mlp_layer_types, else
                                                                           L < first_k_dense_replace (1)
                                                                           or L % moe_layer_freq != 0
sarvam_moe     n_routed_experts / n_shared_experts  True            2.5    L < first_k_dense_replace (1)
sarvam_mla     n_routed_experts / n_shared_experts  True            2.5    L < first_k_dense_replace (1)
dots3_note_    n_routed_experts / n_shared_experts  True            1.0    mlp_layer_types, else
text                                                                       L < first_k_dense_replace (1)
                                                                           or moe_layer_freq says dense
axk1           n_routed_experts / n_shared_experts  True            2.5    mlp_layer_types, else
                                                                           L < first_k_dense_replace (1)
                                                                           or L % moe_layer_freq != 0
=============  ===================================  ==============  =====  =============================

(``n_group`` and ``topk_group`` default to 1 everywhere but DeepSeek-V3.2, 8 and 4; these are the
defaults of the transformers-5 config classes, used when config.json omits a field; dots1 has none
for ``n_shared_experts``). EXAONE-MoE checkpoints keep the bias on the block,
``mlp.e_score_correction_bias``, which transformers renames to ``mlp.gate.e_score_correction_bias``:
both names are read. A.X-K2's checkpoints name its gated norms' low-rank MLP ``W_down`` / ``W_up``
(transformers' ``mlp.fc1`` / ``mlp.fc2``) and its fused query and gate projection ``q_b_proj``
(transformers' ``q_gate_proj``), read through ``dense_renames``; a null ``n_group`` / ``topk_group``
(A.X-K2-Light) is one group. Sarvam-MoE's checkpoints keep its original names, which transformers
renames as it loads: ``model.word_embeddings``, ``attention.dense`` / ``query_layernorm`` /
``key_layernorm`` (``dense_renames``), the query, key and value rows fused in
``attention.query_key_value`` (``dense_split``), the selection bias as ``gate.expert_bias``
(``bias_aliases``); its config.json may spell the expert counts ``num_experts`` and
``num_shared_experts``, and so may Sarvam-MLA's, whose checkpoints keep DeepSeek-V3's names.
dots.note 3's text model (``dots3_note_text``; its indexed and sliding-window attention stay
transformers') sizes its shared experts by ``shared_experts_intermediate_size`` (an older
config.json: ``moe_shared_expert_intermediate_size``); ``mlp_bias`` would put biases on them and
is refused.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, every_layer, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense, moe_layer_list
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

# model_type -> config.json's names of its routed and shared expert counts.
_EXPERTS = {"glm4_moe": "n_routed_experts", "glm4v_moe_text": "n_routed_experts", "glm4_moe_lite": "n_routed_experts",
            "dots1": "n_routed_experts",
            "exaone_moe": "num_experts", "deepseek_v32": "n_routed_experts", "glm_moe_dsa": "n_routed_experts",
            "solar_open": "n_routed_experts", "axk2": "n_routed_experts", "sarvam_moe": "n_routed_experts",
            "sarvam_mla": "n_routed_experts", "dots3_note_text": "n_routed_experts", "axk1": "n_routed_experts"}
_SHARED = {"glm4_moe": "n_shared_experts", "glm4v_moe_text": "n_shared_experts", "glm4_moe_lite": "n_shared_experts",
           "dots1": "n_shared_experts",
           "exaone_moe": "num_shared_experts", "deepseek_v32": "n_shared_experts", "glm_moe_dsa": "n_shared_experts",
           "solar_open": "n_shared_experts", "axk2": "n_shared_experts", "sarvam_moe": "n_shared_experts",
           "sarvam_mla": "n_shared_experts", "dots3_note_text": "n_shared_experts", "axk1": "n_shared_experts"}


# model_type -> the field of one shared expert's width, where it is not moe_intermediate_size.
_SHARED_WIDTH = {"dots3_note_text": "shared_experts_intermediate_size"}
# Families whose shared experts take biases when config.json's mlp_bias is true.
_SHARED_BIAS = ("dots3_note_text",)


def _moe(f: ConfigFields) -> MoEConfig:
    model_type = f.family.model_type
    act, H = f.activation(), f.int("hidden_size")
    I = f.int("moe_intermediate_size")
    shared = f.int(_SHARED[model_type], minimum=0)
    if shared and model_type in _SHARED_BIAS and f.raw.get("mlp_bias"):
        raise ValueError(f"{f.source}: mlp_bias=true puts biases on the shared experts; moeshard's shared experts "
                         f"have none")
    width = f.int(_SHARED_WIDTH[model_type]) if model_type in _SHARED_WIDTH else I
    return MoEConfig(num_experts=f.int(_EXPERTS[model_type]), top_k=f.int("num_experts_per_tok"), hidden_size=H,
                     intermediate_size=I, activation=act, scoring=f.family.routing,
                     renormalize=f.bool("norm_topk_prob"), n_group=f.int("n_group"), topk_group=f.int("topk_group"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=True, num_shared_experts=shared, shared_intermediate_size=width if shared else 0)


def _first_k_dense(f: ConfigFields, num_layers: int) -> DenseLayers:
    first = f.int("first_k_dense_replace", minimum=0)
    return DenseLayers(num_layers, lambda layer: f"layer < first_k_dense_replace={first}" if layer < first else None)


def _first_k_then_freq(f: ConfigFields, num_layers: int, freq_lists: bool = False) -> DenseLayers:
    """``mlp_layer_types`` when given; else layer L is dense below ``first_k_dense_replace`` and
    where ``moe_layer_freq`` does not divide L, or, with ``freq_lists`` (dots.note 3's older
    config.json), where a per-layer ``moe_layer_freq`` list holds 0 at L."""
    if f.raw.get("mlp_layer_types") is not None:
        return listed_or_first_dense(f, num_layers, 0)
    first, freq = f.int("first_k_dense_replace", minimum=0), f.get("moe_layer_freq")
    if freq_lists and isinstance(freq, list):
        sparse = moe_layer_list(f, num_layers)

        def off_freq(layer: int) -> str | None:
            return None if sparse[layer] else f"moe_layer_freq[{layer}] is 0 (no mlp_layer_types)"
    else:
        step = f.int("moe_layer_freq")

        def off_freq(layer: int) -> str | None:
            return f"layer % moe_layer_freq={step} != 0 (no mlp_layer_types)" if layer % step else None

    def why(layer: int) -> str | None:
        if layer < first:
            return f"layer < first_k_dense_replace={first} (no mlp_layer_types)"
        return off_freq(layer)
    return DenseLayers(num_layers, why)


def _axk2_dense(f: ConfigFields, num_layers: int) -> DenseLayers:
    return _first_k_then_freq(f, num_layers)


def _dots3_dense(f: ConfigFields, num_layers: int) -> DenseLayers:
    return _first_k_then_freq(f, num_layers, freq_lists=True)


def _glm4_moe_lite_dense(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, 1)


def _listed_or_first_k_dense(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, "first_k_dense_replace")


_ROUTER = {"hidden_act": "silu", "n_group": 1, "topk_group": 1}
# transformers keeps these routers' weights in fp32 (_keep_in_fp32_modules_strict) and computes
# their logits in fp32: router_dtype "fp32".

for _family in (
    # GLM-4.5/4.6's FP8 releases are compressed-tensors checkpoints (per-channel weights).
    ModelFamily("glm4_moe", {**_ROUTER, "n_shared_experts": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
                             "first_k_dense_replace": 1}, _moe, _first_k_dense, routing="sigmoid", router_dtype="fp32",
                formats=("bf16", "fp8_block", "compressed_fp8")),
    ModelFamily("glm4v_moe_text", {**_ROUTER, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                                   "norm_topk_prob": True, "first_k_dense_replace": 1},
                _moe, _first_k_dense, routing="sigmoid", router_dtype="fp32",
                text_model="model.language_model", formats=("bf16",)),
    ModelFamily("glm4_moe_lite", {**_ROUTER, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
                                  "norm_topk_prob": True, "mlp_layer_types": None},
                _moe, _glm4_moe_lite_dense, routing="sigmoid", router_dtype="fp32"),
    ModelFamily("dots1", {**_ROUTER, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
                          "first_k_dense_replace": 0}, _moe, _first_k_dense, routing="sigmoid", router_dtype="fp32"),
    ModelFamily("exaone_moe", {**_ROUTER, "num_shared_experts": 1, "routed_scaling_factor": 2.5,
                               "norm_topk_prob": True, "first_k_dense_replace": 1, "mlp_layer_types": None},
                _moe, _listed_or_first_k_dense, routing="sigmoid", bias_aliases=("e_score_correction_bias",),
                router_dtype="fp32"),
    ModelFamily("deepseek_v32", {**_ROUTER, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
                                 "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3,
                                 "mlp_layer_types": None},
                _moe, _listed_or_first_k_dense, routing="sigmoid", router_dtype="fp32"),
    ModelFamily("glm_moe_dsa", {**_ROUTER, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                                "first_k_dense_replace": 3, "mlp_layer_types": None},
                _moe, _listed_or_first_k_dense, routing="sigmoid", router_dtype="fp32"),
    ModelFamily("solar_open", {**_ROUTER, "n_shared_experts": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True},
                _moe, every_layer, routing="sigmoid", router_dtype="fp32"),
    ModelFamily("axk2", {**_ROUTER, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                         "first_k_dense_replace": 1, "moe_layer_freq": 1, "mlp_layer_types": None},
                _moe, _axk2_dense, routing="sigmoid", router_dtype="fp32",
                dense_renames=(("mlp.fc1", "W_down"), ("mlp.fc2", "W_up"), ("self_attn.q_gate_proj.", "self_attn.q_b_proj."))),
    # A.X-K1: DeepSeek-V3's block ending in an RMS norm of the routed and shared experts' sum.
    ModelFamily("axk1", {**_ROUTER, "n_group": 8, "topk_group": 4, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                         "norm_topk_prob": True,
                         "first_k_dense_replace": 1, "moe_layer_freq": 1, "mlp_layer_types": None},
                _moe, _axk2_dense, routing="sigmoid", router_dtype="fp32", output_norm="post_mlp_layernorm",
                formats=("bf16",)),
    ModelFamily("sarvam_moe", {**_ROUTER, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                               "first_k_dense_replace": 1},
                _moe, _first_k_dense, routing="sigmoid", router_dtype="fp32", bias_aliases=("gate.expert_bias",),
                formats=("bf16",),
                dense_renames=(("model.embed_tokens.", "model.word_embeddings."),
                               ("self_attn.o_proj.", "attention.dense."),
                               ("self_attn.q_norm.", "attention.query_layernorm."),
                               ("self_attn.k_norm.", "attention.key_layernorm.")),
                dense_split={f"attention.query_key_value.{kind}": tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv")
                             for kind in ("weight", "bias")}),
    ModelFamily("sarvam_mla", {**_ROUTER, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                               "first_k_dense_replace": 1},
                _moe, _first_k_dense, routing="sigmoid", router_dtype="fp32", formats=("bf16",)),
    ModelFamily("dots3_note_text", {**_ROUTER, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                                    "norm_topk_prob": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                                    "shared_experts_intermediate_size": 1536, "mlp_layer_types": None},
                _moe, _dots3_dense, routing="sigmoid", router_dtype="fp32", formats=("bf16",)),
):
    register_family(_family)

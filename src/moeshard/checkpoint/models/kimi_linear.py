"""Kimi-Linear: DeepSeek-V3's MoE block beside Kimi delta attention (KDA) layers, whose weights
transformers renames and stacks as it loads the checkpoint.

The block (``KimiLinearMoE``; the checkpoint's ``block_sparse_moe.``, transformers' ``mlp``):
s = sigmoid(fp32 logits) of an fp32 router (``router_dtype="fp32"``), selection on s +
``e_score_correction_bias`` within the ``topk_group`` best of ``num_expert_group`` groups (a group
scored by its best two), the unbiased s renormalized when ``moe_renormalize``, times
``routed_scaling_factor`` (routing kind ``sigmoid``), plus ``num_shared_experts`` shared experts
of ``moe_intermediate_size`` fused into one MLP. Dense layers: ``mlp_layer_types``, else the first
``first_k_dense_replace`` (1).

config.json keeps the hub's names, which the transformers config class maps onto its own
(``num_experts_per_token`` for ``num_experts_per_tok``, ``moe_renormalize`` for
``norm_topk_prob``, ``num_expert_group`` for ``n_group``, ``num_shared_experts`` for
``n_shared_experts``); either spelling is read.

The checkpoint stores each KDA layer's forget-gate weights on the attention (``self_attn.f_a_proj``
for the model's ``self_attn.forget_gate.f_a_proj``, and ``f_b_proj``, ``dt_bias``, ``A_log``) and
its short convolution as three tensors (``q_conv1d``, ``k_conv1d``, ``v_conv1d``, stacked into
the model's ``conv1d``): ``dense_renames`` and ``dense_concat`` say so. A dense layer's MLP is
``mlp.`` on the hub and ``block_sparse_moe.`` where transformers saved the model (it renames every
``mlp.`` back as it saves): both are read.

Ling's hybrid models (``bailing_hybrid``) are read the same way: the same block, config names and
defaults of their own (``num_experts`` for the expert count, 8 groups keeping 4, scale 2.5, the
first two layers dense unless ``mlp_layer_types`` says otherwise), Kimi delta attention and MLA
layers, and a checkpoint under Ling's names: ``model.word_embeddings``, every attention tensor under
``attention.`` (the output projection ``attention.dense``; the forget gate's ``f_proj``, ``dt_bias``
and ``A_log`` on the attention), the short convolution as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``,
and the selection bias as ``gate.expert_bias``.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

# transformers' names of the routing fields -> the names config.json uses (the config class's attribute_map).
_HUB_NAMES = {"num_experts_per_tok": "num_experts_per_token", "norm_topk_prob": "moe_renormalize",
              "n_group": "num_expert_group", "n_shared_experts": "num_shared_experts"}


def _fields(f: ConfigFields) -> ConfigFields:
    """``f`` with each routing field under transformers' name, taken from the hub's where only that is given."""
    raw = dict(f.raw)
    for name, hub in _HUB_NAMES.items():
        if raw.get(name) is None and raw.get(hub) is not None:
            raw[name] = raw[hub]
    return ConfigFields(raw, f.family, f.source)


def _moe(f: ConfigFields) -> MoEConfig:
    f = _fields(f)
    I = f.int("moe_intermediate_size")
    shared = f.int("n_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"), n_group=f.int("n_group"),
                     topk_group=f.int("topk_group"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=True, num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, "first_k_dense_replace")


_CONV = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")

register_family(ModelFamily(
    "kimi_linear", {"hidden_act": "silu", "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                    "routed_scaling_factor": 2.446, "norm_topk_prob": True, "first_k_dense_replace": 1,
                    "mlp_layer_types": None},
    _moe, _dense_layers, routing="sigmoid", block_prefixes=("block_sparse_moe.", "mlp."), router_dtype="fp32",
    formats=("bf16",),
    dense_renames=(("self_attn.forget_gate.", "self_attn."), (".mlp.", ".block_sparse_moe.")),
    dense_concat={"self_attn.conv1d.weight": tuple(f"self_attn.{c}" for c in _CONV)}))
register_family(ModelFamily(
    "bailing_hybrid", {"hidden_act": "silu", "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
                       "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 2,
                       "mlp_layer_types": None},
    _moe, _dense_layers, routing="sigmoid", router_dtype="fp32", formats=("bf16",), bias_aliases=("gate.expert_bias",),
    # The more specific renames first: a tensor is read under the first whose stored name exists.
    dense_renames=(("model.embed_tokens.", "model.word_embeddings."), ("self_attn.forget_gate.", "attention."),
                   ("self_attn.o_proj.", "attention.dense."), ("self_attn.", "attention.")),
    dense_concat={"self_attn.conv1d.weight": tuple(f"attention.{c}" for c in _CONV)}))

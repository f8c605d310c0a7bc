"""Inkling 2's text models (inkling2_text, inkling2_loop_text): DeepSeek-V3's sigmoid routing in
one group, experts with a soft-capped SwiGLU, no shared experts, every layer MoE.

transformers' ``Inkling2SparseMoeBlock`` (``mlp``): a router ``gate`` (``weight`` [E, H] in fp32
on widened rows; sigmoid scores (``scoring_func``), top ``num_experts_per_tok`` of the scores
plus ``e_score_correction_bias``, the chosen scores divided by their sum plus 1e-20, times
``route_scale``): routing kind ``sigmoid`` with one group, always renormalized. Its experts
(``gate_up_proj`` [E, 2I, H] gate rows first, ``down_proj`` [E, H, I]) compute, in fp32,
c_g tanh(g / c_g) * sigmoid(g) * c_u tanh(u / c_u), c_g = ``mlp_gate_softcap`` (4.0), c_u =
``mlp_up_softcap`` (25.0): activation ``swiglu_softcapped`` (another cap refused). The attention
with its relative bias, sinks and short convolutions, the block attention residuals and, in the
loop model, the message gates stay transformers'. The loop model runs its layers
``loop_layer_index_start`` .. ``loop_layer_index_end - 1`` ``loop_num_passes`` times: their
blocks (one module each, the same weights) are called once per pass.

Their checkpoints, transformers' own saves included, keep the original names: the text model under
``model.llm.`` (``layers``; the model's decoder layers at ``model.layers``), the experts
``w13_weight`` interleaved (gate row 2i, up row 2i + 1: ``checkpoint_fused_layout``, while the
model holds ``gate_up_proj`` gate rows first) and ``w2_weight``, the selection bias ``gate.bias``,
the attention's and the layers' tensors under their own names, the block residuals' queries in one
list per kind (``attn_res.attn_queries.{L - 1}`` for layer L), the unembedding padded to
``vocab_size`` rows (``lm_head`` is its first ``unpadded_vocab_size``), and the loop model's
message queries as two tensors (``dense_convert``).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from moeshard.checkpoint.families import ConfigFields, DenseRename, ModelFamily, every_layer, register_family
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

ACTIVATION = "swiglu_softcapped"


def _moe(f: ConfigFields) -> MoEConfig:
    if f.get("scoring_func") != "sigmoid":
        raise ValueError(f"{f.source}: scoring_func={f.get('scoring_func')!r}; moeshard reads Inkling 2's 'sigmoid'")
    activation = f.fixed_activation(ACTIVATION, {"mlp_gate_softcap": "gate_cap", "mlp_up_softcap": "up_cap"},
                                    "transformers' Inkling2TextConfig default")
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=activation, scoring=f.family.routing, renormalize=True,
                     routed_scaling_factor=f.float("route_scale", 0.0, MAX_ROUTED_SCALING), use_correction_bias=True)


def _unpad(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """lm_head: the first rows of the stored unembedding (padded to vocab_size)."""
    if parts[0].shape[0] < shape[0] or tuple(parts[0].shape[1:]) != shape[1:]:
        raise ValueError(f"the stored unembedding {list(parts[0].shape)} does not hold lm_head {list(shape)}")
    return parts[0][: shape[0]]


def _message_queries(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """[loop layers, 4, H] (query, key, value, mlp) from the stored [2n, H] (query, mlp of each loop
    layer) and [2n, H] (key, value of each)."""
    queries, kv = (p.unflatten(0, (-1, 2)) for p in parts)
    return torch.cat([queries[:, :1], kv, queries[:, 1:]], dim=1)


# The model's name (after the text model's prefix) -> the checkpoint's, applied in order; a layer
# tensor gets the prefix and its inner rename together (ModelFamily.dense_sources).
_ATTENTION = (("self_attn.q_proj.linear.", "attn.wq_du."), ("self_attn.q_proj.norm.", "attn.q_l2_clip."),
              *((f"self_attn.{p}_proj.linear.", f"attn.w{p}_dv.") for p in "kv"),
              *((f"self_attn.{p}_proj.sconv.conv1d.weight", f"attn.{p}_sconv.weight") for p in "kv"),
              *((f"self_attn.{p}_proj.sconv.static_weight", f"attn.{p}_sconv.static_w") for p in "kv"),
              *((f"self_attn.{p}_proj.sconv.weight_proj.weight", f"attn.{p}_sconv.weight_proj") for p in "kv"),
              ("self_attn.o_proj.linear.", "attn.wo_ud."), ("self_attn.o_proj.gate_proj.", "attn.gate_attn."),
              ("self_attn.relative_position_bias.linear.", "attn.wr_du."),
              ("self_attn.relative_position_bias.norm.", "attn.rel_l2_clip."),
              ("self_attn.relative_position_bias.proj", "attn.rel_logits_proj.proj"),
              ("self_attn.sink_proj.", "attn.attn_sink_proj."))
_LAYER = ((".input_layernorm.", ".attn_norm."), *((f"{p}_input_layernorm.", f"{p}_input_norm.") for p in "qkv"),
          ("post_attention_layernorm.", "mlp_norm."),
          ("post_attention_convolution.conv1d.weight", "attn_sconv.weight"),
          ("post_mlp_convolution.conv1d.weight", "mlp_sconv.weight"))
_RESIDUALS: tuple[DenseRename, ...] = ((re.compile(r"layers\.(\d+)\.mlp_input\.query$"), r"attn_res.mlp_queries.\1"),
              (re.compile(r"layers\.(\d+)\.attention_input\.query$"),
               lambda m: f"attn_res.attn_queries.{int(m[1]) - 1}"),
              ("final_input.query", "attn_res.output_query"))
_RENAMES: tuple[DenseRename, ...] = (("model.", "model.llm."), ("embed_tokens.embed_norm.", "embed_norm."),
                                     ("embed_tokens.weight", "embed.weight"), *_RESIDUALS, *_LAYER, *_ATTENTION)

INKLING2 = ModelFamily(
    "inkling2_text", {"scoring_func": "sigmoid", "route_scale": 8.0, "mlp_gate_softcap": 4.0, "mlp_up_softcap": 25.0},
    _moe, every_layer, routing="sigmoid", router_dtype="fp32", layers="model.llm.layers", model_layers="model.layers",
    bias_aliases=("gate.bias",), checkpoint_fused_layout="interleaved",
    stored_names={"experts.gate_up_proj": "experts.w13_weight", "experts.down_proj": "experts.w2_weight"},
    dense_renames=_RENAMES, dense_convert={"lm_head.weight": (("model.llm.unembed.weight",), _unpad)},
    formats=("bf16", "mxfp8"))
register_family(INKLING2)

# The loop model's message gates: their inner names first, then the gate's module (composed in order).
_GATES = (("_message_gate.down_proj.weight", "_message_gate.down_weight"),
          ("_message_gate.message_gate_proj.weight", "_message_gate.gain_weight"),
          ("_message_gate.forget_gate_proj.weight", "_message_gate.forget_weight"),
          ("q_message_gate.", "controllers.attn."), ("k_message_gate.", "controllers.k."),
          ("v_message_gate.", "controllers.v."), ("mlp_message_gate.", "controllers.mlp."))
register_family(replace(
    INKLING2, model_type="inkling2_loop_text", dense_renames=(*_RENAMES, *_GATES),
    dense_convert={**INKLING2.dense_convert, "model.message_input.query": (
        ("model.llm.middle_cycle_cross_pass_queries", "model.llm.middle_cycle_cross_pass_kv_queries"),
        _message_queries)}))

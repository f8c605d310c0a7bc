"""DeepSeek-V4 (deepseek_v4): the block routes itself (``ModelFamily.experts_only``); moeshard runs
its routed experts, on the routing transformers computed.

Every layer's block (``mlp``) holds a router ``gate``, routed experts ``experts`` (``gate_up_proj``
[E, 2I, H] gate rows first, ``down_proj`` [E, H, I]) and one shared MLP ``shared_experts``. Its
first layers (``mlp_layer_types`` "hash_moe") pick each token's experts by its token id, a frozen
table ``gate.tid2eid`` [vocab, K], and weigh them by the router's scores; the others ("moe") pick
the top K of the scores plus ``gate.e_score_correction_bias``. The scores are sqrt(softplus) of
model-dtype logits, the K weights divided by their sum plus 1e-20 (whatever ``norm_topk_prob``
says) and multiplied by ``routed_scaling_factor``, all in the model dtype: routing kind
``sqrtsoftplus_bias_model``, which describes the learned layers' selection. The token ids reach
the block alone, so transformers' routers route and moeshard takes the ids and weights as given
(``MoEExperts``), in place of ``experts``; the routers, their tables and biases, and the shared MLP
(which clamps its SwiGLU too) stay transformers' and load as dense tensors.

The routed experts compute silu(min(gate, swiglu_limit)) * clamp(up, -swiglu_limit, swiglu_limit)
(activation ``silu_clamped``, whose limit config.json's ``swiglu_limit`` must equal). Every layer
is an MoE layer. The hyper-connections, the compressed and indexed attention and the
multi-token-prediction layers stay transformers'. Checkpoints as transformers saves them (bf16),
which is under the hub's names: the block ``ffn``, the experts ``experts.{e}.w1`` / ``w3`` / ``w2``,
the attention's and the hyper-connections' tensors renamed (``DENSE_RENAMES``); the release itself
also keeps its decoder layers and top-level tensors in a flat namespace (``layers.{L}.``,
``embed.weight``, ``norm.weight``, ``head.weight``, ``hc_head_fn``), which transformers reads too.
The FP8 release (``fp8_block_mxfp4``: FP8 dense weights with a UE8M0 scale per 128 x 128 block
under ``<module>.scale``, FP4 experts with one per 32 values; ``checkpoint.fp8_block_mxfp4``) is
dequantized as it is read; with FP8 experts (``expert_dtype`` fp8) it is an FP8 block checkpoint.
The release states ``expert_dtype`` at config.json's top level, which transformers (and moeshard:
``quantization_fields``) reads as part of its ``quantization_config``.
"""

from __future__ import annotations

import torch

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

ACTIVATION = "silu_clamped"
ROUTING = "sqrtsoftplus_bias_model"
# config.json's scoring_func -> the routing kind that describes it.
SCORING = {"sqrtsoftplus": ROUTING}


def _moe(f: ConfigFields) -> MoEConfig:
    if f.get("hidden_act") != "silu":
        raise ValueError(f"{f.source}: hidden_act={f.get('hidden_act')!r}; DeepSeek-V4's routed experts are read as "
                         f"{ACTIVATION!r} (silu of the clamped gate), which needs hidden_act 'silu'")
    activation = f.fixed_activation(ACTIVATION, {"swiglu_limit": "limit"}, "transformers' DeepseekV4Config default")
    scoring = f.get("scoring_func")
    if scoring not in SCORING:
        raise ValueError(f"{f.source}: scoring_func={scoring!r}; moeshard describes DeepSeek-V4's routers by "
                         f"{sorted(SCORING)} only")
    kinds = f.get("mlp_layer_types")
    if kinds is not None and not (isinstance(kinds, list) and set(kinds) <= {"hash_moe", "moe"}):
        raise ValueError(f"{f.source}: mlp_layer_types={kinds!r}; DeepSeek-V4's layers are 'hash_moe' or 'moe'")
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=activation, scoring=SCORING[scoring], renormalize=True,
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     router_dtype=f.family.router_dtype)


def _dtype_check(dtype: torch.dtype) -> None:
    """Refuses a model dtype the installed transformers cannot run DeepSeek-V4's own modules in.

    transformers keeps the family's norms in float32 (``_keep_in_fp32_modules_strict``); a
    ``DeepseekV4RMSNorm`` that multiplies by its float32 weight without casting back (transformers
    5.17) hands float32 rows to the attention's bfloat16 projections, which fail. Probed on the norm
    itself rather than by version: one row of two."""
    if dtype == torch.float32:
        return
    import transformers
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

    got = DeepseekV4RMSNorm(2)(torch.ones(1, 2, dtype=dtype)).dtype
    if got != dtype:
        raise ValueError(f"dtype={dtype}: transformers {transformers.__version__} cannot run DeepSeek-V4 in {dtype}: "
                         f"its DeepseekV4RMSNorm, kept in float32, returns {got} rows to the attention's {dtype} "
                         f"projections, which then fail; load the model in float32, or install a transformers "
                         f"whose norm returns the input's dtype (5.24 does)")


# What transformers' save_pretrained writes under the hub's names (its conversion mapping, run
# backwards): (model tensor name ending, stored name ending), each whole, after a dot.
_ATTENTION = (("q_a_proj.weight", "wq_a.weight"), ("q_b_proj.weight", "wq_b.weight"), ("q_a_norm.weight", "q_norm.weight"),
              ("kv_proj.weight", "wkv.weight"), ("kv_norm.weight", "norm.weight"), ("o_a_proj.weight", "wo_a.weight"),
              ("o_b_proj.weight", "wo_b.weight"), ("sinks", "attn_sink"),
              ("compressor.kv_proj.weight", "compressor.wkv.weight"),
              ("compressor.gate_proj.weight", "compressor.wgate.weight"),
              ("compressor.kv_norm.weight", "compressor.norm.weight"), ("compressor.position_bias", "compressor.ape"),
              ("compressor.indexer.kv_proj.weight", "indexer.compressor.wkv.weight"),
              ("compressor.indexer.gate_proj.weight", "indexer.compressor.wgate.weight"),
              ("compressor.indexer.kv_norm.weight", "indexer.compressor.norm.weight"),
              ("compressor.indexer.position_bias", "indexer.compressor.ape"),
              ("compressor.indexer.q_b_proj.weight", "indexer.wq_b.weight"),
              ("compressor.indexer.scorer.weights_proj.weight", "indexer.weights_proj.weight"))
_BLOCK = (("gate.e_score_correction_bias", "gate.bias"), ("gate.tid2eid", "gate.tid2eid"), ("gate.weight", "gate.weight"),
          ("shared_experts.gate_proj.weight", "shared_experts.w1.weight"),
          ("shared_experts.up_proj.weight", "shared_experts.w3.weight"),
          ("shared_experts.down_proj.weight", "shared_experts.w2.weight"))
_LAYER = (("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
          *((f"{part}_hc.{leaf}", f"hc_{part}_{leaf}") for part in ("attn", "ffn") for leaf in ("fn", "base", "scale")))
# The release's flat top-level names (its decoder layers ``layers.{L}.*``: ``reader.TEXT_MODEL_PREFIXES``).
_TOP = (("model.embed_tokens.weight", "embed.weight"), ("model.norm.weight", "norm.weight"),
        *((f"model.hc_head.hc_{leaf}", f"hc_head_{leaf}") for leaf in ("fn", "base", "scale")))
DENSE_RENAMES = (*((f".self_attn.{a}", f".attn.{b}") for a, b in _ATTENTION),
                 *((f".mlp.{a}", f".ffn.{b}") for a, b in _BLOCK),
                 *((f".{a}", f".{b}") for a, b in _LAYER), ("lm_head.weight", "head.weight"), *_TOP)

register_family(ModelFamily(
    "deepseek_v4", {"hidden_act": "silu", "swiglu_limit": 10.0, "scoring_func": "sqrtsoftplus",
                    "routed_scaling_factor": 1.5, "mlp_layer_types": None},
    _moe, every_layer, routing=ROUTING, router_dtype="model", experts_only=True,
    formats=("bf16", "fp8_block_mxfp4", "fp8_block"), quantization_fields=("expert_dtype",),
    # The block is the model's ``mlp``, stored under the hub's ``ffn``.
    block_prefixes=("mlp.", "ffn."), dense_renames=DENSE_RENAMES, dtype_check=_dtype_check))

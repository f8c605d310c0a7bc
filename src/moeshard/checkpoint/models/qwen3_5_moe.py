"""Qwen3.5-MoE's text model (``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``): softmax top-k,
always renormalized, plus one shared expert gated by ``sigmoid(shared_expert_gate(x))`` in every
layer; its gated-delta-net (linear attention) layers stay transformers'. Checkpoint names as
Qwen2-MoE's (``mlp.gate``, ``mlp.experts.{e}.*``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``). The published vision-language ``qwen3_5_moe`` checkpoint (its text
model under ``model.language_model``) is read as this text model (``hf_config.text_model_config``).

Qwen4-Exp's text model (``qwen4_exp_text``) has the same block, renormalized only where
``norm_topk_prob`` (default true) says so; its hyper-connections around the block and its indexed
and gated-delta-net attention stay transformers'. Its vision-language ``qwen4_exp`` is read as
this text model too. A model with per-layer n-gram embeddings (``ple_layer_ids``) does not load
whole: transformers stores their table (320M rows even at tiny sizes) in ``split_ngram_parts``
shards (``ngram_embedding.shard_{i}.weight``) and concatenates them on the CPU, while moeshard
reads every non-expert tensor whole onto every rank; the load stops naming the missing tensor.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields, renormalize: bool = True) -> MoEConfig:
    shared = f.int("shared_expert_intermediate_size")
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=renormalize,
                     num_shared_experts=1, shared_intermediate_size=shared, shared_expert_gate=True)


register_family(ModelFamily("qwen3_5_moe_text", {"hidden_act": "silu"}, _moe, every_layer, formats=("bf16",),
                            router_dtype="model"))
register_family(ModelFamily("qwen4_exp_text", {"hidden_act": "silu", "norm_topk_prob": True},
                            lambda f: _moe(f, f.bool("norm_topk_prob")), every_layer, formats=("bf16",),
                            router_dtype="model"))

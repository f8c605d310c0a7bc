"""Qwen3-Next: Qwen2-MoE's block (softmax top-k renormalized when ``norm_topk_prob``, default
True here; a shared expert gated by ``sigmoid(shared_expert_gate(x))``) and its dense-layer rule
(``mlp_only_layers``, ``decoder_sparse_step``); the gated-delta-net (linear attention) layers
stay transformers'. Qwen publishes FP8 block checkpoints of it, read as Qwen2-MoE's are.
"""

from __future__ import annotations

from dataclasses import replace

from moeshard.checkpoint.families import FAMILIES, register_family

_QWEN2 = FAMILIES["qwen2_moe"]
register_family(replace(_QWEN2, model_type="qwen3_next", defaults={**_QWEN2.defaults, "norm_topk_prob": True}))

"""MiniMax (MiniMax-Text-01): Mixtral's MoE block (softmax top-k, always renormalized, w1/w3/w2
experts, the hub's ``block_sparse_moe.`` or transformers 5's ``mlp.``) in every layer; its
lightning (linear) attention layers and the residual ``mlp_alpha_factor``/``mlp_beta_factor``
around the block stay transformers'.
"""

from __future__ import annotations

from dataclasses import replace

from moeshard.checkpoint.families import FAMILIES, register_family

register_family(replace(FAMILIES["mixtral"], model_type="minimax", formats=("bf16",)))

"""MiniMax-M2: every layer an MoE block of sigmoid-scored experts, no shared expert.

transformers' block (``MiniMaxM2SparseMoeBlock``): s = sigmoid(logits), the top ``num_experts_per_tok``
of s + ``e_score_correction_bias`` chosen, their unbiased s renormalized to sum 1 (routing kind
``sigmoid`` with one group, ``renormalize``, no scaling). The bias is the block's own buffer, not
the router's, and transformers passes it to the router (``block_bias``). The experts'
intermediate size is ``intermediate_size``. Checkpoints keep Mixtral's names:
``block_sparse_moe.`` with ``experts.{e}.w1/w3/w2`` (transformers 5 in memory: ``mlp.``, fused).
transformers reads none of the hub config's ``scoring_func`` / ``use_routing_bias`` fields, so
neither is read here.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=True, use_correction_bias=True)


register_family(ModelFamily("minimax_m2", {"hidden_act": "silu"}, _moe, every_layer, routing="sigmoid",
                            block_prefixes=("block_sparse_moe.", "mlp."), block_bias="e_score_correction_bias",
                            router_dtype="model"))

"""Phi-3.5-MoE (phimoe): sparsemixer routing of exactly two experts (routing kind
``sparsemixer``: each round picks the best remaining logit and weighs it by its softmax share
among the logits within ``2 * router_jitter_noise`` of it, relatively), no renormalization, no
shared expert; experts ``intermediate_size`` wide. ``input_jitter_noise`` only acts in training.

Checkpoint (the hub's names, which transformers 5 renames on load): the block under
``block_sparse_moe.`` (the model's ``mlp``), its router ``block_sparse_moe.gate.weight`` (the
model's ``mlp.router.weight``), per-expert ``experts.{e}.w1/w3/w2.weight``.
"""

from __future__ import annotations

from moeshard.checkpoint.families import W1_W3_W2, ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig
from moeshard.routing import get_routing

ROUTING = "sparsemixer"


def _moe(f: ConfigFields) -> MoEConfig:
    eps = get_routing(ROUTING).mask_eps
    if f.float("router_jitter_noise", -1.0, 1.0) != eps:
        raise ValueError(f"{f.source}: router_jitter_noise={f.get('router_jitter_noise')!r}; routing kind {ROUTING!r} "
                         f"masks with {eps:g}")
    top_k = f.int("num_experts_per_tok")
    if top_k != 2:
        raise ValueError(f"{f.source}: num_experts_per_tok={top_k}; phimoe's sparsemixer routes every token to exactly "
                         f"2 experts")
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=top_k, hidden_size=f.int("hidden_size"),
                     intermediate_size=f.int("intermediate_size"), activation=f.activation(), scoring=ROUTING,
                     renormalize=False)


register_family(ModelFamily("phimoe", {"hidden_act": "silu", "router_jitter_noise": 0.01}, _moe, every_layer,
                            routing=ROUTING, block_prefixes=("block_sparse_moe.", "mlp."), router="router",
                            stored_names={"router.weight": "gate.weight"},
                            expert_spellings=(W1_W3_W2,), formats=("bf16",), router_dtype="model"))

"""LongCat-Flash (longcat_flash): zero-computation experts beside the routed ones; the block routes
itself (``ModelFamily.experts_only``) and moeshard runs its routed experts on that routing.

Every decoder layer holds two attention sublayers, two dense MLPs (``mlps``, transformers') and
one MoE block ``mlp`` (``LongcatFlashMoE``), fed from the first sublayer and added after the
second: a router ``router`` (``classifier.weight`` [E + Z, H], kept and run in fp32; softmax over
all E + Z; the top ``moe_topk`` of the scores plus ``e_score_correction_bias``; each weight its
score times ``routed_scaling_factor``) and experts ``experts``. The first E = ``n_routed_experts``
are gated MLPs (``expert_ffn_hidden_size`` wide); the last Z = ``zero_expert_num`` pass the row
through, scaled by its weight (``MoEExperts(identity_experts=Z)``). transformers' experts module
holds gate_up rows for those Z as well, never used; checkpoints store each expert's gate, up and
down (the Z only gate and up), which transformers fuses.

moeshard takes the router's ids and weights as given and replaces only ``mlp.experts``; the
router, the dense MLPs and the MLA attention stay transformers'. The routing kind below describes
the selection among the routed experts (softmax, not renormalized), not the scaling, the
correction bias or the zero-computation experts, which transformers' router applies.
``num_layers`` counts the decoder layers (``layer_count``: transformers 5.17 also writes
``num_hidden_layers``, twice that, its attention sublayers).
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("moe_topk"), hidden_size=f.int("hidden_size"),
                     intermediate_size=f.int("expert_ffn_hidden_size"), activation=f.activation(),
                     scoring=f.family.routing, renormalize=False)


register_family(ModelFamily("longcat_flash", {"hidden_act": "silu", "zero_expert_num": 0}, _moe, every_layer,
                            routing="softmax", router="router", router_weight="classifier.weight",
                            linear_router=False, identity_experts="zero_expert_num", experts_only=True,
                            formats=("bf16",), router_dtype="fp32", layer_count="num_layers"))

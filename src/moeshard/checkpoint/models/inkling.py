"""Inkling's text model (inkling_text): the router weighs the shared experts per token too; the
block routes itself (``ModelFamily.experts_only``) and moeshard runs its routed experts on that
routing.

Each ``"sparse"`` layer of ``mlp_layer_types`` (else the first ``dense_mlp_idx`` layers dense)
holds an ``InklingMoE`` at ``mlp``: a router ``gate`` (``weight`` [E + S, H] over the E routed and
S = ``n_shared_experts`` shared experts, in fp32; the top ``num_experts_per_tok`` of the routed
experts' sigmoid scores plus ``e_score_correction_bias``; the chosen and the shared experts'
log-sigmoids normalized together, times ``route_scale`` and a learned ``global_scale``), experts
``experts`` (``gate_up_proj`` [E, 2I, H] gate rows first, ``down_proj`` [E, H, I]) and shared
experts ``shared_experts``, each weighed by its share of that normalization. moeshard takes the
router's ids and weights of the routed experts as given (``MoEExperts``) and replaces only
``mlp.experts``; the router, the shared experts and their weights, the attention and the short
convolutions stay transformers'. The routing kind below describes the selection (sigmoid
scores), not the normalization with the shared experts or the scales.

Read as transformers writes it (``save_pretrained``: the model's names). The published
multimodal checkpoints keep their original names (the text model under ``model.llm.``, the
experts' ``w13_weight`` interleaved), which transformers renames as it loads them; moeshard does
not read that layout.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.checkpoint.models.layer_types import listed_or_first_dense
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    return listed_or_first_dense(f, num_layers, "dense_mlp_idx")


register_family(ModelFamily("inkling_text", {"hidden_act": "silu", "dense_mlp_idx": 0}, _moe, _dense_layers,
                            routing="sigmoid", linear_router=False, experts_only=True, formats=("bf16",),
                            router_dtype="fp32"))

"""ZAYA (zaya): the block routes itself with an MLP router (``ModelFamily.experts_only``,
``linear_router=False``); moeshard runs its experts, on the routing transformers computed.

Every decoder layer's ``mlp`` is a ``ZayaSparseMoeBlock``: a router ``gate`` (``ZayaRouter``) and
experts ``experts`` (``gate_up_proj`` [E, 2I, H] gate rows first, ``down_proj`` [E, H, I], the
``hidden_act`` gated MLP). The router is not a linear over the block's input: it projects the
rows to ``router_hidden_size`` (``gate.down_proj``), adds the previous layer's router state
(scaled by ``gate.router_states_scale``, which the block hands on to the next layer), and runs an
MLP (``gate.router_mlp``: a norm, two GELU linears, ``out_proj`` [E + 1, router_hidden_size]).
Softmax over E + 1 classes, the last a skip class; the top ``num_experts_per_tok`` of the
probabilities plus fixed balancing biases; each weight the chosen class's probability (not
renormalized). A pick of the skip class reaches the experts as expert 0 with weight 0, set by a
masked fill (``zero_weight_skips``: moeshard runs it as an empty pick, computed by no expert).

So moeshard takes the router's ids and weights as given (``MoEExperts``) and replaces only
``mlp.experts``; the router and its state stay transformers' and load as dense tensors. The
routing kind below describes the selection among the experts (softmax, not renormalized), not
the skip class or the router's state. Checkpoints hold transformers' names, the experts fused.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("moe_intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=False)


register_family(ModelFamily("zaya", {"hidden_act": "silu"}, _moe, every_layer, routing="softmax",
                            router_weight="router_mlp.out_proj.weight", linear_router=False, experts_only=True,
                            zero_weight_skips=True, formats=("bf16",), router_dtype="model"))

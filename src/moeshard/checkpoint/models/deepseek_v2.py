"""DeepSeek-V2: p = softmax(logits) over every routed expert; ``topk_method`` ``greedy`` takes the
top K of p (routing kind ``softmax``), ``group_limited_greedy`` only among the ``topk_group``
groups with the best single expert; the weights are never renormalized (transformers' router
ignores ``norm_topk_prob``) and are multiplied by ``routed_scaling_factor``. Every MoE block
adds ``n_shared_experts`` shared experts (one MLP, ``n_shared_experts * moe_intermediate_size``
wide). Layers below ``first_k_dense_replace`` are dense. MLA attention stays transformers'.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MAX_ROUTED_SCALING, MoEConfig

# topk_method -> routing kind
TOPK_METHODS = {"greedy": "softmax", "group_limited_greedy": "group_limited_greedy"}


def _moe(f: ConfigFields) -> MoEConfig:
    method = f.get("topk_method")
    if method not in TOPK_METHODS:
        raise ValueError(f"{f.source}: topk_method={method!r}; deepseek_v2 blocks route with one of {list(TOPK_METHODS)}")
    grouped = method == "group_limited_greedy"
    I, shared = f.int("moe_intermediate_size"), f.int("n_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=I, activation=f.activation(),
                     scoring=TOPK_METHODS[method], renormalize=False,
                     n_group=f.int("n_group") if grouped else 1, topk_group=f.int("topk_group") if grouped else 1,
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


def first_k_dense(f: ConfigFields, num_layers: int) -> DenseLayers:
    """Layers below ``first_k_dense_replace`` are dense (transformers reads no ``moe_layer_freq``)."""
    first = f.int("first_k_dense_replace", minimum=0)
    return DenseLayers(num_layers, lambda layer: f"layer < first_k_dense_replace={first}" if layer < first else None)


FAMILY = register_family(ModelFamily("deepseek_v2", {"hidden_act": "silu", "topk_method": "greedy",
                                                     "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
                                                     "n_shared_experts": 2},
                                     _moe, first_k_dense, formats=("bf16",), router_dtype="fp32"))

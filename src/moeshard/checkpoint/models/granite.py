"""Granite MoE (granitemoe, granitemoeshared, granitemoehybrid, granitemoe_swa): top-k of the logits, softmax
over the K selected (routing kind ``topk_softmax``); experts ``intermediate_size`` wide.

The block is the decoder layer's ``block_sparse_moe``. The checkpoint keeps Granite's own names,
which transformers 5 renames on load: router ``router.layer.weight`` (the model's
``router.weight``), fused experts ``input_linear.weight`` [E, 2I, H] (gate rows first; the
model's ``experts.gate_up_proj``) and ``output_linear.weight`` [E, H, I] (``experts.down_proj``).
The shared MLP of granitemoeshared / granitemoehybrid (``shared_mlp``) sits beside the block in
the decoder layer and stays transformers', as the Mamba layers of granitemoehybrid do; a
granitemoehybrid with ``num_local_experts=0`` has no MoE block at all.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, DenseLayers, ModelFamily, register_family
from moeshard.config import MoEConfig

_STORED = {"router.weight": "router.layer.weight", "experts.gate_up_proj": "input_linear.weight",
           "experts.down_proj": "output_linear.weight"}


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=False)


def _dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    experts = f.int("num_local_experts", minimum=0)
    return DenseLayers(num_layers, lambda layer: "num_local_experts=0" if experts == 0 else None)


def _moe_or_none(f: ConfigFields) -> MoEConfig:
    if f.int("num_local_experts", minimum=0) == 0:
        raise ValueError(f"{f.source}: num_local_experts=0: the model has no MoE block")
    return _moe(f)


for _model_type, _reader in (("granitemoe", _moe), ("granitemoeshared", _moe), ("granitemoehybrid", _moe_or_none)):
    register_family(ModelFamily(_model_type, {"hidden_act": "silu"}, _reader, _dense_layers, routing="topk_softmax",
                                block_prefixes=("block_sparse_moe.",), router="router", stored_names=_STORED,
                                formats=("bf16",), router_dtype="model"))
# Granite with sliding-window attention and attention sinks (outside the block, transformers'):
# transformers converts no names for it, so its checkpoints hold the model's own.
register_family(ModelFamily("granitemoe_swa", {"hidden_act": "silu"}, _moe, _dense_layers, routing="topk_softmax",
                            block_prefixes=("block_sparse_moe.",), router="router", formats=("bf16",),
                            router_dtype="model"))

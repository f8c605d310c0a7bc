"""JetMoE (jetmoe): Granite's routing (top-k of the logits, softmax over the K selected; routing
kind ``topk_softmax``, logits in the model dtype) and a learned bias [H] on the block's output.

The block is the decoder layer's ``mlp``, and it holds its experts itself, as the checkpoint and
transformers name them alike: ``input_linear.weight`` [E, 2I, H] (gate rows first) and
``output_linear.weight`` [E, H, I]; the router is ``router.layer.weight`` [E, H]; the output bias
``bias`` [H] (``ModelFamily.output_bias``). The activation is config.json's
``activation_function``. The attention's mixture of attention heads (``self_attention.experts``)
stays transformers', as dense weights.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig


def _moe(f: ConfigFields) -> MoEConfig:
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"),
                     hidden_size=f.int("hidden_size"), intermediate_size=f.int("intermediate_size"),
                     activation=f.activation(), scoring=f.family.routing, renormalize=False)


register_family(ModelFamily("jetmoe", {"hidden_act": "silu"}, _moe, every_layer, routing="topk_softmax",
                            router="router", router_weight="layer.weight", experts="",
                            fused_names=("input_linear.weight", "output_linear.weight"),
                            output_bias="bias", formats=("bf16",), router_dtype="model"))

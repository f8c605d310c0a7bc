"""DBRX: every layer an MoE block of softmax-routed experts, scored in the model dtype, stored as
three stacked tensors.

transformers' block (``DbrxFFN``, the decoder block's ``ffn``): the logits of the router's
``layer`` linear in the model dtype (``router_dtype="model"``), ``softmax(logits,
dtype=logits.dtype)``, the top ``moe_top_k``, divided by their ``moe_normalize_expert_weights``-norm
(1: their sum; null: not divided), every step in the model dtype (routing kind ``softmax_model``).
The experts (``experts.mlp``) are three tensors [moe_num_experts * ffn_hidden_size, d_model]:
``w1`` the gate rows, ``v1`` the up rows and ``w2`` the down projection transposed, expert e's
rows at [e * I, (e + 1) * I) (fused layout ``stacked``), under ``transformer.blocks.{L}.ffn.``.
The expert settings sit in the nested ``ffn_config``; ``d_model`` and ``n_layers`` are the
hidden size and the layer count. ``moe_jitter_eps`` scales the router input by random noise in
training mode only; moeshard routes as transformers does in eval mode.
"""

from __future__ import annotations

from moeshard.checkpoint.families import ConfigFields, ModelFamily, every_layer, register_family
from moeshard.config import MoEConfig

_FFN_DEFAULTS = {"moe_normalize_expert_weights": 1.0, "ffn_act_fn": {"name": "silu"}}


def _ffn(f: ConfigFields) -> ConfigFields:
    """``ffn_config`` with its defaults, read like the top level (messages name it)."""
    raw = f.get("ffn_config")
    if not isinstance(raw, dict):
        raise ValueError(f"{f.source}: ffn_config must be an object holding DBRX's expert settings, got {raw!r}")
    return ConfigFields(raw, f.family, f"{f.source}: ffn_config")


def _renormalize(ffn: ConfigFields) -> bool:
    """``moe_normalize_expert_weights``: 1 divides by the sum (the 1-norm of positive weights),
    null leaves the weights as they are; another norm is refused."""
    if "moe_normalize_expert_weights" in ffn.raw and ffn.raw["moe_normalize_expert_weights"] is None:
        return False
    p = ffn.float("moe_normalize_expert_weights", 0.0, float("inf"))
    if p != 1.0:
        raise ValueError(f"{ffn.source}: moe_normalize_expert_weights={p:g}; DBRX would divide the weights by their "
                         f"{p:g}-norm, and routing kind 'softmax_model' divides by their sum (the 1-norm) or not at all "
                         f"(null)")
    return True


def _activation(ffn: ConfigFields) -> str:
    act = ffn.get("ffn_act_fn")
    name = act.get("name", "silu") if isinstance(act, dict) else act
    return ConfigFields({"hidden_act": name}, ffn.family, f"{ffn.source}: ffn_act_fn.name").activation()


def _moe(f: ConfigFields) -> MoEConfig:
    ffn = _ffn(f)
    return MoEConfig(num_experts=ffn.int("moe_num_experts"), top_k=ffn.int("moe_top_k"),
                     hidden_size=f.int("d_model"), intermediate_size=ffn.int("ffn_hidden_size"),
                     activation=_activation(ffn), scoring=f.family.routing, renormalize=_renormalize(ffn),
                     router_dtype=f.family.router_dtype)


register_family(ModelFamily("dbrx", _FFN_DEFAULTS, _moe, every_layer, routing="softmax_model",
                            layers="transformer.blocks", block_prefixes=("ffn.",), router="router",
                            router_weight="layer.weight", router_dtype="model", fused_names=("mlp.w1", "mlp.v1", "mlp.w2"),
                            fused_layout="stacked", formats=("bf16",)))

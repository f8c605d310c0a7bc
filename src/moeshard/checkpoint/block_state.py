"""A transformers MoE block's tensors under moeshard's names and layout: how the family holds them
(its module names, its fused layout) -> ``MoEWeights``' canonical ones. The loader of a model in
memory (``integrations.transformers.shard_moe_blocks``), ``--compare``'s parameter comparison and
the checkpoint writer all read a block through it."""

from __future__ import annotations

import torch

from moeshard.checkpoint.families import ModelFamily
from moeshard.checkpoint.fused import fused_layout


def canonical_state(state: dict[str, torch.Tensor], family: ModelFamily, num_experts: int) -> dict[str, torch.Tensor]:
    """A block's state dict under the family's names and fused layout -> under ``MoEWeights``'
    canonical names and layout (``gate.weight``, ``gate.bias``, ``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I], their biases, ``shared_experts.*``, ``shared_expert_gate.weight``)."""
    layout = fused_layout(family.fused_layout)
    fused = [family.expert_tensor(name) for name in family.fused_names]
    state = dict(state)
    for name in fused:
        # An older transformers release may hold the experts under the checkpoint's names (Aria's
        # experts.fc1.weight before transformers 5.24), in the same layout.
        stored = family.stored_names.get(name)
        if name not in state and stored in state:
            state[name] = state.pop(stored)
    if family.identity_experts is not None and fused[0] in state:
        # transformers holds gate_up rows for the zero-computation experts too (LongCat-Flash), never used.
        state[fused[0]] = state[fused[0]][:num_experts]
    if all(name in state for name in fused):
        state["experts.gate_up_proj"], state["experts.down_proj"] = layout.canonical_tensors(
            [state.pop(name) for name in fused], num_experts)
    renames = {**({family.router_tensor: "gate.weight"} if family.linear_router else {}),
               family.bias_module: "gate.e_score_correction_bias",
               f"{family.router}.{family.router_bias}": "gate.bias",
               family.expert_tensor(family.expert_biases[0]): "experts.gate_up_proj_bias",
               family.expert_tensor(family.expert_biases[1]): "experts.down_proj_bias",
               f"{family.shared_expert_gate}.weight": "shared_expert_gate.weight"}
    out = {}
    for key, t in state.items():
        shared = next((p for p in family.shared_prefixes if key.startswith(p)), None)
        if shared and key[len(shared):] == "gate_up_proj.weight":  # MiniMax-M3: [2S, H], gate's rows first
            out["shared_experts.gate_proj.weight"], out["shared_experts.up_proj.weight"] = t.chunk(2)
            continue
        out["shared_experts." + key[len(shared):] if shared else renames.get(key, key)] = t
    if "gate.e_score_correction_bias" in out:  # ERNIE 4.5 holds it [1, E]
        out["gate.e_score_correction_bias"] = out["gate.e_score_correction_bias"].reshape(-1)
    if "experts.gate_up_proj_bias" in out:
        out["experts.gate_up_proj_bias"] = layout.canonical_bias(out["experts.gate_up_proj_bias"])
    return out


def unused_rows(raw: dict[str, torch.Tensor], family: ModelFamily, num_experts: int) -> list[torch.Tensor]:
    """The parts of transformers' tensors (``raw``, named as ``block_state`` takes them) that no
    moeshard layer holds, because transformers never uses them: the gate_up rows past the E routed
    experts that LongCat-Flash's experts module keeps for its zero-computation experts. Empty for
    every other family."""
    if family.identity_experts is None:
        return []
    name = family.fused_names[0] if family.experts_only else family.expert_tensor(family.fused_names[0])
    return [raw[name][num_experts:]] if name in raw else []


def block_state(raw: dict[str, torch.Tensor], family: ModelFamily, num_experts: int) -> dict[str, torch.Tensor]:
    """A transformers block's tensors by their names inside the block module that moeshard
    replaces (``raw``) -> the same tensors under both the block's names and moeshard's
    (``canonical_state``: its names, in ``MoEWeights``' layout): what a moeshard block's parameter of
    any name is, as transformers holds it. For an ``experts_only`` family the module moeshard
    replaces is the experts module, whose names are put under ``family.experts`` first."""
    if family.experts_only:
        raw = {f"{family.experts}.{k}": v for k, v in raw.items()}
    return {**raw, **canonical_state(raw, family, num_experts)}

"""DeepSeek-V3's auxiliary-loss-free load balancing: after each training step, every expert's
correction bias moves by the bias update speed u towards balance,

    b_i += u * sign(mean_j load_j - load_i)          (load_i: (token, k) copies routed to expert i)

so an overloaded expert's bias drops by u and an underloaded one's rises by u (an expert exactly
at the mean keeps its bias). The bias only steers selection (``route``: the top-k of scores +
bias; the weights are the unbiased scores), and it is a buffer: no gradient reaches it.

    update_correction_bias(model, groups, speed)    every MoELayer with a correction bias

Loads are those of the global batch: each layer's own count (``MoELayer.expert_loads``: every
forward since the last update, on the rows this rank routed) summed over the ranks that routed
disjoint rows (``MoELayer.load_group_name``: the EP group with EP on, every rank's own tokens or
under SP its chunk of them; the DP group with EP off, where the TP ranks of a DP rank route the
same tokens). Every rank then holds the same loads and applies the same update to its copy of
the bias, bit for bit what one device computes on the whole batch: the sign is computed exactly,
in integers, as ``sign(total - E * load_i)``.

The count is the layer's load window: a step may run at most ``load_window`` forwards of a
layer (micro-batches, and a recomputed forward under activation checkpointing counts again:
every token of that layer twice, which leaves every sign as it is). ``reset=True`` (default)
empties the windows after the update, so the next step counts its own forwards; a forward
outside training (an evaluation) counts too unless the windows are reset before the step.

Cross-rank precondition (one all-reduce per call): every rank calls it after the same forwards,
with the same model structure and speed.
"""

from __future__ import annotations

import torch
from torch import nn

from moeshard.layer import MoELayer
from moeshard.parallel.collectives import all_reduce
from moeshard.parallel.groups import ParallelGroups
from moeshard.validate import boolean, finite_float

# The largest speed accepted: DeepSeek-V3 uses 1e-3; a speed of 1 already moves a bias by more
# than the scores it is added to (sigmoid and softmax scores lie in [0, 1]).
MAX_SPEED = 1.0


def _corrected_layers(model: nn.Module, where: str) -> list[MoELayer]:
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"{where}: the model has no MoELayer")
    corrected = [layer for layer in layers if layer.gate.e_score_correction_bias is not None]
    if not corrected:
        raise ValueError(f"{where}: none of the model's {len(layers)} MoE layers has a correction bias (routing "
                         f"{layers[0].cfg.scoring!r}, use_correction_bias={layers[0].cfg.use_correction_bias})")
    return corrected


def _check(layers: list[MoELayer], groups: ParallelGroups | None, where: str) -> None:
    layouts = {layer.parallel for layer in layers}
    if len(layouts) > 1:
        raise ValueError(f"{where}: the MoE layers run different layouts {sorted(p.name for p in layouts)}")
    if groups is not None and groups.config not in layouts:
        raise ValueError(f"{where}: groups are for layout {groups.config.name}, the layers run "
                         f"{next(iter(layouts)).name}")
    # One read of every layer's forward count (a host sync, once per step): a window that wrapped
    # lost the step's first forwards, and its loads would not be the batch's.
    steps = torch.cat([layer.loads.step for layer in layers]).tolist()
    for i, (layer, step) in enumerate(zip(layers, steps, strict=True)):
        if step > layer.loads.window:
            raise ValueError(f"{where}: MoE layer {i} ran {step} forwards since its loads were last reset, more than "
                             f"its load_window={layer.loads.window}; build the layers with load_window >= the "
                             f"forwards of one step")


@torch.no_grad()
def update_correction_bias(model: nn.Module, groups: ParallelGroups | None, speed: float, *,
                           reset: bool = True) -> list[torch.Tensor]:
    """Adds ``speed * sign(mean load - load_i)`` to every expert i's ``e_score_correction_bias``
    (fp32 [E], in place) in every ``MoELayer`` of ``model`` that has one, from the loads of the
    forwards since the last reset over the global batch. speed: the bias update speed u, in
    (0, ``MAX_SPEED``]; groups: the layers' groups (None: one device), checked against their
    layout; reset: empty the load windows after the update. Returns each updated layer's loads,
    int64 [E] (the same on every rank), in module order. Collective: one all-reduce of every
    layer's loads together."""
    where = "update_correction_bias"
    speed = finite_float(where, "speed", speed, 0.0, MAX_SPEED, low_open=True)
    boolean(where, "reset", reset)
    layers = _corrected_layers(model, where)
    _check(layers, groups, where)
    # Every layer's loads in one int64 vector (layers may differ in E), summed in one all-reduce.
    flat = torch.cat([layer.expert_loads(all_reduce=False) for layer in layers])
    first = layers[0]
    if first.groups is not None:
        name = first.load_group_name
        if len(first.groups.ranks(name)) > 1:
            all_reduce(flat, first.groups.group(name), name, trace=first.groups.trace)
    loads = list(flat.split([layer.cfg.num_experts for layer in layers]))
    for layer, load in zip(layers, loads, strict=True):
        bias = layer.gate.e_score_correction_bias
        assert bias is not None  # _corrected_layers keeps only layers that have one
        # sign(mean - load_i) = sign(total - E * load_i), exact in int64.
        direction = torch.sign(load.sum() - layer.cfg.num_experts * load)
        bias.add_(direction.to(bias.dtype), alpha=speed)
        if reset:
            layer.reset_expert_loads()
    return loads

"""The router's training losses under any layout, equal to one device's over the global batch.

    load_balancing_loss(model, groups)   transformers' ``load_balancing_loss_func`` (Switch
                                         Transformer's auxiliary loss; Mixtral, Qwen-MoE, ...):
                                         E * sum_e f_e * P_e over every MoE layer's rows together
    router_z_loss(model, groups)         ST-MoE's z-loss: the mean over those rows of
                                         logsumexp(logits)^2 (transformers' ``router_z_loss_func``)

with f_e the fraction of (row, top-k) assignments to expert e (top-k of the softmax, as
transformers selects them) and P_e the mean softmax probability of e. Both read the logits each
``MoELayer`` of the model kept in its last forward (``MoELayer.keep_router_logits``, which
``keep_router_logits(model)`` sets): the rows that rank routed.

A statistic over the global batch is a sum over ranks: the sums are reduced over the ranks that
hold disjoint rows (the DP group; every rank under SP, where each TP rank routed a chunk), so
the value is the single-device one on every rank. The gradient follows the replicated loss of
``moeshard.autograd``: ``RouterLoss.share`` is DP rank d's part L_d (the same on d's TP ranks),
with the sum of the L_d over DP ranks equal to the loss, value and gradient. f is a count and
carries no gradient; P is linear in each row's probabilities, so L_d = E * sum_e f_e * P_e^(d),
where P^(d) holds DP rank d's rows' share of the mean (under SP summed over its TP ranks with
``tp_reduce``, whose backward is the identity). Add ``coef * share`` to L_d before its backward,
and ``reduce_gradients`` completes the router's gradient as it does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeshard.autograd.collectives import tp_reduce
from moeshard.layer import MoELayer
from moeshard.parallel.collectives import all_reduce
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.sequence import SequenceChunk


@dataclass(frozen=True)
class RouterLoss:
    """share: fp32 [], this DP rank's part of the loss (differentiable; the same on its TP
    ranks); value: fp32 [], the whole loss over the global batch (no gradient), the same on
    every rank."""

    share: torch.Tensor
    value: torch.Tensor


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The ``MoELayer``s of ``model`` (itself if it is one), in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def keep_router_logits(model: nn.Module, keep: bool = True) -> None:
    """Makes every ``MoELayer`` of ``model`` keep the logits of the rows it routes (each forward
    replaces the last ones), which the losses here read."""
    for layer in moe_layers(model):
        layer.keep_router_logits = keep


def _kept(model: nn.Module, where: str) -> list[tuple[MoELayer, torch.Tensor, int]]:
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{where}: the model has no MoELayer")
    out = []
    for i, layer in enumerate(layers):
        if layer.router_logits is None:
            raise ValueError(f"{where}: MoE layer {i} kept no router logits; call keep_router_logits(model) before "
                             f"the forward")
        logits, first_row = layer.router_logits
        out.append((layer, logits, first_row))
    return out


def _row_weights(layer: MoELayer, rows: int, first_row: int, row_mask: torch.Tensor | None,
                 device: torch.device) -> torch.Tensor:
    """fp32 [rows]: 1 per routed row, or the mask's entries of those rows (``row_mask``: [T] of
    this DP rank's rows in the order the layers route them; under SP this rank routed rows
    [first_row, first_row + rows) of them)."""
    if row_mask is None:
        return torch.ones(rows, dtype=torch.float32, device=device)
    return row_mask.reshape(-1)[first_row:first_row + rows].to(device=device, dtype=torch.float32)


def _check_mask(layers: list, row_mask: torch.Tensor | None, where: str) -> None:
    if row_mask is None:
        return
    layer, logits, first_row = layers[0]
    p = layer.parallel
    T = row_mask.numel()
    want = SequenceChunk.of(T, p.tp_rank(layer.groups.rank), p.tp).real if p.is_sequence_parallel and \
        layer.groups is not None else T
    if logits.shape[0] != want:
        raise ValueError(f"{where}: row_mask has {T} rows, but the layers routed {logits.shape[0]} rows of this rank "
                         f"(expected {want} for a mask of the DP rank's rows)")


def _reduce(t: torch.Tensor, layer: MoELayer) -> torch.Tensor:
    """Sum of a detached statistic over the ranks that hold disjoint rows (a new tensor)."""
    groups, p = layer.groups, layer.parallel
    out = t.detach().clone()
    if groups is None:
        return out
    if p.is_sequence_parallel:
        return all_reduce(out, groups.ep_group, "ep", trace=groups.trace)
    if p.dp > 1:
        return all_reduce(out, groups.dp_group, "dp", trace=groups.trace)
    return out


def _dp_share(t: torch.Tensor, layer: MoELayer) -> torch.Tensor:
    """A differentiable sum of this rank's rows' terms -> DP rank d's (under SP: the sum over d's
    TP ranks, ``tp_reduce``: the same on each of them, the identity backward)."""
    if layer.groups is not None and layer.parallel.is_sequence_parallel:
        return tp_reduce(t, layer.groups.tp_group, trace=layer.groups.trace)
    return t


def _value(share: torch.Tensor, layer: MoELayer) -> torch.Tensor:
    """The sum of the DP ranks' shares (no gradient), the same on every rank."""
    groups, p = layer.groups, layer.parallel
    out = share.detach().clone()
    if groups is not None and p.dp > 1:
        all_reduce(out, groups.dp_group, "dp", trace=groups.trace)
    return out


def load_balancing_loss(model: nn.Module, groups: ParallelGroups | None = None, *, top_k: int | None = None,
                        row_mask: torch.Tensor | None = None) -> RouterLoss:
    """transformers' auxiliary load-balancing loss over every MoE layer of ``model`` and the
    global batch (transformers multiplies it by ``router_aux_loss_coef``). top_k: the experts
    per row it counts (default: the layers' ``top_k``); row_mask: [T] 1 for real rows, 0 for
    padding, of this DP rank's rows (transformers' ``attention_mask``, flattened), or None.
    groups: unused beyond a check (each layer's own groups reduce). Collective over the layers'
    groups: every rank calls it after the same forwards."""
    where = "load_balancing_loss"
    layers = _kept(model, where)
    _check_groups(layers, groups, where)
    _check_mask(layers, row_mask, where)
    E = layers[0][0].cfg.num_experts
    K = top_k if top_k is not None else layers[0][0].cfg.top_k
    device = layers[0][1].device
    counts = torch.zeros(E, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer, logits, first_row in layers:
        w = _row_weights(layer, logits.shape[0], first_row, row_mask, device)
        probs = logits.float().softmax(dim=-1)
        selected = torch.topk(probs, K, dim=-1).indices
        counts = counts.scatter_add(0, selected.reshape(-1), w.repeat_interleave(K))
        prob_sum = prob_sum + (probs * w.unsqueeze(1)).sum(dim=0)
        rows = rows + w.sum()
    first = layers[0][0]
    total = _reduce(rows, first)
    fraction = _reduce(counts, first) / total.clamp_min(1)
    share = E * (fraction * _dp_share(prob_sum, first)).sum() / total.clamp_min(1)
    return RouterLoss(share, _value(share, first))


def router_z_loss(model: nn.Module, groups: ParallelGroups | None = None, *,
                  row_mask: torch.Tensor | None = None) -> RouterLoss:
    """The router z-loss, mean over every MoE layer's rows of the global batch of
    logsumexp(logits)^2; row_mask as ``load_balancing_loss`` (padding rows left out)."""
    where = "router_z_loss"
    layers = _kept(model, where)
    _check_groups(layers, groups, where)
    _check_mask(layers, row_mask, where)
    device = layers[0][1].device
    z_sum = torch.zeros((), dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer, logits, first_row in layers:
        w = _row_weights(layer, logits.shape[0], first_row, row_mask, device)
        z_sum = z_sum + (torch.logsumexp(logits.float(), dim=-1).pow(2) * w).sum()
        rows = rows + w.sum()
    first = layers[0][0]
    share = _dp_share(z_sum, first) / _reduce(rows, first).clamp_min(1)
    return RouterLoss(share, _value(share, first))


def _check_groups(layers: list, groups: ParallelGroups | None, where: str) -> None:
    layouts = {layer.parallel for layer, _, _ in layers}
    if len(layouts) > 1:
        raise ValueError(f"{where}: the MoE layers run different layouts {sorted(p.name for p in layouts)}")
    if groups is not None and groups.config not in layouts:
        raise ValueError(f"{where}: groups are for layout {groups.config.name}, the layers run "
                         f"{next(iter(layouts)).name}")

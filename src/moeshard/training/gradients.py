"""After ``loss.backward()``: complete every gradient over the right ranks, and its norm.

    reduce_gradients(model, groups)        sum each parameter's gradient over its group
    grad_norm(model, groups)               the global 2-norm, every parameter counted once
    clip_grad_norm_(model, groups, max)    scale every gradient so that the norm is <= max

The loss convention these assume (the replicated loss of ``moeshard.autograd``): the global
loss is the sum over DP ranks d of L_d, where L_d is computed from DP rank d's output rows and
is the same on every TP rank of d. For the mean over the global batch of N tokens, L_d is the
sum of DP rank d's per-token losses divided by N (every rank must know N): then
``reduce_gradients(..., op="sum")`` leaves on every rank exactly the gradient of that mean, the
same as one device computing the whole batch. ``op="mean"`` divides by dp after summing, for
L_d = the mean over DP rank d's own tokens with equal token counts on every DP rank.

Which group completes which parameter is ``GradRole`` (``moeshard.autograd.roles``): a
``MoELayer`` says it for its own parameters (``MoELayer.gradient_roles``: experts owned under
EP, TP slices and replicated parameters summed over DP, the router and shared experts over every
rank under SP), every other parameter of the model is replicated and summed over DP.

Cross-rank preconditions (the reductions are collective): every rank calls these with the same
model structure and the same ``requires_grad`` flags, after the backward of the same number of
layer forwards; ``grad_norm`` and ``clip_grad_norm_`` after ``reduce_gradients``.
"""

from __future__ import annotations

import torch
from torch import nn

from moeshard.autograd.roles import GradRole, replicated_role
from moeshard.layer import MoELayer
from moeshard.parallel.collectives import all_reduce
from moeshard.parallel.groups import ParallelGroups

OPS = ("sum", "mean")
# Elements reduced in one all-reduce (fp32): bounds the temporary copy of the gradients.
BUCKET_ELEMENTS = 1 << 25


def gradient_roles(model: nn.Module, groups: ParallelGroups | None) -> dict[str, GradRole]:
    """The ``GradRole`` of every parameter of ``model`` by name (``named_parameters``): the
    ``MoELayer``s' own (``gradient_roles``), the replicated role for the rest."""
    rank = groups.rank if groups is not None else 0
    roles: dict[str, GradRole] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoELayer):
            dot = prefix + "." if prefix else ""
            for name, role in module.gradient_roles().items():
                roles.setdefault(dot + name, role)  # an MoELayer inside an MoELayer: the inner one's
    return {name: roles.get(name, replicated_role(rank)) for name, _ in model.named_parameters()}


def _trained(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def reduce_gradients(model: nn.Module, groups: ParallelGroups | None, op: str = "sum") -> None:
    """Sums every trained parameter's gradient (``p.grad``, in place) over its role's group:
    one fp32 all-reduce per group and bucket of ``BUCKET_ELEMENTS``. A parameter that requires
    grad but has none (no path to the loss on this rank) counts as zeros and gets them. op:
    "sum" or "mean" (see the module docstring). groups None: one device, nothing to reduce
    (``op="mean"`` leaves the gradients as they are too)."""
    if op not in OPS:
        raise ValueError(f"reduce_gradients: op must be one of {list(OPS)}, got {op!r}")
    if groups is None:
        return
    roles = gradient_roles(model, groups)
    buckets: dict[str, list[nn.Parameter]] = {"dp": [], "ep": []}
    for name, p in _trained(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        group = roles[name].reduce
        if group and groups.group(group) is not None and len(groups.ranks(group)) > 1:
            buckets[group].append(p)
    for group, params in buckets.items():
        for chunk in _chunks(params):
            flat = torch.cat([p.grad.float().reshape(-1) for p in chunk if p.grad is not None])
            all_reduce(flat, groups.group(group), group, trace=groups.trace)
            at = 0
            for p in chunk:
                assert p.grad is not None  # given zeros above
                n = p.grad.numel()
                p.grad.copy_(flat[at:at + n].view_as(p.grad))
                at += n
    if op == "mean" and groups.config.dp > 1:
        for _, p in _trained(model):
            assert p.grad is not None  # given zeros above
            p.grad.div_(groups.config.dp)


def _chunks(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if not out or size + p.numel() > BUCKET_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


def grad_norm(model: nn.Module, groups: ParallelGroups | None) -> torch.Tensor:
    """fp32 []: the 2-norm of every trained parameter's gradient over the whole layout, each
    parameter counted once (its role's ``counted`` rank); the same on every rank. Collective
    (two scalar all-reduces: over TP, then over DP, which together cover every rank)."""
    roles = gradient_roles(model, groups)
    params = [(name, p) for name, p in _trained(model) if p.grad is not None]
    device = params[0][1].device if params else next(model.parameters(), torch.zeros(())).device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for name, p in params:
        if roles[name].counted:
            assert p.grad is not None  # filtered above
            squares += p.grad.float().pow(2).sum()
    if groups is not None:
        for group in ("tp", "dp"):
            if len(groups.ranks(group)) > 1:
                all_reduce(squares, groups.group(group), group, trace=groups.trace)
    return squares.sqrt()


def clip_grad_norm_(model: nn.Module, groups: ParallelGroups | None, max_norm: float) -> torch.Tensor:
    """Scales every trained gradient by ``min(1, max_norm / (norm + 1e-6))``, the same factor
    on every rank; returns the norm before clipping (``grad_norm``). Collective."""
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a number > 0, got {max_norm!r}")
    norm = grad_norm(model, groups)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for _, p in _trained(model):
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))
    return norm

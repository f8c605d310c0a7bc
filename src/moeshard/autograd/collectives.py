"""The TP and SP collectives of the layer with their backward, under the replicated loss
(``moeshard.autograd``: the TP ranks of a DP rank compute the same loss from the same rows).

    shard_rows(x [N, ...], sizes, index)   -> x's rows of group rank ``index`` [sizes[index], ...]
        backward: all-gather the rows' gradients, so every rank holds dL/dx whole  [N, ...]
    gather_rows(y [sizes[index], ...])      -> every rank's rows, in group order     [N, ...]
        backward: this rank's rows of the gradient, NOT summed over the ranks
    tp_copy(t_1, ..., t_n)                  -> the same tensors (identity)
        backward: the gradients summed over the TP group (one all-reduce, in fp32 or fp64)
    tp_reduce(partial [T, H] fp32)          -> the sum over the TP group
        backward: identity

Why ``gather_rows``' backward keeps this rank's rows and does not sum: every rank of the group
computes the same loss from the same gathered rows, so each rank's upstream gradient already
is the whole dL/dy, identical on every rank. The rows this rank contributed influence the loss
once, through that one dL/dy; taking its own rows of it is exact. Summing the ranks' upstream
gradients (the textbook adjoint of an all-gather, a reduce-scatter) would count the one loss
once per rank: the gradient of every row, and of every parameter behind it, comes out ``size``
times too large (the doubled SP gradient known from other libraries at tp = 2). ``shard_rows``
is the mirror image: x is replicated, each rank uses only its rows of it, so the gradient of x
is the concatenation of the ranks' row gradients, which every rank needs whole (its x is the
output of replicated layers before this one).

Likewise ``tp_reduce``' backward is the identity (dL/dsum is the same on every TP rank and is the
gradient of each partial sum) and ``tp_copy``'s backward sums: each TP rank's experts see x and
the top-k weights whole but compute one slice of the intermediate dimension, so each rank's
gradient of them is a partial sum over the slices.

Precondition of every backward (collective): every rank of the group runs it, in the same
order, the same number of times; the forward's sizes hold in the backward. Zero rows are fine.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function

from moeshard.parallel.collectives import all_gatherv, all_reduce
from moeshard.parallel.trace import CollectiveTrace


class _ShardRows(Function):
    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int], index: int, group: Any, group_name: str,
                trace: CollectiveTrace | None) -> Tensor:
        start = sum(sizes[:index])
        ctx.sizes, ctx.group, ctx.group_name, ctx.trace = sizes, group, group_name, trace
        return x[start:start + sizes[index]].clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        full = all_gatherv(grad.contiguous(), ctx.sizes, ctx.group, ctx.group_name, trace=ctx.trace)
        return full, None, None, None, None, None


class _GatherRows(Function):
    @staticmethod
    def forward(ctx, y: Tensor, sizes: list[int], index: int, group: Any, group_name: str,
                trace: CollectiveTrace | None) -> Tensor:
        ctx.start, ctx.rows = sum(sizes[:index]), sizes[index]
        return all_gatherv(y.contiguous(), sizes, group, group_name, trace=trace)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # This rank's rows of the one upstream gradient (see the module docstring: no sum).
        return grad[ctx.start:ctx.start + ctx.rows].contiguous(), None, None, None, None, None


def shard_rows(x: Tensor, sizes: list[int], index: int, group: Any, group_name: str, *,
               trace: CollectiveTrace | None = None) -> Tensor:
    """x: [sum(sizes), ...], identical on every rank of ``group`` -> rows
    ``[sum(sizes[:index]), sum(sizes[:index + 1]))`` (a copy). index: this rank's index in the
    group; sizes: the same list on every rank. Backward: all-gather (``all_gatherv``)."""
    return _ShardRows.apply(x, sizes, index, group, group_name, trace)


def gather_rows(y: Tensor, sizes: list[int], index: int, group: Any, group_name: str, *,
                trace: CollectiveTrace | None = None) -> Tensor:
    """y: [sizes[index], ...] this rank's rows -> [sum(sizes), ...] every rank's rows in group
    order (``all_gatherv``), identical on every rank. Backward: this rank's rows of the upstream
    gradient, not summed (the replicated loss)."""
    return _GatherRows.apply(y, sizes, index, group, group_name, trace)


class _TPCopy(Function):
    @staticmethod
    def forward(ctx, group: Any, trace: CollectiveTrace | None, *tensors: Tensor):
        ctx.group, ctx.trace = group, trace
        ctx.meta = [(t.shape, t.dtype) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        # One all-reduce of every gradient, flattened, in fp32 at least (bf16 partial sums lose
        # less; fp64 stays fp64).
        acc = torch.float64 if any(dtype == torch.float64 for _, dtype in ctx.meta) else torch.float32
        flat = [torch.zeros(shape, dtype=acc, device=_device(grads)) if g is None else g.to(acc)
                for g, (shape, _) in zip(grads, ctx.meta, strict=True)]
        summed = all_reduce(torch.cat([f.reshape(-1) for f in flat]), ctx.group, "tp", trace=ctx.trace)
        out, at = [], 0
        for shape, dtype in ctx.meta:
            n = shape.numel()
            out.append(summed[at:at + n].view(shape).to(dtype))
            at += n
        return (None, None, *out)


def _device(grads) -> torch.device:
    return next(g.device for g in grads if g is not None)


def tp_copy(*tensors: Tensor, group: Any, trace: CollectiveTrace | None = None) -> tuple[Tensor, ...]:
    """The tensors themselves (views), whose gradients are summed over the TP group in the
    backward (one all-reduce of all of them): for replicated inputs of TP-sliced work."""
    return _TPCopy.apply(group, trace, *tensors)


class _TPReduce(Function):
    @staticmethod
    def forward(ctx, partial: Tensor, group: Any, trace: CollectiveTrace | None) -> Tensor:
        return all_reduce(partial.clone(), group, "tp", trace=trace)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None


def tp_reduce(partial: Tensor, group: Any, *, trace: CollectiveTrace | None = None) -> Tensor:
    """partial: fp32 [T, H] this TP rank's slice of the sum -> the sum over the TP group (a new
    tensor, the input is left as it is). Backward: identity (the replicated loss)."""
    return _TPReduce.apply(partial, group, trace)

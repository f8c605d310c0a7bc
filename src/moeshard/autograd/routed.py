"""Dispatch and combine of any backend with a backward (``BackendSpec.backward``), as autograd
Functions around the backend's own forward.

    dispatch(backend, x [T, H], routing) -> Dispatched whose ``input.x`` [M / repeat, H] carries
        the gradient: backward = ``backend.dispatch_backward`` (the reverse communication)
    combine(backend, y [M, H], topk_weights [T, K], dispatched) -> fp32 [T, H]: backward =
        ``backend.combine_backward``, the gradients of y and of the top-k weights

The forward is the backend's own (``dispatch``; ``combine_for_backward``, the same numerics as
``combine``), so a layer that trains computes exactly what it computes in inference. Only
unquantized payloads have a backward (``moeshard.autograd.support`` refuses the others): the
experts' rows are then model-dtype rows, which the Function hands over as a fresh tensor (the
backend's own may be a view of a buffer that the next forward overwrites).

Precondition (the backward is collective): every rank of the EP group runs the backward of
every dispatch and combine it ran forward, in the same order; a rank with no tokens too (its
loss must depend on the layer's output, which has zero rows there).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import Tensor
from torch.autograd import Function

from moeshard.dispatch.base import DifferentiableBackend, DispatchBackend, Dispatched
from moeshard.router import Routing


class _Dispatch(Function):
    @staticmethod
    def forward(ctx, x: Tensor, backend: DifferentiableBackend, routing: Routing, out: list[Dispatched]) -> Tensor:
        d = backend.dispatch(x, routing)
        rows = d.input.x
        if not isinstance(rows, Tensor):
            raise TypeError(f"{backend.name}: dispatch handed the experts {type(rows).__name__}, not model-dtype rows; "
                            f"only unquantized payloads have a backward")
        ctx.backend, ctx.dispatched = backend, d
        out.append(d)
        return rows.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad_rows: Tensor):
        return ctx.backend.dispatch_backward(grad_rows.contiguous(), ctx.dispatched), None, None, None


def _differentiable(backend: DispatchBackend) -> DifferentiableBackend:
    for method in ("dispatch_backward", "combine_for_backward", "combine_backward"):
        if not callable(getattr(backend, method, None)):
            raise TypeError(f"{backend.name}: has no {method} (a backend with a backward implements "
                            f"moeshard.dispatch.base.DifferentiableBackend)")
    return cast(DifferentiableBackend, backend)


def dispatch(backend: DispatchBackend, x: Tensor, routing: Routing) -> Dispatched:
    """``backend.dispatch(x, routing)`` whose experts' rows are differentiable in x (the backend
    must have a backward: ``BackendSpec.backward``)."""
    box: list[Dispatched] = []
    rows = _Dispatch.apply(x, _differentiable(backend), routing, box)
    return dataclasses.replace(box[0], input=dataclasses.replace(box[0].input, x=rows))


class _Combine(Function):
    @staticmethod
    def forward(ctx, y: Tensor, topk_weights: Tensor, backend: DifferentiableBackend, d: Dispatched) -> Tensor:
        out, saved = backend.combine_for_backward(y, d)
        ctx.backend, ctx.dispatched, ctx.saved = backend, d, saved
        ctx.save_for_backward(y)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (y,) = ctx.saved_tensors
        grad_y, grad_weights = ctx.backend.combine_backward(grad_out.contiguous(), y, ctx.dispatched, ctx.saved)
        return grad_y, grad_weights, None, None


def combine(backend: DispatchBackend, y: Tensor, topk_weights: Tensor, dispatched: Dispatched) -> Tensor:
    """``backend.combine(y, dispatched)`` (fp32 [T, H]), differentiable in y [M, H] and in the
    top-k weights fp32 [T, K] that ``dispatched`` was built with (pass the very tensor: the
    forward reads the backend's copy of it, the backward returns its gradient)."""
    return _Combine.apply(y, topk_weights, _differentiable(backend), dispatched)

"""The dispatch/combine interface shared by every backend.

    this rank's tokens x [T, H] and routing [T, K]
      --dispatch--> Dispatched.input: the rows for this rank's experts (``ExpertInput``: quantized
                    before dispatch or not, laid out as the backend's registry entry says)
      --experts--> y [M, H]
      --combine(y, dispatched)--> fp32 [T, H] = sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t])

A backend owns its wire format: it quantizes (``payload.prepare``), moves rows, scales and
expert ids in whatever messages suit it, and rebuilds the experts' input
(``Payload.expert_input``). Backends hold no parameters and keep no state between the two
calls: everything ``combine`` needs travels in the frozen ``Dispatched`` that ``dispatch``
returns. Buffers sized from the configuration may be kept by a backend across calls.

Cross-rank precondition: every rank of the EP group calls dispatch and combine the same number
of times, in the same order (they are collective), with the same H and dtype.

Training (``BackendSpec.backward``): a backend with a backward also has the three methods of
``DifferentiableBackend``, which ``moeshard.autograd.routed`` wraps in autograd Functions. The
forward is unchanged (the same dispatch, the same combine numerics); each backward is the
reverse communication of its forward: an all-to-all answers an all-to-all with the sizes
swapped, an all-gather a reduce-scatter, a reduce-scatter an all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from moeshard.config import MoEConfig, QuantConfig
from moeshard.dispatch.payload import Payload, prepare
from moeshard.experts.base import ExpertInput
from moeshard.router import Routing
from moeshard.triton_env import triton_importable

if TYPE_CHECKING:
    from moeshard.parallel.groups import ParallelGroups
    from moeshard.stages import StageRecorder


@dataclass(frozen=True)
class Dispatched:
    """What this rank's experts must compute, and what combine needs.

    input: the experts' rows (``ExpertInput``; its ``layout`` is the backend's registry entry's
       ``output``); state: backend-private record that ``combine`` consumes (frozen dataclass).
    """

    input: ExpertInput
    state: Any


@dataclass(frozen=True)
class BackendContext:
    """What a backend is built from (its registry entry's factory takes this one object).

    cfg: the layer's ``MoEConfig`` as the backend routes it (under a load-balancing placement,
    ``num_experts`` counts physical slots); quant: the layer's ``QuantConfig``; groups: the
    ``ParallelGroups`` (None for a layer outside any world); max_tokens: the most rows this rank
    routes in one forward (``MoELayer(max_tokens_per_rank=...)``, divided over the TP ranks under
    SP), or None when the layer was given no bound; recorder: the layer's ``StageRecorder``, or
    None unless ``moeshard check --explain`` records the stages; empty_picks: the routing may
    hold empty picks (``Routing.empty_picks``; ``MoELayer(empty_picks=...)``).
    """

    cfg: MoEConfig
    quant: QuantConfig
    groups: ParallelGroups | None = None
    max_tokens: int | None = None
    recorder: StageRecorder | None = None
    empty_picks: bool = False


class DispatchBackend(Protocol):
    """Built by its registry entry's factory from a ``BackendContext``; ``name`` as registered."""

    name: str

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        """x: [T, H] this rank's tokens (model dtype); routing: ids/weights [T, K] (global
        expert ids)."""
        ...

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y: [M, H] expert outputs for ``dispatched.input``'s rows -> fp32 [T, H] weighted sums."""
        ...


class FinalCombineBackend(DispatchBackend, Protocol):
    """A backend whose registry entry says ``combine_final=True`` (``BackendSpec``)."""

    def combine_final(self, y: torch.Tensor, dispatched: Dispatched, addend: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
        """``combine``'s sums plus ``addend`` ([T, H], the shared experts' output in the model
        dtype, or None), added in fp32 and rounded once to ``dtype`` -> [T, H] in ``dtype``: bit
        for bit ``(combine(y, dispatched) + addend.float()).to(dtype)``. The layer calls it,
        forward only, where nothing else runs between its combine and that sum."""
        ...


class PayloadFirstBackend(DispatchBackend, Protocol):
    """A backend whose registry entry says ``payload_first=True`` (``BackendSpec``): the payload
    of x needs neither the routing nor a collective, so it can be made before the routing."""

    def payload(self, x: torch.Tensor) -> Payload:
        """x: [T, H] this rank's tokens (model dtype) -> the ``Payload`` its dispatch sends; no
        collective runs."""
        ...

    def dispatch_payload(self, x: torch.Tensor, payload: Payload, routing: Routing) -> Dispatched:
        """``dispatch(x, routing)`` given ``payload``, which is ``payload(x)`` made earlier: the
        same result. The layer calls it forward only, after joining the stream that made the
        payload."""
        ...


class DifferentiableBackend(DispatchBackend, Protocol):
    """A backend whose dispatch and combine have a backward (its registry entry says
    ``backward=True``). Collective like the forward: every rank of the EP group calls each
    backward the same number of times, in the same order, zero rows included.

    ``combine_for_backward(y, dispatched) -> (out, saved)``: what ``combine`` returns (the same
    computation, the same numerics) and what ``combine_backward`` needs besides y, never a view
    of a buffer the backend reuses.
    ``combine_backward(grad_out, y, dispatched, saved) -> (grad_y, grad_weights)``: grad_out fp32
    [T, H] -> the gradient of the experts' output y [M, H] (y's dtype) and of this rank's top-k
    weights, fp32 [T, K].
    ``dispatch_backward(grad_rows, dispatched) -> grad_x``: the gradient of the experts' input
    rows (``dispatched.input.x``, [M / repeat, H], the model dtype; rows no expert computes,
    padding, carry zeros or anything: they are never read) -> the gradient of this rank's tokens
    x [T, H], in that dtype.
    """

    def combine_for_backward(self, y: torch.Tensor, dispatched: Dispatched) -> tuple[torch.Tensor, Any]: ...

    def combine_backward(self, grad_out: torch.Tensor, y: torch.Tensor, dispatched: Dispatched,
                         saved: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def dispatch_backward(self, grad_rows: torch.Tensor, dispatched: Dispatched) -> torch.Tensor: ...


class RowBackend:
    """What the built-in backends share: the context's fields as attributes, and ``payload``,
    which quantizes this rank's tokens for the wire exactly as every backend must
    (``payload.prepare``: per-tensor amaxes all-reduced over the EP group, the collective traced,
    the payload recorded for ``--explain``)."""

    name: str

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.cfg, self.quant, self.groups, self.recorder = ctx.cfg, ctx.quant, ctx.groups, ctx.recorder

    def payload(self, x: torch.Tensor) -> Payload:
        """x: [T, H] this rank's tokens (model dtype) -> the ``Payload`` to send."""
        groups = self.groups
        return prepare(x, self.quant, groups.ep_group if groups is not None else None,
                       groups.trace if groups is not None else None, self.recorder)

    def ep_groups(self) -> ParallelGroups:
        """The groups, refusing a layout without expert parallelism (the EP backends need one)."""
        if self.groups is None or self.groups.ep_group is None:
            raise ValueError(f"{self.name}: needs expert parallelism (ParallelConfig.enable_ep=True)")
        return self.groups


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Where combine sums and where its backward accumulates: fp32, or fp64 when a tensor is
    fp64 (the finite-difference checks run the backends in fp64; model dtypes never are)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def combine_rows(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                 pair_ids: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [T, H] (fp64 for fp64 inputs, ``acc_dtype``): ``out[t] = sum_k weights[t, k] *
    y[rows[t, k]]``, summed over k in order (deterministic), in one pass on CUDA
    (``moeshard.dispatch.combine_kernel``).

    y: [R, H] expert outputs (rows not named in ``rows`` are never read, so they may hold
    anything); rows: int64 [T, K]; weights: fp32 [T, K]; pair_ids: integer [T, K] the pairs'
    expert ids, or None: a pair of id -1 (an empty pick, ``Routing.empty_picks``) adds nothing,
    whatever its row holds (no expert wrote it).
    """
    if y.is_cuda and triton_importable()[0]:
        from moeshard.dispatch.combine_kernel import combine_topk
        return combine_topk(y, weights.float().contiguous(), rows.contiguous(),
                            pair_ids=None if pair_ids is None else pair_ids.contiguous())
    T, K = rows.shape
    acc = acc_dtype(y, weights)
    picked = y[rows.reshape(-1)]
    if pair_ids is not None:
        picked = picked.masked_fill((pair_ids.reshape(-1) < 0).unsqueeze(1), 0)
    return (picked.view(T, K, y.shape[1]).to(acc) * weights.to(acc).unsqueeze(-1)).sum(dim=1)


def pair_rows_backward(grad_out: torch.Tensor, picked: torch.Tensor,
                       weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of ``out[t] = sum_k weights[t, k] * picked[t * K + k]`` (``combine_rows`` on
    the rows it reads): grad_out fp32 [T, H]; picked [T * K, H] the rows combine weighed, in
    (token, k) order; weights fp32 [T, K] -> (grad_picked [T * K, H] in picked's dtype,
    ``weights[t, k] * grad_out[t]``; grad_weights fp32 [T, K], ``<grad_out[t], picked[t*K + k]>``
    summed in fp32)."""
    T, K = weights.shape
    H = grad_out.shape[1]
    if (grad_out.is_cuda and grad_out.dtype == torch.float32 and weights.dtype == torch.float32
            and picked.dtype != torch.float64 and triton_importable()[0]):
        from moeshard.dispatch.combine_kernel import combine_topk_backward
        return combine_topk_backward(grad_out.contiguous(), picked.contiguous(), weights.contiguous())
    acc = acc_dtype(grad_out, picked, weights)
    g = grad_out.to(acc).unsqueeze(1)  # [T, 1, H]
    grad_picked = (weights.to(acc).unsqueeze(-1) * g).to(picked.dtype).reshape(T * K, H)
    grad_weights = (picked.reshape(T, K, H).to(acc) * g).sum(dim=-1).to(weights.dtype)
    return grad_picked, grad_weights


def weighted_sum(y_rows: torch.Tensor, weights: torch.Tensor, token_of_row: torch.Tensor,
                 num_tokens: int) -> torch.Tensor:
    """fp32 [num_tokens, H] (fp64 for fp64 inputs): sum over rows r of weights[r] * y_rows[r]
    into token_of_row[r].

    y_rows: [M, H]; weights: fp32 [M]; token_of_row: int64 [M].
    """
    acc = acc_dtype(y_rows, weights)
    out = torch.zeros(num_tokens, y_rows.shape[1], dtype=acc, device=y_rows.device)
    return out.index_add_(0, token_of_row, y_rows.to(acc) * weights.to(acc).unsqueeze(1))

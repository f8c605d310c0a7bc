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
    None unless ``moeshard check --explain`` records the stages.
    """

    cfg: MoEConfig
    quant: QuantConfig
    groups: ParallelGroups | None = None
    max_tokens: int | None = None
    recorder: StageRecorder | None = None


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


def combine_rows(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 [T, H]: ``out[t] = sum_k weights[t, k] * y[rows[t, k]]``, summed over k in order
    (deterministic), in one pass on CUDA (``moeshard.dispatch.combine_kernel``).

    y: [R, H] expert outputs (rows not named in ``rows`` are never read, so they may hold
    anything); rows: int64 [T, K]; weights: fp32 [T, K].
    """
    if y.is_cuda and triton_importable()[0]:
        from moeshard.dispatch.combine_kernel import combine_topk
        return combine_topk(y, weights.float().contiguous(), rows.contiguous())
    T, K = rows.shape
    return (y[rows.reshape(-1)].view(T, K, y.shape[1]).float() * weights.float().unsqueeze(-1)).sum(dim=1)


def weighted_sum(y_rows: torch.Tensor, weights: torch.Tensor, token_of_row: torch.Tensor,
                 num_tokens: int) -> torch.Tensor:
    """fp32 [num_tokens, H]: sum over rows r of weights[r] * y_rows[r] into token_of_row[r].

    y_rows: [M, H]; weights: fp32 [M]; token_of_row: int64 [M].
    """
    out = torch.zeros(num_tokens, y_rows.shape[1], dtype=torch.float32, device=y_rows.device)
    return out.index_add_(0, token_of_row, y_rows.float() * weights.unsqueeze(1))

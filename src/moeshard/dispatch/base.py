"""The dispatch/combine interface shared by every backend.

    this rank's tokens x [T, Hp] (+ row scales [T, S]) and routing [T, K]
      --dispatch--> rows for this rank's experts: Dispatched.x [M / repeat, Hp], x_scale [M / repeat, S],
                    expert_ids [M] (routed row m reads x[m // repeat]; repeat is 1 except for ``local``)
      --experts--> y [M, H]
      --combine(y, dispatched)--> fp32 [T, H] = sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t])

Backends hold no parameters and keep no state between the two calls: everything ``combine``
needs travels in the frozen ``Dispatched`` that ``dispatch`` returns. Payloads of quantized
activations arrive as uint8 wire views (``moeshard.quant.to_wire``); backends never interpret
them, they only move rows. ``x_scale`` is None for unquantized, per-tensor-scaled and deferred
activations, and every backend must cope with that.

Cross-rank precondition: every rank of the EP group calls dispatch and combine the same number
of times, in the same order (they are collective), with the same H, dtypes and scale presence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moeshard.router import Routing


@dataclass(frozen=True)
class Dispatched:
    """What this rank's experts must compute: M routed rows.

    x: [M / repeat, Hp] received rows (model dtype, or uint8 wire view of quantized data).
    x_scale: [M / repeat, S] their per-row scales (wire view) or None.
    expert_ids: int64 [M] local expert index of each routed row.
    state: backend-private record that ``combine`` consumes (frozen dataclass).
    repeat: x and x_scale hold one row per ``repeat`` consecutive routed rows: routed row m is
       x[m // repeat] (with x_scale[m // repeat]). The ``local`` backend sets it to top-k, so the
       K copies of a token are never materialised; backends that move rows keep 1.
    """

    x: torch.Tensor
    x_scale: torch.Tensor | None
    expert_ids: torch.Tensor
    state: Any
    repeat: int = 1


class DispatchBackend(Protocol):
    name: str

    def dispatch(self, x: torch.Tensor, x_scale: torch.Tensor | None, routing: Routing) -> Dispatched:
        """x: [T, Hp]; x_scale: [T, S] or None; routing: ids/weights [T, K] (global expert ids)."""

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y: [M, H] expert outputs for ``dispatched`` rows -> fp32 [T, H] weighted sums."""


def weighted_sum(y_rows: torch.Tensor, weights: torch.Tensor, token_of_row: torch.Tensor,
                 num_tokens: int) -> torch.Tensor:
    """fp32 [num_tokens, H]: sum over rows r of weights[r] * y_rows[r] into token_of_row[r].

    y_rows: [M, H]; weights: fp32 [M]; token_of_row: int64 [M].
    """
    out = torch.zeros(num_tokens, y_rows.shape[1], dtype=torch.float32, device=y_rows.device)
    return out.index_add_(0, token_of_row, y_rows.float() * weights.unsqueeze(1))

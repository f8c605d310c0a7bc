"""``local``: no expert parallelism; every rank holds every (possibly TP-sliced) expert.

Each (token, k) pair becomes one row. No communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.dispatch.base import Dispatched, weighted_sum
from moeshard.router import Routing


@dataclass(frozen=True)
class LocalState:
    """token_of_row: int64 [T*K]; weights: fp32 [T*K]; num_tokens: T."""

    token_of_row: torch.Tensor
    weights: torch.Tensor
    num_tokens: int


class LocalBackend:
    name = "local"

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, x_scale: torch.Tensor | None, routing: Routing) -> Dispatched:
        T, K = routing.topk_ids.shape
        token_of_row = torch.arange(T, device=x.device).repeat_interleave(K)
        return Dispatched(
            x=x.index_select(0, token_of_row),
            x_scale=None if x_scale is None else x_scale.index_select(0, token_of_row),
            expert_ids=routing.topk_ids.reshape(-1),
            state=LocalState(token_of_row, routing.topk_weights.reshape(-1), T),
        )

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        s = dispatched.state
        return weighted_sum(y, s.weights, s.token_of_row, s.num_tokens)

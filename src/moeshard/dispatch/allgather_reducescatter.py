"""``allgather_reducescatter``: every EP rank sees every token, computes its experts' share.

    dispatch: all-gather x, scales and routing of the EP group (uneven T per rank);
              keep the (token, k) pairs whose expert lives here.
    combine:  weighted sum into a [T_group, H] fp32 partial, reduce-scatter back (uneven).

Simple and robust; traffic grows with the EP size since every token visits every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.dispatch.base import Dispatched, weighted_sum
from moeshard.parallel.collectives import all_gatherv, exchange_sizes, reduce_scatterv
from moeshard.parallel.groups import ParallelGroups
from moeshard.router import Routing


@dataclass(frozen=True)
class GatherState:
    """token_of_row: int64 [M] index into the gathered tokens; weights: fp32 [M];
    sizes: tokens per EP rank (group order); num_gathered: sum(sizes)."""

    token_of_row: torch.Tensor
    weights: torch.Tensor
    sizes: list[int]
    num_gathered: int


class AllGatherReduceScatterBackend:
    name = "allgather_reducescatter"

    def __init__(self, num_experts: int, groups: ParallelGroups) -> None:
        if groups.ep_group is None:
            raise ValueError("allgather_reducescatter: needs expert parallelism (ParallelConfig.enable_ep=True)")
        self.groups = groups
        ep = groups.config.ep_size
        self.experts_per_rank = num_experts // ep
        self.first_expert = groups.index_in("ep") * self.experts_per_rank

    def _gather(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return all_gatherv(t.contiguous(), sizes, self.groups.ep_group, "ep")

    def dispatch(self, x: torch.Tensor, x_scale: torch.Tensor | None, routing: Routing) -> Dispatched:
        sizes = exchange_sizes(x.shape[0], self.groups.ep_group, x.device)
        x_all = self._gather(x, sizes)
        scale_all = None if x_scale is None else self._gather(x_scale, sizes)
        ids_all = self._gather(routing.topk_ids, sizes)
        w_all = self._gather(routing.topk_weights, sizes)
        local = ids_all - self.first_expert
        mine = (local >= 0) & (local < self.experts_per_rank)
        token_of_row, k_of_row = mine.nonzero(as_tuple=True)
        return Dispatched(
            x=x_all.index_select(0, token_of_row),
            x_scale=None if scale_all is None else scale_all.index_select(0, token_of_row),
            expert_ids=local[token_of_row, k_of_row],
            state=GatherState(token_of_row, w_all[token_of_row, k_of_row], sizes, x_all.shape[0]),
        )

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        s = dispatched.state
        partial = weighted_sum(y, s.weights, s.token_of_row, s.num_gathered)
        return reduce_scatterv(partial, s.sizes, self.groups.ep_group, "ep")

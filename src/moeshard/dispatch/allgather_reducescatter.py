"""``allgather_reducescatter``: every EP rank sees every token, computes its experts' share.

    dispatch: all-gather x, scales and routing of the EP group (uneven T per rank);
              keep the (token, k) pairs whose expert lives here.
    combine:  weighted sum into a [T_group, H] fp32 partial, reduce-scatter back (uneven).

Simple and robust; traffic grows with the EP size since every token visits every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.dispatch.base import BackendContext, Dispatched, RowBackend, weighted_sum
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


class AllGatherReduceScatterBackend(RowBackend):
    name = "allgather_reducescatter"
    groups: ParallelGroups  # EP on: ep_groups() refused a layout without

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        groups = self.groups = self.ep_groups()
        ep = groups.config.ep_size
        self.experts_per_rank = ctx.cfg.num_experts // ep
        self.first_expert = groups.index_in("ep") * self.experts_per_rank

    def _gather(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return all_gatherv(t.contiguous(), sizes, self.groups.ep_group, "ep", trace=self.groups.trace)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        p = self.payload(x)
        sizes = exchange_sizes(x.shape[0], self.groups.ep_group, x.device, group_name="ep", trace=self.groups.trace)
        x_all = self._gather(p.rows, sizes)
        scale_all = None if p.row_scale is None else self._gather(p.row_scale, sizes)
        ids_all = self._gather(routing.topk_ids, sizes)
        w_all = self._gather(routing.topk_weights, sizes)
        local = ids_all - self.first_expert
        mine = (local >= 0) & (local < self.experts_per_rank)
        token_of_row, k_of_row = mine.nonzero(as_tuple=True)
        inp = p.expert_input(x_all.index_select(0, token_of_row),
                             None if scale_all is None else scale_all.index_select(0, token_of_row),
                             local[token_of_row, k_of_row])
        return Dispatched(inp, GatherState(token_of_row, w_all[token_of_row, k_of_row], sizes, x_all.shape[0]))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        s = dispatched.state
        partial = weighted_sum(y, s.weights, s.token_of_row, s.num_gathered)
        return reduce_scatterv(partial, s.sizes, self.groups.ep_group, "ep", trace=self.groups.trace)

"""``allgather_reducescatter``: every EP rank sees every token, computes its experts' share.

    dispatch: all-gather x, scales and routing of the EP group (uneven T per rank);
              keep the (token, k) pairs whose expert lives here.
    combine:  weighted sum into a [T_group, H] fp32 partial, reduce-scatter back (uneven).

Simple and robust; traffic grows with the EP size since every token visits every rank. An empty
pick (id -1, ``Routing.empty_picks``) is no rank's expert, so no rank keeps it: the experts never
see it and combine has no row of it (``BackendSpec.combine_skips_empty``).

Backward: each collective answered by its adjoint. combine: all-gather the output's gradient
(every rank needs it for the rows it computed), the weighted rows' gradients, and the top-k
weights' gradients reduce-scattered back to their tokens' ranks (each pair was computed on one
rank, the others add zeros). dispatch: the rows' gradients summed per gathered token, in fp32,
reduce-scattered back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.dispatch.base import BackendContext, Dispatched, RowBackend, acc_dtype, weighted_sum
from moeshard.parallel.collectives import all_gatherv, exchange_sizes, reduce_scatterv
from moeshard.parallel.groups import ParallelGroups
from moeshard.router import Routing


@dataclass(frozen=True)
class GatherState:
    """token_of_row: int64 [M] index into the gathered tokens; weights: fp32 [M];
    sizes: tokens per EP rank (group order); num_gathered: sum(sizes); k_of_row: int64 [M] the
    top-k slot of each row (the backward puts its weight's gradient there)."""

    token_of_row: torch.Tensor
    weights: torch.Tensor
    sizes: list[int]
    num_gathered: int
    k_of_row: torch.Tensor


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
        return Dispatched(inp, GatherState(token_of_row, w_all[token_of_row, k_of_row], sizes, x_all.shape[0],
                                                   k_of_row))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        s = dispatched.state
        partial = weighted_sum(y, s.weights, s.token_of_row, s.num_gathered)
        return reduce_scatterv(partial, s.sizes, self.groups.ep_group, "ep", trace=self.groups.trace)

    # -- backward (moeshard.autograd.routed) ----------------------------------------------------
    def combine_for_backward(self, y: torch.Tensor, dispatched: Dispatched) -> tuple[torch.Tensor, None]:
        return self.combine(y, dispatched), None

    def combine_backward(self, grad_out: torch.Tensor, y: torch.Tensor, dispatched: Dispatched,
                         saved: None) -> tuple[torch.Tensor, torch.Tensor]:
        """grad_out fp32 [T, H] -> (grad of y [M, H], grad of the top-k weights fp32 [T, K])."""
        s = dispatched.state
        K = self.cfg.top_k
        acc = acc_dtype(grad_out, y, s.weights)
        g_rows = self._gather(grad_out.to(acc), s.sizes)[s.token_of_row]  # [M, H]
        grad_y = (g_rows * s.weights.to(acc).unsqueeze(1)).to(y.dtype)
        grad_w_all = torch.zeros(s.num_gathered, K, dtype=s.weights.dtype, device=y.device)
        grad_w_all[s.token_of_row, s.k_of_row] = (g_rows * y.to(acc)).sum(dim=1).to(s.weights.dtype)
        return grad_y, reduce_scatterv(grad_w_all, s.sizes, self.groups.ep_group, "ep", trace=self.groups.trace)

    def dispatch_backward(self, grad_rows: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """grad_rows [M, H] -> grad of x [T, H]: summed per gathered token, reduce-scattered back."""
        s = dispatched.state
        acc = acc_dtype(grad_rows)
        per_token = torch.zeros(s.num_gathered, grad_rows.shape[1], dtype=acc, device=grad_rows.device)
        per_token.index_add_(0, s.token_of_row, grad_rows.to(acc))
        grad_x = reduce_scatterv(per_token, s.sizes, self.groups.ep_group, "ep", trace=self.groups.trace)
        return grad_x.to(grad_rows.dtype)

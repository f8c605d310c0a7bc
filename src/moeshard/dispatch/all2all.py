"""``all2all``: send each routed copy only to the rank that owns its expert.

    dispatch: sort the T*K (token, k) pairs by destination rank; exchange per-destination counts;
              pack each pair's row, scales and local expert id into one slot (``packing``);
              one uneven all-to-all of the slots.
    combine:  the reverse all-to-all of the expert outputs (model dtype), then one pass that
              sums each token's K rows, weighted, in fp32 (deterministic).

Least traffic. Split sizes must be known on the host, so counts are read back once per
dispatch. On CUDA the counts travel over a gloo side channel (``ParallelGroups.side_group``),
which keeps the NCCL stream free of a tiny synchronising exchange; the backend refuses at
construction when that group is missing rather than failing inside the exchange.

Backward: combine's gradient goes out by the dispatch's all-to-all (each pair's weighted
gradient row to the rank that computed it) and dispatch's comes back by the combine's (each
received row's gradient to its token's rank, summed over the token's K pairs there, in fp32).
The split sizes are the forward's, so the backward reads no counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.dispatch.base import BackendContext, Dispatched, RowBackend, acc_dtype, combine_rows, pair_rows_backward
from moeshard.dispatch.packing import SlotLayout, pack, pair_destinations, unpack
from moeshard.parallel.collectives import all_to_allv, exchange_counts
from moeshard.parallel.groups import ParallelGroups
from moeshard.router import Routing


@dataclass(frozen=True)
class All2AllState:
    """row_of_pair: int64 [T, K] the row of each (token, k) pair in send order (where its
    result comes back); weights: fp32 [T, K]; send/recv: rows per EP rank; pair_ids: int64
    [T, K] the pairs' expert ids where the routing may hold empty picks (whose rows combine
    skips), else None."""

    row_of_pair: torch.Tensor
    weights: torch.Tensor
    send: list[int]
    recv: list[int]
    pair_ids: torch.Tensor | None = None


class All2AllBackend(RowBackend):
    name = "all2all"
    groups: ParallelGroups  # EP on: ep_groups() refused a layout without

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        # On CUDA the count exchange needs the gloo side group: the layer refuses its absence with
        # the registry's reason (``support``) before building this backend.
        groups = self.groups = self.ep_groups()
        self.ep_size = groups.config.ep_size
        self.experts_per_rank = ctx.cfg.num_experts // self.ep_size
        self.ep_rank = groups.index_in("ep")

    def _counts(self, dest: torch.Tensor) -> tuple[list[int], list[int]]:
        send = torch.bincount(dest, minlength=self.ep_size)
        trace = self.groups.trace
        if self.groups.side_group is not None:
            recv = exchange_counts(send.cpu(), self.groups.side_group, group_name="ep", trace=trace)
        else:
            recv = exchange_counts(send, self.groups.ep_group, group_name="ep", trace=trace)
        return send.tolist(), recv.tolist()

    def _exchange(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return all_to_allv(t.contiguous(), send, recv, self.groups.ep_group, "ep", trace=self.groups.trace)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        p = self.payload(x)
        T, K = routing.topk_ids.shape
        ids = routing.topk_ids.reshape(-1)
        dest, local = pair_destinations(ids, self.experts_per_rank, self.ep_rank, routing.empty_picks)
        order = torch.argsort(dest, stable=True)
        layout = SlotLayout.of(p)
        slots = torch.empty(T * K, layout.row, dtype=torch.uint8, device=x.device)
        pack(slots, torch.arange(T * K, device=x.device), p, torch.div(order, K, rounding_mode="floor"),
             local[order], layout)
        send, recv = self._counts(dest)
        rows, scale, expert_ids = unpack(self._exchange(slots, send, recv), p, layout)
        row_of_pair = torch.empty_like(order)
        row_of_pair[order] = torch.arange(T * K, device=x.device)
        state = All2AllState(row_of_pair.view(T, K), routing.topk_weights, send, recv,
                             routing.topk_ids if routing.empty_picks else None)
        return Dispatched(p.expert_input(rows, scale, expert_ids), state)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        s = dispatched.state
        return combine_rows(self._exchange(y, s.recv, s.send), s.row_of_pair, s.weights, s.pair_ids)

    # -- backward (moeshard.autograd.routed) ----------------------------------------------------
    def combine_for_backward(self, y: torch.Tensor, dispatched: Dispatched) -> tuple[torch.Tensor, torch.Tensor]:
        """(combine's output, the rows it weighed [T*K, H] in (token, k) order)."""
        s = dispatched.state
        back = self._exchange(y, s.recv, s.send)
        return combine_rows(back, s.row_of_pair, s.weights, s.pair_ids), back[s.row_of_pair.reshape(-1)]

    def combine_backward(self, grad_out: torch.Tensor, y: torch.Tensor, dispatched: Dispatched,
                         picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """grad_out fp32 [T, H] -> (grad of y [sum(recv), H], grad of the top-k weights fp32 [T, K])."""
        s = dispatched.state
        grad_picked, grad_weights = pair_rows_backward(grad_out, picked, s.weights)
        grad_back = torch.empty_like(grad_picked)
        grad_back[s.row_of_pair.reshape(-1)] = grad_picked  # row_of_pair is a permutation of the T*K rows
        return self._exchange(grad_back, s.send, s.recv), grad_weights

    def dispatch_backward(self, grad_rows: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """grad_rows [sum(recv), H] -> grad of x [T, H]: each row back to its token, summed over k."""
        s = dispatched.state
        T, K = s.row_of_pair.shape
        back = self._exchange(grad_rows, s.recv, s.send)  # [T*K, H] in send order
        summed = back[s.row_of_pair.reshape(-1)].reshape(T, K, grad_rows.shape[1]).to(acc_dtype(grad_rows)).sum(dim=1)
        return summed.to(grad_rows.dtype)

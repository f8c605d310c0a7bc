"""``low_latency``: fixed-capacity dispatch with no host synchronisation and no side channel.

    dispatch: every (token, k) pair gets a slot in its destination rank's block of a send buffer
              [P, C, row] (C = rows a rank can send to one peer, fixed by the configuration);
              one pack writes each pair's row, row scales and local expert id into its slot
              (unused slots carry id -1); one equal-split all-to-all moves the whole buffer.
    combine:  the experts' outputs go back by the reverse equal-split all-to-all, slot for slot;
              the source rank gathers its pairs' rows and sums them over k, weighted, in fp32.

Nothing is read back to the host and every collective has a size fixed by the configuration, so
the layer's forward under EP and SP can be captured in a CUDA graph: ranks may even replay
graphs captured at different token counts (0 included), since their collectives still match.
The cost is traffic: the whole buffer moves, used or not (C = max_tokens * min(top_k, E_l) rows
per peer, the worst case of routing). Runs on gloo as on NCCL (bytes travel as uint8).

The experts receive ``FLAT`` rows, P * C of them, the unused ones with expert id -1 (padding).
Buffers are kept by the backend and allocated on the first call (their shapes follow from the
configuration, so they never change).

Backward: the same equal-split all-to-alls the other way round, slot for slot (combine's
gradient to the experts' slots, unused slots zero; dispatch's gradient back to the pairs' slots,
summed over each token's K pairs in fp32), into new tensors: what the backward keeps is copied
out of the kept buffers, which the next forward overwrites.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeshard.dispatch.base import BackendContext, Dispatched, RowBackend, acc_dtype, combine_rows, pair_rows_backward
from moeshard.dispatch.packing import SlotLayout, pack, pair_destinations, unpack
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.trace import traced
from moeshard.router import Routing


@dataclass(frozen=True)
class LowLatencyState:
    """slot: int64 [T, K] slot of each (token, k) pair in the P*C rows; weights: fp32 [T, K];
    pair_ids: int64 [T, K] the pairs' expert ids where the routing may hold empty picks (whose
    rows combine skips), else None."""

    slot: torch.Tensor
    weights: torch.Tensor
    pair_ids: torch.Tensor | None = None


class LowLatencyBackend(RowBackend):
    """Built from a ``BackendContext`` with EP on and ``max_tokens`` set: the most rows this rank
    routes in one forward (the layer's ``max_tokens_per_rank``, divided over the TP ranks under SP)."""

    name = "low_latency"
    groups: ParallelGroups  # EP on: ep_groups() refused a layout without

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        groups = self.groups = self.ep_groups()
        cfg, max_tokens = ctx.cfg, ctx.max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"low_latency (rank {groups.rank}): max_tokens must be an int >= 1 (the layer's "
                             f"max_tokens_per_rank), got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.peers = groups.config.ep_size
        self.experts_per_rank = cfg.num_experts // self.peers
        self.top_k, self.hidden = cfg.top_k, cfg.hidden_size
        # A token's K experts are distinct, and at most E_l of them live on one peer; its empty
        # picks stay on this rank (``pair_destinations``), so with them this rank's block may
        # take all K of a token's pairs.
        self.capacity = max_tokens * (cfg.top_k if ctx.empty_picks else min(cfg.top_k, self.experts_per_rank))
        self.ep_rank = groups.index_in("ep")
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape[1] != cols or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(self.peers * self.capacity, cols, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf

    def _slots(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot int64 [T*K], local expert id int32 [T*K]): pair i goes to row slot[i] of the
        P*C send rows, the position among the pairs for the same peer, in (token, k) order."""
        ids = routing.topk_ids.reshape(-1)
        dest, local = pair_destinations(ids, self.experts_per_rank, self.ep_rank, routing.empty_picks)
        # (not F.one_hot: on CUDA it checks the values' range, a host synchronisation)
        onehot = (dest.unsqueeze(1) == torch.arange(self.peers, device=dest.device)).long()
        pos = (onehot.cumsum(0) - onehot).gather(1, dest.unsqueeze(1)).squeeze(1)
        return dest * self.capacity + pos, local.to(torch.int32)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        T, K = routing.topk_ids.shape
        if T > self.max_tokens:
            raise ValueError(f"low_latency (rank {self.groups.rank}): {T} tokens to route, but the buffers hold "
                             f"max_tokens={self.max_tokens} per rank")
        p = self.payload(x)
        layout = SlotLayout.of(p)
        send = self._buffer("send", layout.row, torch.uint8, x.device)
        recv = self._buffer("recv", layout.row, torch.uint8, x.device)
        layout.ids(send).fill_(-1)
        slot, local = self._slots(routing)
        pack(send, slot, p, torch.arange(T * K, device=x.device) // K, local, layout)
        sizes = [self.capacity] * self.peers
        with traced(self.groups.trace, "all_to_all", "ep", send, sizes, sizes):
            dist.all_to_all_single(recv, send, group=self.groups.ep_group)
        rows, scale, expert_ids = unpack(recv, p, layout)
        return Dispatched(p.expert_input(rows, scale, expert_ids),
                          LowLatencyState(slot.view(T, K), routing.topk_weights,
                                          routing.topk_ids if routing.empty_picks else None))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y: [P*C, H] (padding rows unspecified) -> fp32 [T, H]."""
        s = dispatched.state
        return combine_rows(self._exchange("back", y), s.slot, s.weights, s.pair_ids)

    def _exchange(self, buffer: str | None, rows: torch.Tensor) -> torch.Tensor:
        """rows [P*C, W]: block j to peer j, by one equal-split all-to-all into the kept buffer
        ``buffer`` (None: a new tensor, as the backward uses) -> [P*C, W], block j from peer j."""
        out = (torch.empty_like(rows, memory_format=torch.contiguous_format) if buffer is None
               else self._buffer(buffer, rows.shape[1], rows.dtype, rows.device))
        sizes = [self.capacity] * self.peers
        with traced(self.groups.trace, "all_to_all", "ep", rows, sizes, sizes):
            dist.all_to_all_single(out, rows.contiguous(), group=self.groups.ep_group)
        return out

    # -- backward (moeshard.autograd.routed) ----------------------------------------------------
    def combine_for_backward(self, y: torch.Tensor, dispatched: Dispatched) -> tuple[torch.Tensor, torch.Tensor]:
        """(combine's output, the rows it weighed [T*K, H] in (token, k) order, copied out of the buffer)."""
        s = dispatched.state
        back = self._exchange("back", y)
        return combine_rows(back, s.slot, s.weights, s.pair_ids), back[s.slot.reshape(-1)]

    def combine_backward(self, grad_out: torch.Tensor, y: torch.Tensor, dispatched: Dispatched,
                         picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """grad_out fp32 [T, H] -> (grad of y [P*C, H], zero in unused slots; grad of the top-k
        weights fp32 [T, K])."""
        s = dispatched.state
        grad_picked, grad_weights = pair_rows_backward(grad_out, picked, s.weights)
        grad_send = grad_picked.new_zeros(self.peers * self.capacity, grad_picked.shape[1])
        grad_send[s.slot.reshape(-1)] = grad_picked
        return self._exchange(None, grad_send), grad_weights

    def dispatch_backward(self, grad_rows: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """grad_rows [P*C, H] -> grad of x [T, H]: each pair's slot back to its token, summed over k."""
        s = dispatched.state
        T, K = s.slot.shape
        back = self._exchange(None, grad_rows)
        summed = back[s.slot.reshape(-1)].reshape(T, K, grad_rows.shape[1]).to(acc_dtype(grad_rows)).sum(dim=1)
        return summed.to(grad_rows.dtype)

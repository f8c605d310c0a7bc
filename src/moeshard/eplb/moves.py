"""Rebalancing: move only the slots whose expert changed, rank to rank.

    plan_moves(old, new) -> SlotMove(dst, src) for every slot s with new.slots[s] != old.slots[s]:
        src = a slot that holds new.slots[s] under ``old``: the one on the same rank when there
        is one (a local copy, nothing sent), else the old replicas in turn (so a hot expert
        copied to several ranks is sent by several ranks)
    move_slots(tensors, moves, ...) on every EP rank, together:
        read every source row first (the old weights), then one uneven all-to-all of whole slots
        as bytes (weights, scales and global scales of both projections in one row per slot;
        float8 and packed nvfp4 travel as uint8, which gloo accepts), then write the rows into
        their destination slots

The plan is a pure function of the two placements, which every rank agrees on (checked before
by the layer's configuration exchange), so every rank derives the same send and receive sizes
without exchanging them, and either every rank enters the all-to-all or none does. A slot
whose expert stays, or only changes between active and standby, moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeshard.eplb.placement import Placement
from moeshard.parallel.collectives import all_to_allv
from moeshard.parallel.trace import CollectiveTrace


@dataclass(frozen=True)
class SlotMove:
    """Slot ``dst`` (new placement) gets the weights slot ``src`` held under the old placement."""

    dst: int
    src: int


@dataclass(frozen=True)
class MoveStats:
    """What one rank did in a rebalance: slots it rewrote (``received`` of them from other
    ranks, ``copied`` from its own old slots), slots it sent, and bytes each way."""

    rewritten: int
    received: int
    copied: int
    sent: int
    bytes_sent: int
    bytes_received: int


def plan_moves(old: Placement, new: Placement) -> tuple[SlotMove, ...]:
    """The slot moves from ``old`` to ``new`` (same E, P and slot count), in destination order."""
    if (old.num_experts, old.num_ranks, old.num_slots) != (new.num_experts, new.num_ranks, new.num_slots):
        raise ValueError(f"plan_moves: placements differ in shape: (E, P, N) = ({old.num_experts}, {old.num_ranks}, "
                         f"{old.num_slots}) vs ({new.num_experts}, {new.num_ranks}, {new.num_slots}); a rebalance "
                         f"keeps the number of slots")
    S = old.slots_per_rank
    turn: dict[int, int] = {}
    moves = []
    for dst, (was, now) in enumerate(zip(old.slots, new.slots, strict=True)):
        if was == now:
            continue
        holders = old.replicas(now, active_only=False)
        local = [s for s in holders if s // S == dst // S]
        if local:
            src = local[0]
        else:
            k = turn.get(now, 0)
            turn[now] = k + 1
            src = holders[k % len(holders)]
        moves.append(SlotMove(dst, src))
    return tuple(moves)


def _rows(t: torch.Tensor, slots: int) -> torch.Tensor:
    """``t`` [S, ...] as a uint8 [S, bytes per slot] view of its storage (writes go through)."""
    if t.shape[0] != slots or not t.is_contiguous():
        raise ValueError(f"move_slots: expected a contiguous tensor with {slots} slots in dim 0, got "
                         f"{t.dtype} {list(t.shape)} (contiguous={t.is_contiguous()})")
    return t.reshape(-1).view(torch.uint8).view(slots, -1)


@torch.no_grad()
def move_slots(tensors: list[torch.Tensor], moves: tuple[SlotMove, ...], slots_per_rank: int, ep_rank: int,
               group: Any, trace: CollectiveTrace | None = None) -> MoveStats:
    """Carries out ``moves`` on this rank's slot tensors, in place.

    tensors: every per-slot tensor of this rank's experts, each [S, ...] contiguous (weights,
    scales, global scales), the same list on every rank; moves: ``plan_moves`` (the same on
    every rank); ep_rank: this rank's index in ``group`` (the EP group; None with one rank).
    Collective over ``group`` when any move crosses ranks (every rank then calls it); recorded in
    ``trace`` (the rank's ``CollectiveTrace``) when given.
    """
    S = slots_per_rank
    rows = [_rows(t, S) for t in tensors]
    device = tensors[0].device
    row_bytes = sum(r.shape[1] for r in rows)

    def read(local_slots: list[int]) -> torch.Tensor:
        idx = torch.tensor(local_slots, dtype=torch.int64, device=device)
        if not rows:
            return torch.empty(len(local_slots), 0, dtype=torch.uint8, device=device)
        return torch.cat([r.index_select(0, idx) for r in rows], dim=1)

    def write(local_slots: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(local_slots, dtype=torch.int64, device=device)
        at = 0
        for r in rows:
            r[idx] = data[:, at:at + r.shape[1]]
            at += r.shape[1]

    copies = [m for m in moves if m.src // S == m.dst // S == ep_rank]
    remote = [m for m in moves if m.src // S != m.dst // S]
    # Sources first: every read happens before any slot is overwritten.
    copied = read([m.src % S for m in copies]) if copies else None
    received = None
    send = recv = []
    if remote:
        if group is None:
            raise ValueError(f"move_slots (EP rank {ep_rank}): moves cross ranks but there is no EP group")
        ranks = max(max(m.dst // S, m.src // S) for m in remote) + 1
        size = torch.distributed.get_world_size(group)
        if ranks > size:
            raise ValueError(f"move_slots (EP rank {ep_rank}): a move names rank {ranks - 1}, the EP group has {size}")
        send = [m for j in range(size) for m in remote if m.src // S == ep_rank and m.dst // S == j]
        recv = [m for i in range(size) for m in remote if m.dst // S == ep_rank and m.src // S == i]
        send_sizes = [sum(1 for m in send if m.dst // S == j) for j in range(size)]
        recv_sizes = [sum(1 for m in recv if m.src // S == i) for i in range(size)]
        out = read([m.src % S for m in send]) if send else torch.empty(0, row_bytes, dtype=torch.uint8, device=device)
        received = all_to_allv(out, send_sizes, recv_sizes, group, "ep", trace=trace)
    if copied is not None:
        write([m.dst % S for m in copies], copied)
    if received is not None and recv:
        write([m.dst % S for m in recv], received)
    return MoveStats(rewritten=len(copies) + len(recv), received=len(recv), copied=len(copies), sent=len(send),
                     bytes_sent=len(send) * row_bytes, bytes_received=len(recv) * row_bytes)

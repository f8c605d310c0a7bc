"""One message per routed copy: the row, its scales and its local expert id in one slot.

A backend that moves rows writes each (token, k) pair's payload row (model dtype or quantized
bytes), its row scales and its int32 local expert id into one uint8 slot of a send buffer, so a
dispatch is one collective instead of three, and ``unpack`` views the received buffer as the
experts' rows, scales and ids without copying. Every section of a slot starts on a 16-byte
boundary, so the views are aligned for vector loads (and for Hopper's TMA).
``pair_destinations`` says which EP rank each pair's slot goes to, and its expert id there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.dispatch.payload import Payload

ALIGN = 16
ID_BYTES = 4  # int32 local expert id; -1 marks an unused slot


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def as_bytes(t: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """[T, ...] of any dtype as uint8 [T, row_bytes] (flattened first: a size-1 last dimension
    may carry any stride, which a dtype view refuses)."""
    return t.contiguous().reshape(-1).view(torch.uint8).view(t.shape[0], row_bytes)


@dataclass(frozen=True)
class SlotLayout:
    """Byte layout of one slot: data [0, data), row scales [scale_at, scale_at + scale),
    int32 expert id at id_at; ``row`` bytes in all (a multiple of 16)."""

    data: int
    scale_at: int
    scale: int
    id_at: int
    row: int

    @staticmethod
    def of(payload: Payload) -> SlotLayout:
        data = payload.rows.shape[1] * payload.rows.element_size()
        scale = 0 if payload.row_scale is None else payload.row_scale.shape[1] * payload.row_scale.element_size()
        scale_at = _up(data)
        id_at = _up(scale_at + scale)
        return SlotLayout(data, scale_at, scale, id_at, _up(id_at + ID_BYTES))

    def ids(self, buf: torch.Tensor) -> torch.Tensor:
        """The int32 expert-id column of a buffer of slots, as a writable view [N]."""
        return buf[:, self.id_at:self.id_at + ID_BYTES].view(torch.int32)[:, 0]


def pack(send: torch.Tensor, slot: torch.Tensor, payload: Payload, token: torch.Tensor,
         local_ids: torch.Tensor, layout: SlotLayout) -> None:
    """Writes pair i (token ``token[i]`` of the payload, expert ``local_ids[i]``) into slot
    ``slot[i]`` of ``send`` (uint8 [N, layout.row]); other slots are left as they are."""
    send[slot, :layout.data] = as_bytes(payload.rows, layout.data)[token]
    if payload.row_scale is not None:
        send[slot, layout.scale_at:layout.scale_at + layout.scale] = as_bytes(payload.row_scale, layout.scale)[token]
    layout.ids(send)[slot] = local_ids.to(torch.int32)


def unpack(recv: torch.Tensor, payload: Payload, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                               torch.Tensor]:
    """Views of received slots (uint8 [N, layout.row]): (rows [N, Hp] of the payload's wire
    dtype, row scales [N, S] or None, int64 expert ids [N], -1 for unused slots)."""
    rows = recv[:, :layout.data].view(payload.rows.dtype)
    scale = None
    if payload.row_scale is not None:
        scale = recv[:, layout.scale_at:layout.scale_at + layout.scale].view(payload.row_scale.dtype)
    return rows, scale, layout.ids(recv).long()


def pair_destinations(ids: torch.Tensor, experts_per_rank: int, own_rank: int,
                      empty_picks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: int64 [N] global expert (slot) ids of N routed pairs -> (dest int64 [N]: the EP rank
    that holds each pair's expert, local int64 [N]: its index there). With ``empty_picks``, a
    pair of id -1 (``Routing.empty_picks``) stays on this rank (``own_rank``, its index in the EP
    group) as a padding row, local id -1: no expert computes it and no bytes cross a link, while
    the backend's bookkeeping (every pair has a row to come back from) stays as it is."""
    dest = torch.div(ids, experts_per_rank, rounding_mode="floor")
    local = ids - dest * experts_per_rank
    if empty_picks:
        empty = ids < 0
        dest = torch.where(empty, own_rank, dest)
        local = torch.where(empty, -1, local)
    return dest, local

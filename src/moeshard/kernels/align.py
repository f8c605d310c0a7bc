"""Tile plan of routed rows: every BLOCK_M-row tile belongs to one expert, built on the device.

Legend: M routed rows, E local experts, BM = BLOCK_M, P = max_tiles * BM padded positions.

    expert_ids [M] --plan kernel (1 program)--> count [E], start [E] (padded, BM-aligned),
                                               tile_expert [max_tiles] (-1 past the last tile)
                   --scatter kernel (M / 1024 programs)--> sorted_rows [P]: row at each position

Expert e's rows occupy positions [start[e], start[e] + count[e]); the padding up to the next
multiple of BM is never read as a row (kernels mask positions p with p - start[e] >= count[e]).
The number of tiles is data dependent, so launches are sized by ``max_tiles``, a bound known on
the host from M and E alone (no device-to-host read, hence CUDA-graph safe); programs of tiles
past the end see tile_expert == -1 and return at once.

Within an expert, rows are placed in the order their atomic increments land, which varies from
run to run; every row is computed independently of its neighbours, so results do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SCATTER_BLOCK = 1024


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(count_e / BM): at most one partial tile per non-empty expert,
    and never more tiles than rows."""
    return min(num_rows, triton.cdiv(num_rows, block_m) + min(num_experts, num_rows))


@dataclass(frozen=True)
class RowAlignment:
    """The tile plan (all int32 on the rows' device).

    sorted_rows: [P] original row index at each padded position (padding: unspecified);
    tile_expert: [max_tiles] expert of each tile, -1 past the last tile;
    start: [E] first position of each expert (multiple of BM); count: [E] rows per expert;
    block_m: BM; num_rows: M.
    """

    sorted_rows: torch.Tensor
    tile_expert: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor
    block_m: int
    num_rows: int

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.shape[0]

    @property
    def padded_rows(self) -> int:
        return self.sorted_rows.shape[0]


# M and num_tiles change with every batch; one compiled variant serves all of them.
@triton.jit(do_not_specialize=["M", "num_tiles"])
def _plan_kernel(ids_ptr, M, E, num_tiles,
                 count_ptr, start_ptr, cursor_ptr, tile_expert_ptr, amax_ptr,
                 BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr,
                 TILE_CHUNK: tl.constexpr, ZERO_AMAX: tl.constexpr):
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for m0 in range(0, M, CHUNK):
        offs = m0 + tl.arange(0, CHUNK)
        # Masked lanes land in bin E, which is past the experts and ignored (NUM_BINS > E).
        ids = tl.load(ids_ptr + offs, mask=offs < M, other=E).to(tl.int32)
        counts += tl.histogram(ids, NUM_BINS)
    in_range = bins < E
    counts = tl.where(in_range, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(count_ptr + bins, counts, mask=in_range)
    tl.store(start_ptr + bins, starts, mask=in_range)
    tl.store(cursor_ptr + bins, tl.zeros([NUM_BINS], dtype=tl.int32), mask=in_range)
    if ZERO_AMAX:
        tl.store(amax_ptr + bins, tl.zeros([NUM_BINS], dtype=tl.float32), mask=in_range)
    total = tl.sum(padded, 0)
    for t0 in range(0, num_tiles, TILE_CHUNK):
        t = t0 + tl.arange(0, TILE_CHUNK)
        pos = t * BLOCK_M
        # The tile's expert is the number of experts whose padded range ends at or before it.
        before = (ends[None, :] <= pos[:, None]) & in_range[None, :]
        expert = tl.sum(before.to(tl.int32), axis=1)
        expert = tl.where(pos < total, expert, -1)
        tl.store(tile_expert_ptr + t, expert, mask=t < num_tiles)


@triton.jit(do_not_specialize=["M"])
def _scatter_kernel(ids_ptr, M, start_ptr, cursor_ptr, sorted_rows_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    slot = tl.atomic_add(cursor_ptr + expert, 1, mask=mask, sem="relaxed")
    start = tl.load(start_ptr + expert, mask=mask, other=0)
    tl.store(sorted_rows_ptr + start + slot, offs, mask=mask)


def align_rows(expert_ids: torch.Tensor, num_experts: int, block_m: int,
               amax: torch.Tensor | None = None) -> RowAlignment:
    """The tile plan of ``expert_ids`` (int64 or int32 [M], values in [0, num_experts), M > 0).

    amax: optional fp32 [num_experts] buffer that the plan kernel zeroes on the way (the gate_up
    GEMM then max-reduces each expert's |h| into it), saving a separate memset launch.
    """
    M, E = expert_ids.shape[0], num_experts
    device = expert_ids.device
    tiles = max_tiles(M, E, block_m)
    count = torch.empty(E, dtype=torch.int32, device=device)
    start = torch.empty(E, dtype=torch.int32, device=device)
    cursor = torch.empty(E, dtype=torch.int32, device=device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=device)
    sorted_rows = torch.empty(tiles * block_m, dtype=torch.int32, device=device)
    num_bins = triton.next_power_of_2(E + 1)
    # Keep the [TILE_CHUNK, NUM_BINS] comparison within ~8K elements of registers.
    tile_chunk = max(16, min(1024, 8192 // num_bins))
    _plan_kernel[(1,)](expert_ids, M, E, tiles, count, start, cursor, tile_expert,
                       amax if amax is not None else count,
                       BLOCK_M=block_m, NUM_BINS=num_bins, CHUNK=1024, TILE_CHUNK=tile_chunk,
                       ZERO_AMAX=amax is not None, num_warps=4)
    _scatter_kernel[(triton.cdiv(M, SCATTER_BLOCK),)](expert_ids, M, start, cursor, sorted_rows,
                                                      BLOCK=SCATTER_BLOCK, num_warps=4)
    return RowAlignment(sorted_rows, tile_expert, start, count, block_m, M)

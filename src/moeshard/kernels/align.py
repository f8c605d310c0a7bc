"""Tile plan of routed rows: every BLOCK_M-row tile belongs to one expert, built on the device.

Legend: M routed rows, E local experts, BM = BLOCK_M, P = max_tiles * BM padded positions,
G histogram programs (G <= HIST_PROGRAMS, each counting a contiguous chunk of the ids).

    expert_ids [M] --histogram kernel (G programs)--> partial counts [G, E], one row per chunk
                   --plan kernel (1 program)--> count [E], start [E] (padded, BM-aligned),
                                               base [G, E]: where chunk g's first row of expert e goes
                                               (and amax [E] = 0 on request)
                   --scatter kernel (max(M / 128, E) programs)--> sorted_rows [P]: row at each
                                               position, tile_expert [max_tiles] (-1 past the last tile)
                                               (and row_amax [P] = 0 on request)
    (split_tiles, for a GEMM of shorter tiles over the same positions:)
    tile_expert, start, count --split kernel (max_tiles * ratio / 1024 programs)--> tile_expert
                                               [max_tiles * ratio] of the shorter tiles (-1 where empty)

Expert e's rows occupy positions [start[e], start[e] + count[e]); the padding up to the next
multiple of BM is never read as a row (kernels mask positions p with p - start[e] >= count[e]).
The number of tiles is data dependent, so launches are sized by ``max_tiles``, a bound known on
the host from M and E alone (no device-to-host read, hence CUDA-graph safe); programs of tiles
past the end see tile_expert == -1 and return at once. Every launch size here, G included, is a
function of M and E only. Partial counts are written, not accumulated, so no buffer needs zeroing
before the plan; the one-program plan kernel only sums G rows of E counts.

Within an expert, rows keep their input order. A scatter program places RANK_BLOCK rows of
chunk g: expert e's from base[g, e] plus the count of e's rows earlier in the chunk (a histogram
of at most one chunk of ids), each after the earlier rows of its expert in the block (a rank from
a [RANK_BLOCK, RANK_BLOCK] comparison of the ids). No atomics: a per-expert counter that every
row increments serialises on the counters (28 us for 131072 rows over 128 experts on an H200) and
places rows in the order the increments land, which varies from run to run.

At most ``ONE_PROGRAM_ROWS`` rows (decode: a few tokens times top-k) the plan is one launch of
one program instead of three: it holds every id, counts them, ranks each row among the earlier
rows of its expert (so rows keep their input order within an expert) and finds every tile's
expert from the experts' tile ends, all in registers. A decode step waits for the plan before its
first GEMM, and each launch costs it a few microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeshard.kernels import pdl

TILE_FILL_BLOCK = 1024  # tiles (and positions) per store of the scatter kernel's fills
RANK_BLOCK = 128  # ids per scatter program, ranked by [RANK_BLOCK, RANK_BLOCK] comparisons
HIST_CHUNK = 1024  # ids per tl.histogram call
HIST_PROGRAMS = 128  # at most this many histogram programs (about one per SM on an H100 / H200)
# Up to this many rows the plan is one program (``_small_plan_kernel``): its [rows, rows] rank
# comparison and [tiles, experts] tile search stay a few thousand elements per warp. Both plans
# side by side on one H200 (scripts/plan_study.py, alternating rounds): the one program is faster
# up to 64 rows over 8, 128 or 256 experts (at 64 rows 5.9-9.4 us against 10.0-10.4 us), slower at
# 128 rows over 128 and 256 experts (12.7 and 14.9 us against 10.8 and 11.8 us).
ONE_PROGRAM_ROWS = 64


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

    direct (``direct_rows``): tile t holds routed row t alone, at position t * BM, and its expert
    is tile_expert[t], the routed rows' expert ids themselves (int32 or int64 [M]; -1: a padding
    row, computed nowhere). sorted_rows, start and count are then never read: start and count
    are unfilled [E] buffers (E is their length), sorted_rows the ids again.
    """

    sorted_rows: torch.Tensor
    tile_expert: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor
    block_m: int
    num_rows: int
    direct: bool = False

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.shape[0]

    @property
    def padded_rows(self) -> int:
        return self.num_rows * self.block_m if self.direct else self.sorted_rows.shape[0]


@triton.jit
def _expert_counts(ids, NUM_BINS: tl.constexpr):
    """[NUM_BINS] int32: how many of ids (int32, -1 for padding rows and masked lanes) equal each
    bin. The -1 ids are counted as expert 0 and taken off bin 0, so bins need not exceed E (a
    spare bin would double NUM_BINS at E = 256) and the histogram needs no mask."""
    real = ids >= 0
    counts = tl.histogram(tl.where(real, ids, 0), NUM_BINS)
    return tl.where(tl.arange(0, NUM_BINS) == 0, counts - tl.sum((~real).to(tl.int32)), counts)


@triton.jit(do_not_specialize=["M", "per_program"])
def _histogram_kernel(ids_ptr, M, E, per_program, partial_ptr,
                      NUM_BINS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """partial_ptr[pid, e] (int32 [G, E]) = how many of ids[pid * per_program, ...) (a chunk of
    ``per_program`` ids, fewer in the last) equal e; padding ids (-1) count nowhere."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    bins = tl.arange(0, NUM_BINS)
    lo = pid * per_program
    counts = ids_counts(ids_ptr, lo, tl.minimum(lo + per_program, M), NUM_BINS, CHUNK)
    tl.store(partial_ptr + pid * E + bins, counts, mask=bins < E)


@triton.jit
def ids_counts(ids_ptr, lo, hi, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr):
    """[NUM_BINS] int32: how many of ids[lo, hi) equal each bin, CHUNK ids at a time; padding
    ids (-1) count nowhere."""
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for m0 in range(lo, hi, CHUNK):
        offs = m0 + tl.arange(0, CHUNK)
        counts += _expert_counts(tl.load(ids_ptr + offs, mask=offs < hi, other=-1).to(tl.int32), NUM_BINS)
    return counts


@triton.jit
def sum_partial_counts(partial_ptr, num_parts, E, NUM_BINS: tl.constexpr, PART_BLOCK: tl.constexpr,
                       WIDE: tl.constexpr):
    """[NUM_BINS] column sums of the [num_parts, E] int32 partial counts (the histogram kernel's),
    in int64 when WIDE else int32, zero past E; read a [PART_BLOCK, NUM_BINS] tile at a time."""
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros([NUM_BINS], dtype=tl.int64 if WIDE else tl.int32)
    for g0 in range(0, num_parts, PART_BLOCK):
        g = g0 + tl.arange(0, PART_BLOCK)
        part = tl.load(partial_ptr + g[:, None] * E + bins[None, :],
                       mask=(g < num_parts)[:, None] & (bins < E)[None, :], other=0)
        counts += tl.sum(part.to(tl.int64) if WIDE else part, axis=0)
    return counts


@triton.jit(do_not_specialize=["num_parts"])
def _plan_kernel(partial_ptr, num_parts, E, count_ptr, start_ptr, base_ptr, amax_ptr,
                 BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, PART_BLOCK: tl.constexpr,
                 ZERO_AMAX: tl.constexpr, PDL: tl.constexpr):
    """count = sum of the [num_parts, E] partial counts; start = exclusive prefix sum of the counts
    rounded up to BLOCK_M; base [num_parts, E] = start + the exclusive prefix sum of the partial
    counts over the parts (where each chunk's first row of each expert goes); amax = 0 when
    ZERO_AMAX."""
    pdl.enter(PDL)
    bins = tl.arange(0, NUM_BINS)
    in_range = bins < E
    counts = sum_partial_counts(partial_ptr, num_parts, E, NUM_BINS, PART_BLOCK, False)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, 0) - padded
    tl.store(count_ptr + bins, counts, mask=in_range)
    tl.store(start_ptr + bins, starts, mask=in_range)
    if num_parts == 1:  # one chunk (up to HIST_CHUNK ids: decode): its base is the starts
        tl.store(base_ptr + bins, starts, mask=in_range)
    else:
        running = starts
        for g0 in range(0, num_parts, PART_BLOCK):
            g = g0 + tl.arange(0, PART_BLOCK)
            ok = (g < num_parts)[:, None] & in_range[None, :]
            part = tl.load(partial_ptr + g[:, None] * E + bins[None, :], mask=ok, other=0)
            tl.store(base_ptr + g[:, None] * E + bins[None, :], running[None, :] + tl.cumsum(part, 0) - part,
                     mask=ok)
            running += tl.sum(part, axis=0)
    if ZERO_AMAX:
        tl.store(amax_ptr + bins, tl.zeros([NUM_BINS], dtype=tl.float32), mask=in_range)


@triton.jit
def _zero_positions(row_amax_ptr, lo, hi, BLOCK: tl.constexpr):
    """row_amax[lo:hi] = 0 (fp32), BLOCK positions per store."""
    for p0 in range(lo, hi, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        tl.store(row_amax_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < hi)


# M, per_program, num_tiles and the fills' spans change with every batch; one compiled variant
# serves all of them.
@triton.jit(do_not_specialize=["M", "per_program", "num_tiles", "fill_span", "zero_span"])
def _scatter_kernel(ids_ptr, M, E, per_program, num_tiles, start_ptr, count_ptr, base_ptr,
                    sorted_rows_ptr, tile_expert_ptr, row_amax_ptr, fill_span, zero_span,
                    NUM_BINS: tl.constexpr, RANK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                    TILE_BLOCK: tl.constexpr, FILL_BLOCK: tl.constexpr, ZERO_ROWS: tl.constexpr, PDL: tl.constexpr):
    """Program pid places rows [pid * RANK, +RANK) (RANK divides per_program, the histogram's
    chunk of ids) in input order within each expert: from base[g, e] (g its chunk), after the
    rows of expert e earlier in the chunk; program pid < E writes expert pid's tiles into
    tile_expert; every program writes -1 into the tiles of [pid * fill_span, +fill_span) past the
    last expert's. ZERO_ROWS: it also zeroes row_amax at positions [pid * zero_span, +zero_span)
    of the num_tiles * BLOCK_M. ``align_rows`` sizes the grid (max(M / RANK, E) programs) and the
    spans so that every row, expert, tile and position is covered."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    if ZERO_ROWS:
        _zero_positions(row_amax_ptr, pid * zero_span, tl.minimum((pid + 1) * zero_span, num_tiles * BLOCK_M),
                        FILL_BLOCK)
    lo = pid * RANK
    if lo < M:
        bins = tl.arange(0, NUM_BINS)
        chunk = lo // per_program
        cursor = tl.load(base_ptr + chunk * E + bins, mask=bins < E, other=0)
        # The rows of the chunk before this block, counted as the histogram kernel counts them.
        for c0 in range(chunk * per_program, lo, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            cursor += _expert_counts(tl.load(ids_ptr + offs, mask=offs < lo, other=-1).to(tl.int32), NUM_BINS)
        r = tl.arange(0, RANK)
        offs = lo + r
        ids = tl.load(ids_ptr + offs, mask=offs < M, other=-1).to(tl.int32)
        real = ids >= 0  # in range and not a padding row
        # Row i's slot: how many earlier rows of the block share its expert (padding and masked
        # lanes are -1, which no real row matches).
        earlier = (ids[:, None] == ids[None, :]) & (r[None, :] < r[:, None])
        slot = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_rows_ptr + tl.gather(cursor, tl.where(real, ids, 0), 0) + slot, offs, mask=real)

    # tile_expert from one round of loads per program (a search over the experts' ends per tile
    # would chain log2(E) dependent loads, which a decode step waits for).
    if pid < E:
        first = tl.load(start_ptr + pid) // BLOCK_M
        n = (tl.load(count_ptr + pid) + BLOCK_M - 1) // BLOCK_M
        for t0 in range(0, n, TILE_BLOCK):
            t = t0 + tl.arange(0, TILE_BLOCK)
            tl.store(tile_expert_ptr + first + t, tl.full([TILE_BLOCK], 0, tl.int32) + pid, mask=t < n)
    t_lo = pid * fill_span
    t_hi = tl.minimum(t_lo + fill_span, num_tiles)
    if t_lo < t_hi:
        used = tl.load(start_ptr + E - 1) // BLOCK_M + (tl.load(count_ptr + E - 1) + BLOCK_M - 1) // BLOCK_M
        for f0 in range(tl.maximum(t_lo, used), t_hi, FILL_BLOCK):
            t = f0 + tl.arange(0, FILL_BLOCK)
            tl.store(tile_expert_ptr + t, tl.full([FILL_BLOCK], -1, tl.int32), mask=t < t_hi)


@triton.jit(do_not_specialize=["M", "num_tiles"])
def _small_plan_kernel(ids_ptr, M, E, num_tiles, count_ptr, start_ptr, sorted_rows_ptr, tile_expert_ptr, amax_ptr,
                       row_amax_ptr, BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, ROWS: tl.constexpr,
                       TILES: tl.constexpr, ZERO_AMAX: tl.constexpr, ZERO_ROWS: tl.constexpr, PDL: tl.constexpr):
    """The whole plan in one program for M <= ROWS ids (ROWS, TILES: powers of two >= M and
    num_tiles): count, start, sorted_rows (rows in input order within each expert),
    tile_expert (-1 from the last used tile to num_tiles), amax = 0 when ZERO_AMAX and
    row_amax [num_tiles * BLOCK_M] = 0 when ZERO_ROWS."""
    pdl.enter(PDL)
    if ZERO_ROWS:
        _zero_positions(row_amax_ptr, 0, num_tiles * BLOCK_M, 1024)
    bins = tl.arange(0, NUM_BINS)
    in_range = bins < E
    offs = tl.arange(0, ROWS)
    ids = tl.load(ids_ptr + offs, mask=offs < M, other=-1).to(tl.int32)
    counts = _expert_counts(ids, NUM_BINS)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(count_ptr + bins, counts, mask=in_range)
    tl.store(start_ptr + bins, starts, mask=in_range)
    if ZERO_AMAX:
        tl.store(amax_ptr + bins, tl.zeros([NUM_BINS], dtype=tl.float32), mask=in_range)
    # Row i's position: its expert's start plus how many earlier rows share its expert.
    earlier = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])
    slot = tl.sum(earlier.to(tl.int32), axis=1)
    start = tl.sum(tl.where(ids[:, None] == bins[None, :], starts[None, :], 0), axis=1)
    tl.store(sorted_rows_ptr + start + slot, offs, mask=ids >= 0)
    # Tile t belongs to the first expert whose tiles end after it (empty experts end where the
    # previous one does, so they are passed over); tiles from the last used one on are -1.
    t = tl.arange(0, TILES)
    end_tile = tl.where(in_range, ends // BLOCK_M, 2147483647)
    expert = tl.sum((end_tile[None, :] <= t[:, None]).to(tl.int32), axis=1)
    used = tl.sum(tl.where(in_range, padded, 0)) // BLOCK_M
    tl.store(tile_expert_ptr + t, tl.where(t < used, expert, -1), mask=t < num_tiles)


def align_rows(expert_ids: torch.Tensor, num_experts: int, block_m: int,
               amax: torch.Tensor | None = None, pdl_launch: bool = False,
               row_amax: torch.Tensor | None = None) -> RowAlignment:
    """The tile plan of ``expert_ids`` (int64 or int32 [M], values in [0, num_experts) or -1 for a
    padding row, which is placed nowhere; M > 0).

    amax: optional fp32 [num_experts] buffer that the plan kernel zeroes on the way (the gate_up
    GEMM then max-reduces each expert's |h| into it), saving a separate memset launch.
    row_amax: optional fp32 [P] buffer, P = ``max_tiles(M, num_experts, block_m) * block_m``, that
    the plan zeroes on the way (the gate_up GEMM then max-reduces each position's |h| into it).
    Three launches (histogram, plan, scatter), all sized from M and E on the host; one for at
    most ``ONE_PROGRAM_ROWS`` ids. pdl_launch: launched with programmatic dependent launch
    (``moeshard.kernels.pdl``; the caller checks ``pdl.supported``).
    """
    # The kernels index ids as a dense vector: a strided view (a top-1 router's ids are column 0
    # of [T, E] sorted indices) would be read at the wrong rows.
    expert_ids = expert_ids.contiguous()
    M, E = expert_ids.shape[0], num_experts
    device = expert_ids.device
    tiles = max_tiles(M, E, block_m)
    for name, buf, size in (("amax", amax, E), ("row_amax", row_amax, tiles * block_m)):
        if buf is not None and (buf.dtype != torch.float32 or tuple(buf.shape) != (size,) or buf.stride(0) != 1
                                or buf.device != device):
            raise ValueError(f"align_rows: {name} must be a contiguous float32 [{size}] buffer on {device}, got "
                             f"{buf.dtype} {list(buf.shape)} with strides {buf.stride()} on {buf.device}")
    count = torch.empty(E, dtype=torch.int32, device=device)
    start = torch.empty(E, dtype=torch.int32, device=device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=device)
    sorted_rows = torch.empty(tiles * block_m, dtype=torch.int32, device=device)
    num_bins = max(32, triton.next_power_of_2(E))
    if M <= ONE_PROGRAM_ROWS:
        _small_plan_kernel[(1,)](expert_ids, M, E, tiles, count, start, sorted_rows, tile_expert,
                                 amax if amax is not None else count, row_amax if row_amax is not None else count,
                                 BLOCK_M=block_m, NUM_BINS=num_bins,
                                 ROWS=max(16, triton.next_power_of_2(M)), TILES=max(16, triton.next_power_of_2(tiles)),
                                 ZERO_AMAX=amax is not None, ZERO_ROWS=row_amax is not None, PDL=pdl_launch,
                                 num_warps=4, **pdl.launch_options(pdl_launch))
        return RowAlignment(sorted_rows, tile_expert, start, count, block_m, M)
    per_program, parts = histogram_split(M)
    partial = partial_counts(expert_ids, E, pdl_launch)
    base = torch.empty(parts, E, dtype=torch.int32, device=device)
    # Sum the partial counts a [PART_BLOCK, NUM_BINS] tile (~8K elements) at a time.
    _plan_kernel[(1,)](partial, parts, E, count, start, base, amax if amax is not None else count,
                       BLOCK_M=block_m, NUM_BINS=num_bins, PART_BLOCK=max(1, 8192 // num_bins),
                       ZERO_AMAX=amax is not None, PDL=pdl_launch, num_warps=4, **pdl.launch_options(pdl_launch))
    # One program per RANK_BLOCK rows and per expert (see _scatter_kernel); the tiles' -1 fill and
    # the positions' zeroing are spread evenly over the programs.
    programs = max(triton.cdiv(M, RANK_BLOCK), E)
    _scatter_kernel[(programs,)](expert_ids, M, E, per_program, tiles, start, count, base, sorted_rows,
                                 tile_expert, row_amax if row_amax is not None else count,
                                 triton.cdiv(tiles, programs), triton.cdiv(tiles * block_m, programs),
                                 NUM_BINS=num_bins, RANK=RANK_BLOCK, CHUNK=HIST_CHUNK, BLOCK_M=block_m, TILE_BLOCK=128,
                                 FILL_BLOCK=TILE_FILL_BLOCK, ZERO_ROWS=row_amax is not None, PDL=pdl_launch,
                                 num_warps=4, **pdl.launch_options(pdl_launch))
    return RowAlignment(sorted_rows, tile_expert, start, count, block_m, M)


def direct_rows(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> RowAlignment:
    """The direct plan of ``expert_ids`` (int64 or int32 [M], values in [0, num_experts) or -1):
    one tile of ``block_m`` positions per routed row, in input order (``RowAlignment.direct``).
    No kernel runs, so the experts' first GEMM waits on nothing but the ids. An expert chosen by
    two rows has its weights read once per row, so the experts take it for one token's rows
    (``TritonExperts``), which top-k routing gives distinct experts. The buffers that
    ``align_rows`` would zero (amax, row maxima) are the caller's to zero."""
    expert_ids = expert_ids.contiguous()
    if expert_ids.dim() != 1 or expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"direct_rows: expert_ids must be int32 or int64 [M], got {expert_ids.dtype} "
                         f"{list(expert_ids.shape)}")
    unread = torch.empty(num_experts, dtype=torch.int32, device=expert_ids.device)  # start and count: E only
    return RowAlignment(expert_ids, expert_ids, unread, unread, block_m, expert_ids.shape[0], direct=True)


def histogram_split(M: int) -> tuple[int, int]:
    """(per_program, G): how the histogram kernel splits M > 0 ids over its programs: G programs
    of per_program ids each (a multiple of HIST_CHUNK; fewer in the last), at most HIST_PROGRAMS."""
    chunks = triton.cdiv(M, HIST_CHUNK)
    per_program = triton.cdiv(chunks, min(chunks, HIST_PROGRAMS)) * HIST_CHUNK
    return per_program, triton.cdiv(M, per_program)


def partial_counts(ids: torch.Tensor, num_bins: int, pdl_launch: bool = False) -> torch.Tensor:
    """int32 [G, num_bins]: the histogram kernel's counts of contiguous ``ids`` (int32 or int64
    [M], M > 0, values in [0, num_bins) or -1), one row per program. G programs of per_program
    ids each (a multiple of HIST_CHUNK), at most HIST_PROGRAMS, so that the one-program plan
    kernel has at most HIST_PROGRAMS rows of partial counts to sum. pdl_launch: as ``align_rows``."""
    M = ids.shape[0]
    per_program, parts = histogram_split(M)
    partial = torch.empty(parts, num_bins, dtype=torch.int32, device=ids.device)
    _histogram_kernel[(parts,)](ids, M, num_bins, per_program, partial,
                                NUM_BINS=max(32, triton.next_power_of_2(num_bins)), CHUNK=HIST_CHUNK, PDL=pdl_launch,
                                num_warps=4, **pdl.launch_options(pdl_launch))
    return partial


@triton.jit(do_not_specialize=["num_tiles"])
def _split_kernel(parent_ptr, start_ptr, count_ptr, tile_expert_ptr, num_tiles,
                  RATIO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """tile_expert[t] (int32 [num_tiles], tiles of BLOCK_M rows) = parent_ptr[t // RATIO], the
    expert of the plan's tile holding it, where that expert has a row at or after the tile's
    first position, else -1; tiles [pid * BLOCK, +BLOCK)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < num_tiles
    parent = tl.load(parent_ptr + t // RATIO, mask=ok, other=-1)
    has = parent >= 0
    expert = tl.where(has, parent, 0)
    start = tl.load(start_ptr + expert, mask=has, other=0)
    count = tl.load(count_ptr + expert, mask=has, other=0)
    live = has & (t * BLOCK_M - start < count)
    tl.store(tile_expert_ptr + t, tl.where(live, parent, -1), mask=ok)


def split_tiles(plan: RowAlignment, block_m: int) -> RowAlignment:
    """The same plan seen as tiles of ``block_m`` rows (a divisor of ``plan.block_m``): positions,
    starts and counts are unchanged (a multiple of plan.block_m is one of block_m), each tile
    becomes ``plan.block_m // block_m`` tiles of its expert, and those holding no row of it are
    marked -1, so no program computes them. Lets the down GEMM run shorter tiles than gate_up
    over one plan (less padding computed when experts hold few rows). One launch, sized from
    the plan's shapes (graph-safe)."""
    if block_m == plan.block_m:
        return plan
    if plan.direct:
        raise ValueError(f"split_tiles: a direct plan (one row per tile) has no shorter tiles; block_m={block_m} "
                         f"differs from its block_m={plan.block_m}")
    if not isinstance(block_m, int) or block_m < 1 or plan.block_m % block_m:
        raise ValueError(f"split_tiles: block_m={block_m!r} must divide the plan's block_m={plan.block_m}")
    ratio = plan.block_m // block_m
    tiles = plan.max_tiles * ratio
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=plan.tile_expert.device)
    _split_kernel[(triton.cdiv(tiles, TILE_FILL_BLOCK),)](plan.tile_expert, plan.start, plan.count, tile_expert, tiles,
                                                           RATIO=ratio, BLOCK_M=block_m, BLOCK=TILE_FILL_BLOCK,
                                                           num_warps=4)
    return RowAlignment(plan.sorted_rows, tile_expert, plan.start, plan.count, block_m, plan.num_rows)

"""The expert load counter's record pass on CUDA (``moeshard.eplb.loads.LoadCounter.record``), in one launch.

    ids [M] --G programs, each counting a contiguous chunk (the tile plan's split, ``align.histogram_split``),
        adding its counts into pending[:E]--> the last program to arrive: ring[step % window] = pending[:E]
        (int64), step += 1, pending zeroed for the next call --> ring, step

One program (up to ``align.HIST_CHUNK`` ids, and no ids at all) writes the row from its own
counts. Otherwise each program adds its counts into ``pending`` (int32 [E + 1], zero between
calls) with integer atomics, then counts itself in on pending[E] with an acquire-release atomic;
the program that arrives last reads the E sums (from L2: L1 is not coherent across
multiprocessors), writes the ring row and zeroes ``pending``. Integer sums do not depend on the
order the programs add in, so the row is the same every run.

No host sync, so a forward that records stays CUDA-graph capturable. The same work in torch ops
(a sum of the partial counts, ``remainder``, ``index_copy_``, ``add_``) took five launches: about
14 us of the Qwen3-30B-A3B fp8 layer's 0.6 ms at 4096 tokens on one H200
(``scripts/layer_profile.py``); a histogram kernel and a one-program kernel summing its partial
counts took two (docs/performance.md, "The load counter in one launch").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.kernels.align import HIST_CHUNK, histogram_split, ids_counts


@triton.jit
def _write_row(counts, E, ring_ptr, step_ptr, window, NUM_BINS: tl.constexpr):
    """ring[step % window, :E] = counts (int64 [NUM_BINS]); step += 1."""
    bins = tl.arange(0, NUM_BINS)
    step = tl.load(step_ptr)
    tl.store(ring_ptr + (step % window) * E + bins, counts, mask=bins < E)
    tl.store(step_ptr, step + 1)


@triton.jit(do_not_specialize=["M", "per_program", "num_parts"])
def _record_kernel(ids_ptr, M, E, per_program, num_parts, pending_ptr, ring_ptr, step_ptr, window,
                   NUM_BINS: tl.constexpr, CHUNK: tl.constexpr):
    """Program pid counts ids[pid * per_program, ...) (padding ids, -1, nowhere). With one
    program (num_parts == 1) it writes the ring row itself; otherwise it adds its counts into
    pending[:E] and the last of the num_parts programs to arrive (pending[E]) writes their sum."""
    pid = tl.program_id(0)
    bins = tl.arange(0, NUM_BINS)
    lo = pid * per_program
    counts = ids_counts(ids_ptr, lo, tl.minimum(lo + per_program, M), NUM_BINS, CHUNK)
    if num_parts == 1:
        _write_row(counts.to(tl.int64), E, ring_ptr, step_ptr, window, NUM_BINS)
    else:
        tl.atomic_add(pending_ptr + bins, counts, mask=bins < E, sem="relaxed")
        tl.debug_barrier()  # every thread's additions issued before the release below
        if tl.atomic_add(pending_ptr + E, 1, sem="acq_rel") == num_parts - 1:
            total = tl.load(pending_ptr + bins, mask=bins < E, other=0, cache_modifier=".cg")
            _write_row(total.to(tl.int64), E, ring_ptr, step_ptr, window, NUM_BINS)
            tl.store(pending_ptr + bins, tl.zeros([NUM_BINS], dtype=tl.int32), mask=bins < E)
            tl.store(pending_ptr + E, 0)


def record_counts(ids: torch.Tensor, ring: torch.Tensor, step: torch.Tensor, pending: torch.Tensor) -> None:
    """Counts ``ids`` (int32 or int64 [M], M >= 0, values in [0, E) or -1, counted nowhere)
    into row ``step % window`` of ``ring`` (int64 [window, E], contiguous; the row is
    overwritten) and adds 1 to ``step`` (int64 [1]); all on ids' device, in place, in one
    launch. pending: int32 [E + 1], zero: the programs' running counts and arrivals (zero again
    afterwards); one per ring, never shared by calls that may run at once."""
    if ring.dtype != torch.int64 or ring.dim() != 2 or not ring.is_contiguous():
        raise ValueError(f"record_counts: ring must be contiguous int64 [window, E], got {ring.dtype} "
                         f"{list(ring.shape)}")
    if step.dtype != torch.int64 or step.numel() != 1:
        raise ValueError(f"record_counts: step must be int64 [1], got {step.dtype} {list(step.shape)}")
    window, E = ring.shape
    if pending.dtype != torch.int32 or pending.shape != (E + 1,):
        raise ValueError(f"record_counts: pending must be int32 [E + 1 = {E + 1}], got {pending.dtype} "
                         f"{list(pending.shape)}")
    ids = ids.contiguous()
    M = ids.shape[0]
    per_program, parts = histogram_split(M) if M else (HIST_CHUNK, 1)
    _record_kernel[(parts,)](ids, M, E, per_program, parts, pending, ring, step, window,
                             NUM_BINS=max(32, triton.next_power_of_2(E)), CHUNK=HIST_CHUNK, num_warps=4)

"""The expert load counter's record pass on CUDA (``moeshard.eplb.loads.LoadCounter.record``).

    ids [M] --histogram kernel (the tile plan's, ``align.partial_counts``)--> partial int32 [G, E]
        --one program: sum in int64, store into ring[step % window], step += 1--> ring, step

Two launches and no host sync, so a forward that records stays CUDA-graph capturable. The same
work in torch ops (a sum of the partial counts, ``remainder``, ``index_copy_``, ``add_``) took
five launches: about 14 us of the Qwen3-30B-A3B fp8 layer's 0.6 ms at 4096 tokens on one H200
(``scripts/layer_profile.py``), where the histogram itself took 4 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.kernels.align import partial_counts, sum_partial_counts


@triton.jit(do_not_specialize=["num_parts"])
def _ring_kernel(partial_ptr, num_parts, E, ring_ptr, step_ptr, window,
                 NUM_BINS: tl.constexpr, PART_BLOCK: tl.constexpr):
    """ring[step % window, :E] = the int64 sum of the [num_parts, E] partial counts (zeros for
    num_parts = 0); step += 1."""
    bins = tl.arange(0, NUM_BINS)
    counts = sum_partial_counts(partial_ptr, num_parts, E, NUM_BINS, PART_BLOCK, True)
    step = tl.load(step_ptr)
    row = step % window
    tl.store(ring_ptr + row * E + bins, counts, mask=bins < E)
    tl.store(step_ptr, step + 1)


def record_counts(ids: torch.Tensor, ring: torch.Tensor, step: torch.Tensor) -> None:
    """Counts ``ids`` (int32 or int64 [M], M >= 0, values in [0, E) or -1, counted nowhere)
    into row ``step % window`` of ``ring`` (int64 [window, E], contiguous; the row is
    overwritten) and adds 1 to ``step`` (int64 [1]); all on ids' device, in place."""
    if ring.dtype != torch.int64 or ring.dim() != 2 or not ring.is_contiguous():
        raise ValueError(f"record_counts: ring must be contiguous int64 [window, E], got {ring.dtype} "
                         f"{list(ring.shape)}")
    if step.dtype != torch.int64 or step.numel() != 1:
        raise ValueError(f"record_counts: step must be int64 [1], got {step.dtype} {list(step.shape)}")
    window, E = ring.shape
    ids = ids.contiguous()
    partial = partial_counts(ids, E) if ids.shape[0] else ring  # no parts: the kernel reads nothing
    num_bins = max(32, triton.next_power_of_2(E))
    _ring_kernel[(1,)](partial, partial.shape[0] if ids.shape[0] else 0, E, ring, step, window,
                       NUM_BINS=num_bins, PART_BLOCK=max(1, 8192 // num_bins), num_warps=4)

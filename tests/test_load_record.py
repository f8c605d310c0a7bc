"""The expert load counter's record pass on CUDA (``moeshard.kernels.loads``), through Triton's
CPU interpreter: the histogram over one and several programs, -1 ids counted nowhere, the row
``step % window`` overwritten (older rows kept), the step advanced, the programs' running
counts and arrivals zero again after every call, zero ids writing a row of zeros; and ``LoadCounter.read`` over it equal
to the scatter-add path's."""

from __future__ import annotations

import pytest
import torch

from moeshard.eplb.loads import LoadCounter


def _ids(M: int, E: int, seed: int) -> torch.Tensor:
    ids = torch.randint(0, E, (M,), generator=torch.Generator().manual_seed(seed))
    ids[::7] = -1
    return ids


@pytest.mark.parametrize("M, E", [(1, 8), (3000, 128), (2049, 300)])
def test_record_counts_writes_the_ring_row(interpreted_kernels, M, E):
    loads = interpreted_kernels.loads
    window = 3
    ring = torch.full((window, E), -5, dtype=torch.int64)
    step = torch.tensor([4], dtype=torch.int64)  # row 1 next
    pending = torch.zeros(E + 1, dtype=torch.int32)
    batches = [_ids(M, E, seed) for seed in range(4)] + [_ids(M, E, 9)[:0]]
    want = ring.clone()
    for i, ids in enumerate(batches):
        loads.record_counts(ids, ring, step, pending)
        want[(4 + i) % window] = torch.bincount(ids[ids >= 0], minlength=E)
        assert torch.equal(ring, want), i
        assert int(step) == 5 + i and not pending.any()
    assert torch.equal(ring[(4 + 4) % window], torch.zeros(E, dtype=torch.int64))  # the empty batch's row


def test_record_counts_refuses_a_ring_it_cannot_write(interpreted_kernels):
    loads = interpreted_kernels.loads
    pending = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"ring must be contiguous int64 \[window, E\], got torch.int32"):
        loads.record_counts(torch.zeros(3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int64), pending)
    with pytest.raises(ValueError, match=r"step must be int64 \[1\], got torch.int64 \[2\]"):
        loads.record_counts(torch.zeros(3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64),
                            torch.zeros(2, dtype=torch.int64), pending)
    with pytest.raises(ValueError, match=r"pending must be int32 \[E \+ 1 = 5\], got torch.int32 \[4\]"):
        loads.record_counts(torch.zeros(3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64),
                            torch.zeros(1, dtype=torch.int64), torch.zeros(4, dtype=torch.int32))


def test_the_counter_reads_the_same_through_either_path(interpreted_kernels):
    """LoadCounter.record's CPU path (scatter-add) and the kernels' ring agree forward by forward,
    ids of -1 (copies that count nowhere) among them."""
    loads = interpreted_kernels.loads
    E, window = 40, 2
    counter = LoadCounter(E, window)
    ring, step = torch.zeros(window, E, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    pending = torch.zeros(E + 1, dtype=torch.int32)
    for seed in range(5):
        ids = torch.randint(-1, E, (33, 2), generator=torch.Generator().manual_seed(seed))
        counter.record(ids)
        loads.record_counts(ids.reshape(-1), ring, step, pending)
        assert torch.equal(counter.read(), ring.sum(dim=0)) and torch.equal(counter.step, step)
    assert int(counter.read().sum()) < 2 * 33 * window  # some copies counted nowhere

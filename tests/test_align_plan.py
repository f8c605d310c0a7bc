"""``align_rows`` with several histogram programs, through Triton's CPU interpreter.

tests/test_kernels.py checks small plans (one histogram program); here the histogram is split
over programs of one or several 1024-id chunks, with a partial last chunk, padding rows, one
expert, more than 256 experts, skewed loads and the ``amax`` zeroing; and the one-program plan of
a few ids (a decode step's), against its definition and the three-kernel plan of the same ids.
Every plan keeps each expert's rows in input order (the interpreter runs programs one after
another, so tests/gpu checks the order where programs run at once). The kernels come from the
``interpreted_kernels`` fixture (tests/conftest.py): run or fail on CPU with triton, skipped with
the reason without triton or with CUDA.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def align(interpreted_kernels):
    """moeshard.kernels.align, interpreted."""
    return interpreted_kernels.align


def _check_plan(align, ids: torch.Tensor, E: int, bm: int, in_order: bool = False):
    """Checks the plan of ``ids`` (padding rows -1 allowed) against its definition and returns it;
    in_order: rows must also keep their input order within each expert."""
    amax = torch.full((E,), 7.0)
    plan = align.align_rows(ids, E, bm, amax=amax)
    assert torch.equal(amax, torch.zeros(E))
    counts = torch.bincount(ids.long()[ids >= 0], minlength=E)
    padded = (counts + bm - 1) // bm * bm
    assert torch.equal(plan.count.long(), counts)
    assert torch.equal(plan.start.long(), torch.cumsum(padded, 0) - padded)
    assert plan.max_tiles == align.max_tiles(ids.shape[0], E, bm) and plan.num_rows == ids.shape[0]
    tiles = plan.tile_expert.tolist()
    for e in range(E):
        s, c = int(plan.start[e]), int(counts[e])
        rows = plan.sorted_rows[s:s + c].long()
        assert torch.equal(rows if in_order else rows.sort().values, (ids.long() == e).nonzero().flatten())
        assert tiles[s // bm:(s + c + bm - 1) // bm] == [e] * ((c + bm - 1) // bm)
    used = int(padded.sum()) // bm
    assert tiles[used:] == [-1] * (len(tiles) - used)
    return plan


def _multi_program_cases():
    """Every shape with 1, 3 and 128 histogram programs; the two largest shapes (3 s each in the
    interpreter on 2 cores) with 1 and 128 programs in `make test-slow`, with 3 in `make test`."""
    for M, E, bm in [(1, 1, 16), (1024, 7, 16), (1025, 7, 16), (5000, 33, 16), (3073, 300, 32), (7000, 256, 128),
                     (2048, 1, 64)]:
        for programs in (1, 3, 128):
            slow = M in (3073, 7000) and programs != 3
            yield pytest.param(programs, M, E, bm, marks=(pytest.mark.slow,) if slow else ())


@pytest.mark.parametrize("hist_programs, M, E, bm", list(_multi_program_cases()))
def test_align_rows_multi_program(align, monkeypatch, hist_programs, M, E, bm):
    monkeypatch.setattr(align, "HIST_PROGRAMS", hist_programs)
    g = torch.Generator().manual_seed(M + E)
    ids = torch.randint(0, E, (M,), generator=g)
    if M > 4:
        ids[[1, M // 2, M - 1]] = -1  # padding rows, in the first, a middle and the last chunk
    _check_plan(align, ids, E, bm, in_order=True)
    skewed = ids.clone()
    skewed[: M // 2] = E - 1  # one expert with many tiles, likely a few experts with none
    skewed[M // 2: M // 2 + M // 8] = 0
    _check_plan(align, skewed.to(torch.int32), E, bm, in_order=True)


# (M, E, BLOCK_M): one id, top-2 of 8 experts, 64 ids over 256 experts (DeepSeek-V3 at 8 tokens),
# 64-row tiles, one expert, and a row count that is not a power of two.
ONE_PROGRAM_CASES = [(1, 8, 16), (2, 8, 16), (8, 128, 16), (64, 256, 16), (64, 8, 64), (5, 1, 16), (37, 5, 32)]


@pytest.mark.parametrize("M, E, bm", ONE_PROGRAM_CASES)
def test_align_rows_one_program(align, monkeypatch, M, E, bm):
    """At most ONE_PROGRAM_ROWS ids take the one-program plan: it must meet the plan's definition
    with padding rows (-1) among the ids, keep each expert's rows in input order, and give the
    three-kernel plan's counts, starts and tiles."""
    assert M <= align.ONE_PROGRAM_ROWS
    g = torch.Generator().manual_seed(M * 7 + E)
    ids = torch.randint(0, E, (M,), generator=g)
    if M > 4:
        ids[[1, M - 1]] = -1
    one = _check_plan(align, ids, E, bm, in_order=True)
    monkeypatch.setattr(align, "ONE_PROGRAM_ROWS", 0)
    three = _check_plan(align, ids, E, bm, in_order=True)
    for name in ("count", "start", "tile_expert"):
        assert torch.equal(getattr(one, name), getattr(three, name)), name
    for e in range(E):  # both keep input order, so the routed positions hold the same rows
        s, c = int(one.start[e]), int(one.count[e])
        assert torch.equal(one.sorted_rows[s:s + c], three.sorted_rows[s:s + c]), e

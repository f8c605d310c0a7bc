"""``scripts/decode_study.py``'s reader, the floor its one-token experts are measured against: every
variant of its sweep reads each element of the buffer exactly once (the checksums add up to the
buffer's sum, wrapping as int32 does), so a fast variant cannot be one that skipped bytes. Run
through Triton's interpreter; the timing itself needs a GPU (the study runs on the GPU machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import decode_study  # noqa: E402


def _wrapped_sum(t: torch.Tensor) -> int:
    """The int32 sum of ``t`` as the kernel's int32 additions give it (modulo 2^32, signed)."""
    total = int(t.to(torch.int64).sum()) % 2**32
    return total - 2**32 if total >= 2**31 else total


@pytest.mark.parametrize("n, programs, block", [
    (100_003, 3, 2048),    # a partial last chunk, a partial last step
    (4096 * 7, 7, 4096),   # whole chunks
    (5, 16, 2048),         # fewer elements than one step: one program
    (65_536, 1, 8192),     # one program, many steps
])
def test_every_element_is_read_once(n, programs, block):
    src = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    call, sums = decode_study.read_stream(src, programs, block)
    call()
    assert 1 <= sums.numel() <= programs
    assert _wrapped_sum(sums) == _wrapped_sum(src)


def test_the_sweep_covers_grids_and_widths():
    per_sm = {p for p, _ in decode_study.READ_SWEEP}
    blocks = {b for _, b in decode_study.READ_SWEEP}
    assert per_sm == {1, 2, 4, 8, 16} and blocks == {2048, 4096, 8192}


def test_a_reader_that_skips_an_element_is_caught():
    """Planted fault: the same launch told the buffer is one element shorter."""
    src = torch.randint(1, 1000, (10_000,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    sums = torch.empty(1, dtype=torch.int32)
    decode_study._read_kernel[(1,)](src, sums, src.numel() - 1, CHUNK=10_240, BLOCK=2048, num_warps=8)
    assert _wrapped_sum(sums) != _wrapped_sum(src)

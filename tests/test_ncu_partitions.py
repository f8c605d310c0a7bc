"""``scripts/ncu_partitions.py``: Nsight Compute's sampled warp time split by the partitions of a
warp-specialized kernel, checked on a hand-written source page (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ncu_partitions import read_kernel, split  # noqa: E402

HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"'
# (address from 0x1000, SASS, samples): the first MMA partition (tile start 5, K loop 30, epilogue
# 15), the loader (40), the second MMA partition (tile start 10, K loop 60, epilogue 30, up to its
# EXIT), then out-of-line retries (10). 200 samples in all.
CODE = [
    (0x000, "USETMAXREG.DEALLOC.CTAPOOL 0x78", 0), (0x010, "LDG.E R2, desc[UR4][R2.64]", 5),
    (0x020, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x34000], R3", 10),
    (0x030, "QGMMA.64x256x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, UP0", 10),
    (0x040, "WARPGROUP.DEPBAR.LE gsb0, 0x1", 5), (0x050, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 5),
    (0x060, "MUFU.EX2 R5, R5", 15), (0x070, "@!P0 EXIT", 0),
    (0x080, "USETMAXREG.DEALLOC.CTAPOOL 0x28", 0), (0x090, "LDGSTS.E.BYPASS.128 [R17], desc[UR14][R2.64]", 25),
    (0x0a0, "UTMALDG.2D [UR8], [UR4]", 15),
    (0x0b0, "USETMAXREG.DEALLOC.CTAPOOL 0xe8", 0), (0x0c0, "LDG.E R2, desc[UR4][R2.64]", 10),
    (0x0d0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x34000], R3", 20),
    (0x0e0, "QGMMA.64x256x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24", 30),
    (0x0f0, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 10), (0x100, "F2FP.BF16.F32.PACK_AB R3, R27, R30", 20),
    (0x110, "STG.E.128 desc[UR4][R2.64], R4", 10), (0x120, "EXIT", 0),
    (0x130, "@!P6 BRA 0x7f00", 10),
]


def page(kernel="persistent_gate_up_kernel", header=HEADER):
    rows = "\n".join(f'"{0x7f0000001000 + a:#x}","{src}","{n}","0"' for a, src, n in CODE)
    return f'"Kernel Name","fill_kernel",\n{HEADER}\n"0x10","MOV R1, R2","99","0"\n' \
           f'"Kernel Name","{kernel}",\n{header}\n{rows}\n'


def test_samples_are_split_by_partition_and_by_the_mma_partitions_phases():
    result = split(read_kernel(page(), "persistent_gate_up_kernel"))
    assert result["total_samples"] == 200  # the other kernel's 99 samples are not counted
    parts = [(p["start"], p["end"], p["kind"], p["samples"]) for p in result["partitions"]]
    assert parts == [(0x0, 0x80, "mma", 25.0), (0x80, 0xb0, "loader", 20.0), (0xb0, 0x130, "mma", 50.0),
                     (0x130, 0x140, "other", 5.0)]
    first, second = result["partitions"][0], result["partitions"][2]
    assert (first["tile_start"], first["k_loop"], first["epilogue"]) == (2.5, 15.0, 7.5)
    assert (second["tile_start"], second["k_loop"], second["epilogue"]) == (5.0, 30.0, 15.0)


def test_a_missing_kernel_or_column_is_named():
    with pytest.raises(ValueError, match="no source table of a kernel named 'persistent_block_down_kernel'"):
        read_kernel(page(), "persistent_block_down_kernel")
    with pytest.raises(ValueError, match="no 'Warp Stall Sampling \\(All Samples\\)' column"):
        read_kernel(page(header='"Address","Source","Samples","Other"'), "persistent_gate_up_kernel")

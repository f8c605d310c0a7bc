"""``scripts/accumulation_contract.py``'s one-token case, on CPU under Triton's interpreter at a
small shape: one token's rows on the direct plan's tiles and as matrix-vector products, each
within the accumulation every fp8 kernel declares ("fp8_mma"), so the script's GPU run compares
kernels, not a wrong reference. (At full sizes it needs a GPU; the interpreter computes both
kernels' sums exactly, so they agree with each other here.)"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# fp8_block's one token takes the GEMVs in the layer; the per-row case runs with the slow tests.
@pytest.mark.parametrize("scheme", [pytest.param("fp8_tensor", marks=pytest.mark.slow), "fp8_block"])
def test_one_token_case_stays_within_the_declared_accumulation(interpreted_kernels, exact_interpreter,
                                                               monkeypatch, scheme):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("accumulation_contract", None)  # imported after the kernels are interpreted
    contract = importlib.import_module("accumulation_contract")
    monkeypatch.setitem(contract.TOKEN_SHAPES, "token-small", (4, 6, 256, 384))
    row = contract.token_case(scheme, "token-small", 0, device="cpu")
    for mode in ("token-tiles", "token-gemv"):
        assert row[f"{mode} declares"] == "fp8_mma", row
        assert row[f"{mode} vs fp8_mma"] <= 1.0, (mode, row)
        # The interpreter sums in fp32 (no tensor cores): within the fp32 contract too.
        assert row[f"{mode} vs fp32"] <= 1.0, (mode, row)

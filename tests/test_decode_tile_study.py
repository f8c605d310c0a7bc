"""``scripts/decode_tile_study.py``'s variants: each keeps the chosen tile height (one tile plan),
replaces only the tiles its name says, and the pairs of both tiles exist at both decode heights.
The timing itself needs a GPU (the study runs on the GPU machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moeshard.kernels.configs import select_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import decode_tile_study  # noqa: E402

# (rows, experts, hidden, intermediate) of the bench's decode cases: Mixtral at 16 and 128 tokens
# (top-2), DeepSeek-V3 at 16 tokens (top-8 of 256 experts).
CASES = {"mixtral-16": (32, 8, 4096, 14336), "mixtral-128": (256, 8, 4096, 14336),
         "deepseek-16": (128, 256, 7168, 2048)}


def chosen(case: str, scheme: str):
    m, e, h, i = CASES[case]
    return select_config(m, e, h, i, scheme, 132, pdl=True, gluon=True)


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_variants_keep_the_tile_height_and_replace_what_their_name_says(case, scheme):
    base = chosen(case, scheme)
    out = decode_tile_study.variants(base)
    assert next(iter(out)) == "chosen" and out["chosen"] == base
    for name, cfg in out.items():
        assert cfg.block_m == base.block_m, name
        if name == "chosen":
            continue
        assert cfg != base, name
        parts = dict((p[0], p[1:]) for p in name.split("+"))
        for key, gemm, before in (("g", cfg.gate_up, base.gate_up), ("d", cfg.down, base.down)):
            if key in parts:
                n, rest = parts[key].split("x")
                k, stages = rest.split("s")
                assert (gemm.block_n, gemm.block_k, gemm.num_stages, gemm.num_warps) == (int(n), int(k), int(stages), 4)
            else:
                assert gemm == before, name


@pytest.mark.parametrize("case", ["mixtral-16", "deepseek-16", "mixtral-128"])
def test_both_decode_heights_have_pairs_of_both_tiles(case):
    """Every pair of the chosen height is a variant, or is the chosen config itself (then it is
    left out: the chosen tiles are timed as "chosen")."""
    base = chosen(case, "fp8_token")
    assert base.block_m == (64 if case == "mixtral-128" else 16)
    out = decode_tile_study.variants(base)
    pairs = decode_tile_study.PAIRS[base.block_m]
    assert len(pairs) >= 2
    for g, d in pairs:
        name = f"g{g[0]}x{g[1]}s{g[2]}+d{d[0]}x{d[1]}s{d[2]}"
        same = decode_tile_study._config(base, decode_tile_study._tile(base.gate_up, g),
                                         decode_tile_study._tile(base.down, d)) == base
        assert (name in out) != same, (name, same)


def test_fp8_block_keeps_h_quantized_in_the_gate_up_only_with_its_128_column_tiles():
    """As select_config does: where the gate_up may quantize h, a 128-column gate_up tile does and
    a narrower one leaves it to the pass, whichever the chosen tiles did."""
    for case in ("mixtral-16", "deepseek-16"):
        base = chosen(case, "fp8_block")
        wide = narrower = 0
        for name, cfg in decode_tile_study.variants(base, gate_up_quantizes_h=True).items():
            if name == "chosen":
                continue
            assert cfg.h_quant == ("gate_up" if cfg.gate_up.block_n == 128 else "pass"), (case, name)
            wide += cfg.gate_up.block_n == 128
            narrower += cfg.gate_up.block_n != 128
        assert wide and narrower, case
    # Without it, a tile that quantized h keeps doing so only at 128 columns.
    base = select_config(2, 8, 4096, 14336, "fp8_block", 132)  # one Mixtral token
    assert base.h_quant == "gate_up" and base.gate_up.block_n == 128
    for name, cfg in decode_tile_study.variants(base).items():
        assert cfg.h_quant == ("gate_up" if cfg.gate_up.block_n == 128 else "pass"), name

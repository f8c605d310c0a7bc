"""``scripts/decode_tile_study.py``'s variants: each keeps the chosen tile height (one tile plan),
replaces only the tiles its name says, and the pairs of both tiles exist at both decode heights.
The timing itself needs a GPU (the study runs on the GPU machine)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from moeshard.kernels.configs import in_down_tile, select_config

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
    out = decode_tile_study.variants(base, scheme, CASES[case][3])
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
    out = decode_tile_study.variants(base, "fp8_token", CASES[case][3])
    pairs = decode_tile_study.PAIRS[base.block_m]
    assert len(pairs) >= 2
    for g, d in pairs:
        name = f"g{g[0]}x{g[1]}s{g[2]}+d{d[0]}x{d[1]}s{d[2]}"
        same = decode_tile_study._config(base, "fp8_token", CASES[case][3], decode_tile_study._tile(base.gate_up, g),
                                         decode_tile_study._tile(base.down, d)) == base
        assert (name in out) != same, (name, same)


def test_h_is_quantized_where_select_config_would_quantize_it_for_the_replaced_tiles():
    """fp8_block over an intermediate size that 128 divides: a 128-column gate_up tile quantizes h
    in its epilogue and a narrower one leaves it to the pass, whichever the chosen tiles did.
    fp8_tensor keeps the pass and fp8_token its row maxima in gate_up, whatever the tiles."""
    for case in ("mixtral-16", "deepseek-16"):
        base = chosen(case, "fp8_block")
        wide = narrower = 0
        for name, cfg in decode_tile_study.variants(base, "fp8_block", CASES[case][3]).items():
            if name == "chosen":
                continue
            assert cfg.h_quant == ("gate_up" if cfg.gate_up.block_n == 128 else "pass"), (case, name)
            wide += cfg.gate_up.block_n == 128
            narrower += cfg.gate_up.block_n != 128
        assert wide and narrower, case
    base = select_config(2, 8, 4096, 14336, "fp8_block", 132)  # one Mixtral token
    assert base.h_quant == "gate_up" and base.gate_up.block_n == 128
    for name, cfg in decode_tile_study.variants(base, "fp8_block", 14336).items():
        assert cfg.h_quant == ("gate_up" if cfg.gate_up.block_n == 128 else "pass"), name
    for scheme, kept in (("fp8_tensor", "pass"), ("fp8_token", "row_max")):
        for case in CASES:
            base = chosen(case, scheme)
            assert base.h_quant == kept, (case, scheme)
            got = {cfg.h_quant for cfg in decode_tile_study.variants(base, scheme, CASES[case][3]).values()}
            assert got == {kept}, (case, scheme, got)


def test_one_token_moves_where_h_is_quantized():
    """At one token (the direct plan) one variant moves h's quantization: to the down GEMM where
    the chosen config leaves it to h_quant (fp8_block), back to h_quant where the chosen config
    has the down GEMM quantize it (fp8_tensor, fp8_token); more tokens' calls get neither."""
    for scheme, name in (("fp8_tensor", "h_by_h_quant"), ("fp8_token", "h_by_h_quant"), ("fp8_block", "h_in_down")):
        base = select_config(2, 8, 4096, 14336, scheme, 132)  # one Mixtral token
        out = decode_tile_study.variants(base, scheme, 14336, one_token=True)
        # (fp8_block's one token runs on the GEMVs: its variant runs the tile GEMMs)
        assert out[name] == dataclasses.replace(base, quantize_in_down=not base.quantize_in_down, gemv=None), scheme
        assert not {"h_in_down", "h_by_h_quant"} & set(decode_tile_study.variants(base, scheme, 14336)), scheme


def test_prefetch_variants_where_the_down_gemm_waits_under_pdl_and_only_filters_them():
    """The down weights can be asked for before the down GEMM's wait only where it is launched
    under PDL. One DeepSeek-V3 token with PDL (the whole chain under PDL) gets a ``prefetch<k>``
    variant per DOWN_PREFETCH, each the chosen config with down_prefetch=k; one Mixtral token
    (only the plan and gate_up under PDL) gets ``pdl_all`` and ``pdl_all+prefetch<k>``; without
    PDL neither. ``--only`` keeps the chosen config and the names with its prefixes."""
    ks = decode_tile_study.DOWN_PREFETCH
    base = select_config(8, 256, 7168, 2048, "fp8_tensor", 132, pdl=True)
    assert base.pdl == "all"
    out = decode_tile_study.variants(base, "fp8_tensor", 2048, one_token=True)
    for k in ks:
        assert out[f"prefetch{k}"] == dataclasses.replace(base, down_prefetch=k)
    mixtral = select_config(2, 8, 4096, 14336, "fp8_tensor", 132, pdl=True)
    assert mixtral.pdl == "gate_up"
    out_m = decode_tile_study.variants(mixtral, "fp8_tensor", 14336, one_token=True)
    assert out_m["pdl_all"] == dataclasses.replace(mixtral, pdl="all")
    for k in ks:
        assert out_m[f"pdl_all+prefetch{k}"] == dataclasses.replace(mixtral, pdl="all", down_prefetch=k)
    off = decode_tile_study.variants(select_config(2, 8, 4096, 14336, "fp8_tensor", 132), "fp8_tensor", 14336,
                                     one_token=True)
    assert not [name for name in off if "prefetch" in name or "pdl" in name]
    names = list(out)
    assert decode_tile_study.kept(names, None) == names
    assert decode_tile_study.kept(names, "prefetch,h_") == ["chosen", "h_by_h_quant", *(f"prefetch{k}" for k in ks)]


    # fp8_block's row over two scale groups: also on the down tile select_config gives h quantized there
    base = select_config(2, 8, 4096, 14336, "fp8_block", 132)
    tile = in_down_tile(4096, 2, 132)
    out = decode_tile_study.variants(base, "fp8_block", 14336, one_token=True, down_tile=tile)
    assert out["h_in_down+d32x256s4"] == dataclasses.replace(base, quantize_in_down=True, down=tile, gemv=None)

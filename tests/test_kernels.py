"""The Triton expert kernels on CPU, through Triton's interpreter, plus CPU-side selection logic.

The kernel tests take the kernels from the ``interpreted_kernels`` fixture (tests/conftest.py):
they run wherever ``triton`` is installed (it is in the ``test`` extra; CPU interpreter mode needs
no GPU) and there is no CUDA, and fail, never skip, if the kernels were imported compiled; they
are skipped with the reason without triton or with CUDA.

Triton's interpreter takes two numerical shortcuts the GPU does not (seen in Triton 3.9):
float downcasts (fp32 -> bf16 / fp8) truncate or round half up without carrying into the
exponent (124.5 / scale rounds to 64 instead of 128 in e4m3), and a bf16 ``tl.dot`` multiplies the
raw uint16 bit patterns. The kernels' numerics are defined by the GPU's conversions (round to
nearest even, fp8 saturating), so the ``exact_interpreter`` fixture routes those two operations
through torch's correctly rounded conversions for the duration of the test; everything else is
the unmodified interpreter. The same kernels are checked on a GPU by tests/gpu/test_gpu_kernels.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from quant_asserts import assert_same_quantization, quantized_positions

from moeshard.config import MoEConfig, QuantConfig
from moeshard.dispatch.base import BackendContext, weighted_sum
from moeshard.dispatch.local import LocalBackend
from moeshard.experts import GroupedExperts
from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.kernel_choice import kernel_choice, select_kernel
from moeshard.kernels.configs import ExpertsConfig, GemmConfig, select_config
from moeshard.quant import get_scheme, quantize_activations, quantize_weight
from moeshard.quant.fp8 import abs_amax
from moeshard.reference import expert_reference
from moeshard.router import Routing
from moeshard.tolerances import compare

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"]


def _experts_api(k):
    """(TritonExperts, GemmConfig, ExpertsConfig) of the interpreted kernels."""
    return k.experts.TritonExperts, k.configs.GemmConfig, k.configs.ExpertsConfig


def _problem(M, E, H, I, dtype, scheme, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=gen).to(dtype)
    ids = torch.randint(0, E, (M,), generator=gen)
    ids[: M // 4] = E - 1  # one expert with several tiles, and likely an expert with none
    gu = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    dn = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
    if scheme == "none":
        return x, ids, ExpertWeights(gu, dn)
    w = ExpertWeights(quantize_weight(gu, scheme), quantize_weight(dn, scheme), scheme)
    return quantize_activations(x, scheme), ids, w


@pytest.mark.parametrize("M,E,bm", [(1, 4, 16), (37, 5, 16), (200, 3, 32), (90, 40, 16)])
def test_align_rows(interpreted_kernels, M, E, bm):
    align_rows = interpreted_kernels.align.align_rows
    ids = torch.randint(0, E, (M,), generator=torch.Generator().manual_seed(M))
    plan = align_rows(ids, E, bm)
    counts = torch.bincount(ids, minlength=E)
    assert torch.equal(plan.count.long(), counts)
    tiles = plan.tile_expert.tolist()
    for e in range(E):
        s, c = int(plan.start[e]), int(counts[e])
        assert s % bm == 0
        assert torch.equal(plan.sorted_rows[s:s + c].long().sort().values, (ids == e).nonzero().flatten())
        assert tiles[s // bm:(s + c + bm - 1) // bm] == [e] * ((c + bm - 1) // bm)
    used = sum((int(c) + bm - 1) // bm for c in counts)
    assert tiles[used:] == [-1] * (len(tiles) - used)


QUANTIZED = ["fp8_tensor", "fp8_token", "fp8_block", "nvfp4"]
# (routed rows, BLOCK_M, I, columns per program; None: quantize_h's choice, CHUNK-wide spans at
# these row counts). Every plan ends in tiles of expert -1.
QUANT_H_CASES = {
    "I160": (40, 16, 160, None),  # one full and one partial 128-column group
    "I1408-span512": (40, 32, 1408, 512),  # three spans, the last one 384 columns wide
    "I1408-span256": (24, 16, 1408, 256),  # six spans, the last one 128 columns wide
    "I1792": (24, 16, 1792, None),  # fourteen 128-column spans
    "I1792-one-span": (24, 16, 1792, 2048),  # one span wider than the row: fp8_token in one kernel
}


@pytest.mark.parametrize("case", QUANT_H_CASES)
@pytest.mark.parametrize("scheme", QUANTIZED)
def test_quantize_h_bit_exact(interpreted_kernels, exact_interpreter, scheme, case):
    align_rows, quantize_h = interpreted_kernels.align.align_rows, interpreted_kernels.quant.quantize_h
    M, bm, K, span = QUANT_H_CASES[case]
    E = 3
    ids = torch.randint(0, E, (M,), generator=torch.Generator().manual_seed(1))
    amax = torch.empty(E)
    plan = align_rows(ids, E, bm, amax=amax)
    assert int(plan.tile_expert[-1]) == -1  # the plan's bound leaves tiles past the end: skipped
    gen = torch.Generator().manual_seed(2)
    h = (torch.randn(plan.padded_rows, K, generator=gen) * torch.exp(torch.randn(plan.padded_rows, 1, generator=gen))
         ).to(torch.bfloat16)
    tile_of = plan.tile_expert.repeat_interleave(bm)
    for e in range(E):
        amax[e] = h[tile_of == e].float().abs().amax()
    q = quantize_h(h, scheme, plan, amax, span=span)
    live = quantized_positions(plan)
    if bm > 16:  # some 16-row blocks of the 32-row tiles hold padding only: skipped
        assert live.sum() < (tile_of >= 0).sum()
    row_amax = amax[tile_of.clamp(min=0)].unsqueeze(1)[live]
    ref = quantize_activations(h[live], scheme, amax=row_amax if get_scheme(scheme).per_tensor_activation else None)
    assert_same_quantization(q, ref, live)


@pytest.mark.parametrize("scheme", QUANTIZED)
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_down_ignores_the_positions_quantize_h_leaves(interpreted_kernels, exact_interpreter, scheme, tma):
    """quantize_h leaves row blocks past each expert's last row unwritten, and the down GEMM reads
    whole tiles: whatever those positions hold (here NaN values and scales) must not reach y.
    y with NaN there equals y with zeros there, bit for bit, for 32-row tiles holding 3-17 rows."""
    k = interpreted_kernels
    GemmConfig = k.configs.GemmConfig
    M, E, H, I = 45, 4, 64, 128
    x, _, w = _problem(M, E, H, I, torch.bfloat16, scheme, seed=29)
    ids = torch.tensor([0] * 17 + [1] * 3 + [2] * 25)[torch.randperm(M, generator=torch.Generator().manual_seed(3))]
    plan = k.align.align_rows(ids, E, 32)
    gemm = GemmConfig(32, 64, 32, group_m=2, tma=tma)
    amax = torch.zeros(E) if get_scheme(scheme).per_tensor_activation else None
    h = torch.empty(plan.padded_rows, I, dtype=torch.bfloat16)
    k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation="silu", gather=True, amax=amax)
    q = k.quant.quantize_h(h, scheme, plan, amax)
    skipped = ~quantized_positions(plan)
    assert skipped[(plan.tile_expert >= 0).repeat_interleave(32)].any()
    ys = []
    for fill in (0, float("nan")):
        tensors = [q.data] + [t for t in (q.row_scale, q.tensor_scale) if t is not None and t.dim() == 2]
        for t in tensors:
            if t.dtype.is_floating_point and t.element_size() > 1:
                t[skipped] = fill
            else:  # fp8 values, nvfp4 codes and e4m3 scales: bytes (0x7F is an e4m3 NaN)
                t.view(torch.uint8)[skipped] = 0 if fill == 0 else 0x7F
        y = torch.full((M, H), float("nan"), dtype=torch.bfloat16)
        k.grouped_gemm.moe_gemm(q, w.down, plan, y, gemm, activation=None, gather=False)
        ys.append(y)
    assert not ys[0].isnan().any() and torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_quantize_h_no_rows(interpreted_kernels, scheme):
    RowAlignment, quantize_h = interpreted_kernels.align.RowAlignment, interpreted_kernels.quant.quantize_h
    none = torch.empty(0, dtype=torch.int32)
    plan = RowAlignment(none, none, torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 16, 0)
    q = quantize_h(torch.empty(0, 1408, dtype=torch.bfloat16), scheme, plan, torch.zeros(3))
    like = quantize_activations(torch.ones(1, 1408, dtype=torch.bfloat16), scheme,
                                amax=torch.ones(1, 1) if get_scheme(scheme).per_tensor_activation else None)
    for got, ref in ((q.data, like.data), (q.row_scale, like.row_scale), (q.tensor_scale, like.tensor_scale)):
        assert (got is None) == (ref is None)
        if got is not None:
            assert got.shape == (0, *ref.shape[1:]) and got.dtype == ref.dtype


def test_quantize_h_column_span():
    from moeshard.kernels.configs import SMALL_H_ELEMENTS, column_span
    from moeshard.kernels.configs import SPAN_UNIT as CHUNK

    # Mixtral (I = 14336) padded rows at 1, 16, 128 and 4096 tokens; DeepSeek-V3 (I = 2048) at 16,
    # 128 and 4096: 128 columns up to 2^24 elements of h, 512 above (scripts/fp8_study.py's sweep).
    assert [column_span(p, 14336) for p in (32, 160, 768, 9216)] == [128, 128, 128, 512]
    assert [column_span(p, 2048) for p in (2048, 5120, 65536)] == [128, 128, 512]
    assert column_span(10**6, 160) == 256  # never wider than the row, rounded up to 128
    for rows in (16, 160, 4096, 65536):
        for K in (160, 1408, 1792, 2048, 7168, 14336):
            span = column_span(rows, K)
            assert span % CHUNK == 0 and span <= CHUNK * -(-K // CHUNK)
            assert span == CHUNK or rows * K > SMALL_H_ELEMENTS


@pytest.mark.parametrize("dtype,scheme", [(torch.bfloat16, s) for s in SCHEMES] + [(torch.float16, "none"),
                                                                                   (torch.float16, "nvfp4")])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_triton_experts_match_reference(interpreted_kernels, exact_interpreter, dtype, scheme, tma):
    TritonExperts, GemmConfig, ExpertsConfig = _experts_api(interpreted_kernels)
    M, E, H, I = 45, 4, 64, 96  # I = 96: the last 64-wide column tile is partial
    x, ids, w = _problem(M, E, H, I, dtype, scheme, seed=7)
    gemm = GemmConfig(16, 64, 32, group_m=2, tma=tma)
    y = TritonExperts("silu", dtype, ExpertsConfig(gemm, gemm))(ExpertInput(x, ids), w)
    err, atol, rtol, ok = compare(y, expert_reference(x, ids, w, "silu", dtype), dtype, scheme)
    assert ok, f"max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block"])
@pytest.mark.parametrize("M,E,block_m,gpu,tma", [(24, 4, 16, "h200", False), (24, 4, 16, "h200", True),
                                                 (64, 2, 64, "h100", False)],
                         ids=["16-rows-pointers", "16-rows-tma", "64-rows-h100"])
def test_deep_k_decode_tiles_match_reference(interpreted_kernels, exact_interpreter, scheme, M, E, block_m, gpu,
                                             tma):
    """The decode tiles with 256-column K steps that ``select_config`` takes from 16 routed rows
    on (16-row tiles, and on an H100 64-row ones), as it picks them for decode-sized problems
    whose K (H and I) 256 divides, with the K loop running twice per tile in the gate_up and once
    in the down."""
    import dataclasses

    TritonExperts, _, _ = _experts_api(interpreted_kernels)
    H, I = 512, 256  # noqa: E741
    cfg = interpreted_kernels.configs.select_config(M, E, H, I, scheme, gpu=gpu)
    assert (cfg.gate_up.block_m, cfg.gate_up.block_k, cfg.down.block_k) == (block_m, 256, 256), cfg
    cfg = dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up, tma=tma),
                              down=dataclasses.replace(cfg.down, tma=tma))
    x, ids, w = _problem(M, E, H, I, torch.bfloat16, scheme, seed=13)
    y = TritonExperts("silu", torch.bfloat16, cfg)(ExpertInput(x, ids), w)
    err, atol, rtol, ok = compare(y, expert_reference(x, ids, w, "silu", torch.bfloat16), torch.bfloat16, scheme)
    assert ok, f"max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"


def _blocky_fp8_block_problem(M, E, H, I, seed):  # noqa: E741
    """An fp8_block problem whose weights' 128 x 128 blocks differ in magnitude by up to 2^9
    (block (j, k) scaled by 2^((3j + 5k) % 10 - 5)), so that a scale taken from the wrong block
    (the neighbouring column block, gate's block for up, or another K group) is far outside any
    tolerance."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (M,), generator=gen)

    def blocky(rows, cols):
        j = torch.arange(rows) // 128
        k = torch.arange(cols) // 128
        return torch.exp2(((3 * j[:, None] + 5 * k[None, :]) % 10).float() - 5)
    gu = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5 * blocky(2 * I, H)).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, generator=gen) / I**0.5 * blocky(H, I)).to(torch.bfloat16)
    w = ExpertWeights(quantize_weight(gu, "fp8_block"), quantize_weight(dn, "fp8_block"), "fp8_block")
    return quantize_activations(x, "fp8_block"), ids, w


@pytest.mark.parametrize("block_n,block_k,inter", [(64, 64, 256), (128, 128, 256), (64, 128, 192), (128, 128, 192)])
def test_fp8_block_tiles_inside_one_scale_block_match_reference(interpreted_kernels, exact_interpreter, block_n,
                                                                 block_k, inter):
    """fp8_block tiles of at most 128 columns aligned to their width read one weight scale per K
    step (a scalar, not a [BLOCK_N] vector) when N is a multiple of 128; where the intermediate
    size is not (192 here, as gpt-oss's 2880), up's columns start inside a weight block and the
    fused gate_up tile reads a vector of scales (a 128-column up tile spans two blocks). Two
    scalars per tile in its place, each column taking its block's, gave the same products and
    fewer registers but no speed on one H100 (results/h100/ws_pair_ab-2026-12-06-bc470bf/).
    The weights' 128 x 128 blocks differ in
    magnitude by up to 2^9, so a scale taken from the wrong block (the neighbouring column block,
    gate's block for up, or a BLOCK_K = 64 step's wrong K block) is far outside the tolerance."""
    TritonExperts, GemmConfig, ExpertsConfig = _experts_api(interpreted_kernels)
    xq, ids, w = _blocky_fp8_block_problem(37, 3, 256, inter, seed=5)
    gemm = GemmConfig(16, block_n, block_k, group_m=2)
    y = TritonExperts("silu", torch.bfloat16, ExpertsConfig(gemm, gemm))(ExpertInput(xq, ids), w)
    err, atol, rtol, ok = compare(y, expert_reference(xq, ids, w, "silu", torch.bfloat16), torch.bfloat16,
                                  "fp8_block")
    assert ok, f"max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token"])
def test_down_tiles_shorter_than_the_plan_match_reference(interpreted_kernels, exact_interpreter, scheme):
    """down in 16-row tiles over gate_up's 32-row plan (``split_tiles``): experts of 1-40 rows,
    so some 32-row tiles hold 16 rows or fewer and their second half is skipped."""
    TritonExperts, GemmConfig, ExpertsConfig = _experts_api(interpreted_kernels)
    M, E, H, I = 45, 4, 64, 96
    x, ids, w = _problem(M, E, H, I, torch.bfloat16, scheme, seed=11)
    ids[:40] = 2  # one expert of 40+ rows (two 32-row tiles, the second partly empty), others small
    cfg = ExpertsConfig(GemmConfig(32, 64, 32, group_m=2), GemmConfig(16, 32, 32, group_m=1))
    y = TritonExperts("silu", torch.bfloat16, cfg)(ExpertInput(x, ids), w)
    err, atol, rtol, ok = compare(y, expert_reference(x, ids, w, "silu", torch.bfloat16), torch.bfloat16, scheme)
    assert ok, f"max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_half_tiles_compute_the_whole_tiles_numbers(interpreted_kernels, exact_interpreter, scheme, tma):
    """``GemmConfig.half_tiles``: an expert's last tile whose rows fit in its first half computes
    a tile of half the height. Every output (h at every padded position, padding zeros included,
    and y) must be the whole tiles' bit for bit; the plan holds tiles on both sides of the
    half-way line, so a half tile that read or wrote the wrong rows (or skipped real ones) differs."""
    k = interpreted_kernels
    GemmConfig = k.configs.GemmConfig
    M, E, H, I = 90, 5, 64, 96
    x, _, w = _problem(M, E, H, I, torch.bfloat16, scheme, seed=13)  # x quantized as before dispatch
    # experts of 40 (32 + 8: the second tile is a half tile), 30 (one tile, more than half),
    # 3 and 17 rows (one half tile each), and none
    ids = torch.tensor([0] * 40 + [1] * 30 + [2] * 3 + [3] * 17)[torch.randperm(M, generator=torch.Generator().manual_seed(1))]
    plan = k.align.align_rows(ids, E, 32)
    rows_in_tile = [int(plan.count[e] - (t * 32 - plan.start[e])) for t, e in enumerate(plan.tile_expert.tolist())
                    if e >= 0]
    assert any(r <= 16 for r in rows_in_tile) and any(r > 16 for r in rows_in_tile), rows_in_tile
    amax = torch.zeros(E) if get_scheme(scheme).per_tensor_activation else None
    outs = {}
    for half in (False, True):
        gemm = GemmConfig(32, 64, 32, group_m=2, tma=tma, half_tiles=half)
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16)
        a = None if amax is None else amax.clone()
        k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation="silu", gather=True, amax=a)
        h_in = k.quant.quantize_h(h, scheme, plan, a) if scheme != "none" else h
        y = torch.full((M, H), float("nan"), dtype=torch.bfloat16)
        k.grouped_gemm.moe_gemm(h_in, w.down, plan, y, gemm, activation=None, gather=False)
        outs[half] = (h, a, y)
    (h0, a0, y0), (h1, a1, y1) = outs[False], outs[True]
    assert torch.equal(h0.isnan(), h1.isnan()) and torch.equal(h0.nan_to_num(), h1.nan_to_num())
    assert not y1.isnan().any() and torch.equal(y0, y1)
    assert a0 is None or torch.equal(a0, a1)


@pytest.mark.parametrize("dtype,activation,half,tma", [
    (torch.bfloat16, "silu", False, False), (torch.bfloat16, "silu", True, True),
    (torch.float16, "gelu", True, False), (torch.float16, "silu", False, True),
    (torch.bfloat16, "gelu_tanh", False, False)])
def test_gate_up_quantizing_h_gives_quantize_h_bits(interpreted_kernels, exact_interpreter, dtype, activation,
                                                    half, tma):
    """fp8_block gate_up with ``out_scale`` stores h quantized: the values and scales must be
    ``quantize_h``'s of the model-dtype h, bit for bit, at every position quantize_h writes
    (padding rows included: their zeros take the floor scale), and nothing elsewhere. Experts of
    40 (a tile and a half tile), 30, 3 and 17 rows and an empty one; two 128-column groups."""
    k = interpreted_kernels
    GemmConfig = k.configs.GemmConfig
    M, E, H, I = 90, 5, 128, 256
    x, _, w = _problem(M, E, H, I, dtype, "fp8_block", seed=17)
    ids = torch.tensor([0] * 40 + [1] * 30 + [2] * 3 + [3] * 17)[torch.randperm(M, generator=torch.Generator().manual_seed(2))]
    plan = k.align.align_rows(ids, E, 32)
    gemm = GemmConfig(32, 128, 128, group_m=2, tma=tma, half_tiles=half)
    h = torch.full((plan.padded_rows, I), float("nan"), dtype=dtype)
    k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation=activation, gather=True)
    want = k.quant.quantize_h(h, "fp8_block", plan, None)
    q = torch.full((plan.padded_rows, I), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN
    s = torch.full((plan.padded_rows, I // 128), float("nan"))
    k.grouped_gemm.moe_gemm(x, w.gate_up, plan, q, gemm, activation=activation, gather=True, out_scale=s,
                            h_dtype=dtype)
    # gate_up writes every position of its live tiles, quantize_h the row blocks holding rows
    tiles = (plan.tile_expert >= 0).repeat_interleave(32)
    written = quantized_positions(plan)
    assert written.sum() < tiles.sum() < plan.padded_rows
    assert torch.equal(q.view(torch.uint8)[written], want.data.view(torch.uint8)[written])
    assert torch.equal(s[written], want.row_scale[written])
    assert (q.view(torch.uint8)[~tiles] == 0x7F).all() and s[~tiles].isnan().all()


@pytest.mark.parametrize("M,E,bm", [(40, 5, 16), (200, 3, 32), (1500, 6, 16)])
def test_align_rows_zeroes_the_row_maxima_buffer(interpreted_kernels, M, E, bm):
    """row_amax [P] is zeroed by the plan at every position, by the one-program plan (40 rows) and
    by the scatter kernel's programs, each zeroing its share (200 and 1500 rows: P spread over 3
    and 6 programs). The buffer starts as NaN, so a share left unzeroed fails."""
    align = interpreted_kernels.align
    ids = torch.randint(0, E, (M,), generator=torch.Generator().manual_seed(M))
    P = align.max_tiles(M, E, bm) * bm
    row_amax = torch.full((P,), float("nan"))
    plan = align.align_rows(ids, E, bm, row_amax=row_amax)
    assert plan.padded_rows == P and torch.equal(row_amax, torch.zeros(P))
    with pytest.raises(ValueError, match=rf"row_amax must be a contiguous float32 \[{P}\]"):
        align.align_rows(ids, E, bm, row_amax=torch.zeros(P + 1))


@pytest.mark.parametrize("half,tma,span", [(False, False, None), (True, True, None), (True, False, 256),
                                           (False, True, 512)])
def test_gate_up_row_maxima_give_quantize_h_bits(interpreted_kernels, exact_interpreter, half, tma, span):
    """fp8_token: the gate_up GEMM's row maxima (``row_amax``) equal max |h| of every routed row,
    and ``quantize_h`` given them writes the same bits as from its own passes over h, at every
    position it writes. Experts of 40 (a tile and a half tile), 30, 3 and 17 rows and an empty
    one; h 384 columns wide, over one to three spans and six 64-column tiles."""
    k = interpreted_kernels
    GemmConfig = k.configs.GemmConfig
    M, E, H, I = 90, 5, 64, 384
    x, _, w = _problem(M, E, H, I, torch.bfloat16, "fp8_token", seed=23)
    ids = torch.tensor([0] * 40 + [1] * 30 + [2] * 3 + [3] * 17)[torch.randperm(M, generator=torch.Generator().manual_seed(4))]
    P = k.align.max_tiles(M, E, 32) * 32
    row_amax = torch.full((P,), float("nan"))
    plan = k.align.align_rows(ids, E, 32, row_amax=row_amax)
    gemm = GemmConfig(32, 64, 32, group_m=2, tma=tma, half_tiles=half)
    h = torch.full((P, I), float("nan"), dtype=torch.bfloat16)
    k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation="silu", gather=True, row_amax=row_amax)
    tile_of = plan.tile_expert.repeat_interleave(32).long()
    expert = tile_of.clamp(min=0)
    pos = torch.arange(P)
    real = (tile_of >= 0) & (pos - plan.start.long()[expert] < plan.count.long()[expert])
    assert torch.equal(row_amax[real], h[real].float().abs().amax(dim=1))
    written = quantized_positions(plan)
    assert (written & ~real).any()  # padding rows of live row blocks: their zeros, the plan's zero
    assert (row_amax[written & ~real] == 0).all()
    want = k.quant.quantize_h(h, "fp8_token", plan, None, span=span)
    got = k.quant.quantize_h(h, "fp8_token", plan, None, span=span, row_amax=row_amax)
    assert torch.equal(got.data.view(torch.uint8)[written], want.data.view(torch.uint8)[written])
    assert torch.equal(got.row_scale[written], want.row_scale[written])
    # A planted fault: row maxima of half the size give other scales and values.
    wrong = k.quant.quantize_h(h, "fp8_token", plan, None, span=span, row_amax=row_amax / 2)
    assert not torch.equal(wrong.row_scale[real], want.row_scale[real])


def _refusal_problem(k, scheme: str, H: int, I: int, bm: int, seed: int):  # noqa: E741
    """(x, w, plan, P) of 20 routed rows over 2 experts, for the refusal tests."""
    x, ids, w = _problem(20, 2, H, I, torch.bfloat16, scheme, seed=seed)
    plan = k.align.align_rows(ids, 2, bm)
    return x, w, plan, plan.padded_rows


def test_row_maxima_are_refused_where_they_do_not_apply(interpreted_kernels):
    k = interpreted_kernels
    M, E, H, I = 20, 2, 64, 128
    x, w, plan, P = _refusal_problem(k, "fp8_token", H, I, 16, seed=5)
    h = torch.zeros(P, I, dtype=torch.bfloat16)
    gemm = k.configs.GemmConfig(16, 64, 32)
    with pytest.raises(ValueError, match="row_amax takes h's row maxima in the gate_up GEMM, without amax"):
        k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation="silu", gather=True, amax=torch.zeros(E),
                                row_amax=torch.zeros(P))
    with pytest.raises(ValueError, match="got down"):
        k.grouped_gemm.moe_gemm(quantize_activations(h, "fp8_token"), w.down, plan, torch.empty(M, H, dtype=torch.bfloat16),
                                gemm, activation=None, gather=False, row_amax=torch.zeros(P))
    with pytest.raises(ValueError, match=rf"row_amax must be a contiguous float32 \[P={P}\]"):
        k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation="silu", gather=True,
                                row_amax=torch.zeros(P, 2)[:, 0])
    with pytest.raises(ValueError, match="row_amax is fp8_token's contiguous float32"):
        k.quant.quantize_h(h, "fp8_block", plan, None, row_amax=torch.zeros(P))
    with pytest.raises(ValueError, match="row_amax is fp8_token's contiguous float32"):
        k.quant.quantize_h(h, "fp8_token", plan, None, row_amax=torch.zeros(P - 1))


def test_gate_up_quantizing_h_refuses_what_it_cannot_quantize(interpreted_kernels):
    k = interpreted_kernels
    GemmConfig = k.configs.GemmConfig
    M, E, H, I = 20, 2, 128, 256
    x, w, plan, P = _refusal_problem(k, "fp8_block", H, I, 32, seed=3)
    q = torch.empty(P, I, dtype=torch.float8_e4m3fn)
    s = torch.empty(P, I // 128)
    gemm = GemmConfig(32, 128, 128)

    def call(**over):
        args = dict(a=x, w=w.gate_up, plan=plan, out=q, config=gemm, activation="silu", gather=True, out_scale=s,
                    h_dtype=torch.bfloat16)
        args.update(over)
        k.grouped_gemm.moe_gemm(args.pop("a"), args.pop("w"), args.pop("plan"), args.pop("out"), args.pop("config"),
                                **args)

    with pytest.raises(ValueError, match="block_n=64, N=256"):
        call(config=GemmConfig(32, 64, 128))
    with pytest.raises(ValueError, match="needs h_dtype.*got None"):
        call(h_dtype=None)
    with pytest.raises(ValueError, match="takes no amax"):
        call(amax=torch.zeros(E))
    with pytest.raises(ValueError, match=rf"out must be torch.float8_e4m3fn \[{P}, {I}\]; got torch.bfloat16"):
        call(out=torch.empty(P, I, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=rf"out_scale must be contiguous float32 \[{P}, 2\] rows; got torch.float32 \[{P}, 1\]"):
        call(out_scale=torch.empty(P, 1))
    xt, _, wt = _problem(M, E, H, I, torch.bfloat16, "fp8_token", seed=3)
    with pytest.raises(ValueError, match="fp8_block gate_up GEMM; got gate_up with operands of kernel mode 2"):
        call(a=xt, w=wt.gate_up)
    with pytest.raises(ValueError, match="does not take \\['out_scale'\\]"):
        call(a=xt, w=wt.gate_up, config=GemmConfig(128, 128, 128, 8, 8, 4, tma=True, fp8_acc="imprecise",
                                                   engine="gluon"))


@pytest.mark.parametrize("I", [256, 192])
def test_experts_quantizing_h_in_gate_up_give_the_same_bits(interpreted_kernels, exact_interpreter, I):
    """``ExpertsConfig.h_quant='gate_up'``: the experts' output is the separate pass's, bit for
    bit; an intermediate size that is not a multiple of 128 is refused with its value."""
    TritonExperts, GemmConfig, ExpertsConfig = _experts_api(interpreted_kernels)
    M, E, H = 45, 4, 128
    x, ids, w = _problem(M, E, H, I, torch.bfloat16, "fp8_block", seed=23)
    base = ExpertsConfig(GemmConfig(32, 128, 128, half_tiles=True), GemmConfig(16, 128, 128))
    fused = dataclasses.replace(base, h_quant="gate_up")
    if I % 128:
        with pytest.raises(ValueError, match="fp8_block experts whose intermediate size is a multiple of 128; "
                                             "the experts are fp8_block with I=192"):
            TritonExperts("silu", torch.bfloat16, fused)(ExpertInput(x, ids), w)
        return
    y0 = TritonExperts("silu", torch.bfloat16, base)(ExpertInput(x, ids), w)
    y1 = TritonExperts("silu", torch.bfloat16, fused)(ExpertInput(x, ids), w)
    assert not y1.isnan().any() and torch.equal(y0, y1)


def test_h_quant_in_gate_up_needs_its_tile():
    with pytest.raises(ValueError, match="h_quant: 'fused' is not one of"):
        ExpertsConfig(GemmConfig(32, 128, 128), GemmConfig(32, 128, 128), h_quant="fused")
    with pytest.raises(ValueError, match="128-column tiles; got gate_up block_n=64, engine='triton'"):
        ExpertsConfig(GemmConfig(32, 64, 128), GemmConfig(32, 128, 128), h_quant="gate_up")


def test_half_tiles_need_tiles_of_at_least_32_rows():
    with pytest.raises(ValueError, match="half_tiles needs block_m a multiple of 32, got block_m=16"):
        GemmConfig(16, 64, 64, half_tiles=True)


def test_split_tiles_marks_the_empty_halves(interpreted_kernels):
    align = interpreted_kernels.align
    ids = torch.tensor([0] * 5 + [1] * 20 + [3] * 3)
    plan = align.align_rows(ids, 4, 16)
    half = align.split_tiles(plan, 8)
    live = [int(e) for e in half.tile_expert]
    # expert 0: 5 rows (one live 8-row tile of 2), expert 1: 20 rows (3 of 4), expert 3: 3 rows (1 of 2)
    assert live[:8] == [0, -1, 1, 1, 1, -1, 3, -1] and all(e == -1 for e in live[8:])
    assert align.split_tiles(plan, 16) is plan
    with pytest.raises(ValueError, match="block_m=12 must divide the plan's block_m=16"):
        align.split_tiles(plan, 12)


@pytest.mark.parametrize("ratio", [2, 4])
def test_split_tiles_kernel_matches_its_definition(interpreted_kernels, ratio):
    """The split kernel against the definition in torch: a shorter tile belongs to its parent
    tile's expert where that expert has a row at or after the tile's first position, else -1.
    Random loads with empty experts, experts of exactly a parent tile, and more shorter tiles than
    one program covers (so a second program's offset is exercised)."""
    align = interpreted_kernels.align
    gen = torch.Generator().manual_seed(ratio)
    for M, E in ((37, 5), (300, 9), (9000, 3)):
        ids = torch.randint(0, E, (M,), generator=gen)
        ids[ids == 1] = 2  # expert 1 empty
        ids[:16] = 0  # expert 0: at least one whole 16-row tile
        plan = align.align_rows(ids, E, 16)
        split = align.split_tiles(plan, 16 // ratio)
        parent = plan.tile_expert.repeat_interleave(ratio)
        first = torch.arange(parent.shape[0], dtype=torch.int32) * (16 // ratio)
        expert = parent.clamp(min=0).long()
        live = (parent >= 0) & (first - plan.start[expert] < plan.count[expert])
        assert torch.equal(split.tile_expert, torch.where(live, parent, -1)), (M, E)
        assert split.sorted_rows is plan.sorted_rows and split.block_m == 16 // ratio


@pytest.mark.parametrize("fp8_acc", ["promote", "imprecise"])
def test_fp8_accumulation_modes_compute_the_same_products(interpreted_kernels, exact_interpreter, fp8_acc):
    """The interpreter accumulates exactly, so every accumulation mode must give the split mode's
    numbers bit for bit there (what they change on Hopper is the tensor cores' precision)."""
    moe_gemm, align_rows = interpreted_kernels.grouped_gemm.moe_gemm, interpreted_kernels.align.align_rows
    GemmConfig = interpreted_kernels.configs.GemmConfig
    xq, ids, w = _problem(21, 3, 64, 64, torch.bfloat16, "fp8_token", seed=11)  # x quantized before dispatch
    plan = align_rows(ids, 3, 16)
    gemm = GemmConfig(16, 32, 32, group_m=1)
    outs = {}
    for mode in ("split", fp8_acc):
        h = torch.zeros(plan.padded_rows, 64, dtype=torch.bfloat16)
        moe_gemm(xq, w.gate_up, plan, h, gemm, activation="silu", gather=True, fp8_acc=mode)
        outs[mode] = h
    assert torch.equal(outs["split"], outs[fp8_acc])
    with pytest.raises(ValueError, match="fp8_acc 'fast' is not one of"):
        moe_gemm(xq, w.gate_up, plan, outs["split"], gemm, activation="silu", gather=True, fp8_acc="fast")
    # A tile height other than the plan's is refused before any launch (it read wrong positions).
    with pytest.raises(ValueError, match=r"config.block_m=32 but the plan's block_m=16; .*split_tiles"):
        moe_gemm(xq, w.gate_up, plan, outs["split"], GemmConfig(32, 32, 32, group_m=1), activation="silu",
                 gather=True)


def test_fp8_block_refuses_k_steps_it_cannot_scale_by_group(interpreted_kernels):
    """fp8_block's GEMM scales each 128-column sub-step of K with that group's scales. A
    256-column step once ran with the first group's scales for both halves and gave outputs off
    by 55-76% of their largest value on the GPU (a tile study's decode variants), with no error.
    A step that is not whole groups, or whose last step would run past K's groups, is refused
    before any launch; 128 and whole groups dividing K still run."""
    moe_gemm, align_rows = interpreted_kernels.grouped_gemm.moe_gemm, interpreted_kernels.align.align_rows
    GemmConfig = interpreted_kernels.configs.GemmConfig
    for K, bk in ((256, 192), (384, 256)):
        xq, ids, w = _problem(5, 2, K, 32, torch.bfloat16, "fp8_block", seed=3)
        plan = align_rows(ids, 2, 16)
        h = torch.zeros(plan.padded_rows, 32, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=rf"fp8_block scales each 128-column group of K; config.block_k={bk} "
                                             rf"must divide 128, or be a multiple of 128 that divides K={K}"):
            moe_gemm(xq, w.gate_up, plan, h, GemmConfig(16, 32, bk, group_m=1), activation="silu", gather=True)
        assert not h.any()  # nothing ran
        moe_gemm(xq, w.gate_up, plan, h, GemmConfig(16, 32, 128, group_m=1), activation="silu", gather=True)
        assert h.any()


def test_k_sub_step_keeps_each_fp8_block_product_inside_one_scale_group():
    """The kernel's K sub-step, which also sizes its TMA blocks: fp8_block (mode 3) steps wider
    than its 128-column scale groups run a group at a time; every other step runs whole."""
    from moeshard.kernels.grouped_gemm import k_sub_step

    assert [k_sub_step(3, bk) for bk in (32, 64, 128, 256, 512)] == [32, 64, 128, 128, 128]
    assert [k_sub_step(mode, 256) for mode in (0, 1, 2, 4)] == [256, 256, 256, 256]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_fp8_block_steps_of_whole_groups_give_the_bits_of_one_group_steps(interpreted_kernels, exact_interpreter, tma):
    """A 256- or 512-column fp8_block K step runs as 128-column sub-steps, each scaled by its own
    group: the same sums added in the same order as 128-column steps, so the same bits, on
    weights whose K groups differ in scale by up to 2^9 (a sub-step scaled by its neighbour's
    group would move the output by far more than a rounding). Through pointer loads and TMA."""
    TritonExperts, GemmConfig, ExpertsConfig = _experts_api(interpreted_kernels)
    xq, ids, w = _blocky_fp8_block_problem(20, 2, 512, 256, seed=11)
    outs = {}
    for bk in (128, 256, 512):
        gate_up = GemmConfig(16, 32, min(bk, 512), group_m=1, tma=tma)
        down = GemmConfig(16, 64, min(bk, 256), group_m=1, tma=tma)  # the down GEMM's K is I = 256
        cfg = ExpertsConfig(gate_up, down, h_quant="pass")
        outs[bk] = TritonExperts("silu", torch.bfloat16, cfg)(ExpertInput(xq, ids), w)
    assert torch.equal(outs[256], outs[128]) and torch.equal(outs[512], outs[128])
    err, atol, rtol, ok = compare(outs[256], expert_reference(xq, ids, w, "silu", torch.bfloat16), torch.bfloat16,
                                  "fp8_block")
    assert ok, f"max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"


def test_triton_experts_gelu_and_deferred_quant(interpreted_kernels, exact_interpreter):
    TritonExperts, GemmConfig, ExpertsConfig = _experts_api(interpreted_kernels)
    x, ids, w = _problem(30, 3, 64, 64, torch.bfloat16, "fp8_tensor", seed=8)
    x_model = x.dequantize(torch.bfloat16)
    amax = x_model.abs().amax().float()
    gemm = GemmConfig(16, 32, 32, group_m=1)
    y = TritonExperts("gelu", torch.bfloat16, ExpertsConfig(gemm, gemm))(ExpertInput(x_model, ids, amax), w)
    ref = expert_reference(quantize_activations(x_model, "fp8_tensor", amax=amax), ids, w, "gelu", torch.bfloat16)
    assert compare(y, ref, torch.bfloat16, "fp8_tensor")[3]


def test_combine_topk(interpreted_kernels):
    combine_topk = interpreted_kernels.combine.combine_topk
    y = torch.randn(12, 40).to(torch.bfloat16)
    w = torch.rand(4, 3)
    ref = (y.view(4, 3, 40).double() * w.double()[..., None]).sum(1)
    assert (combine_topk(y, w).double() - ref).abs().max() < 1e-5
    # Gathered rows, as backends that receive results in another order use it; rows that no
    # pair names hold NaN and must never be read.
    rows = torch.tensor([[7, 0, 3], [11, 2, 5], [1, 9, 4], [6, 10, 8]])
    padded = torch.full((14, 40), float("nan"), dtype=torch.bfloat16)
    padded[rows.reshape(-1)] = y
    ref = (y.view(4, 3, 40).double() * w.double()[..., None]).sum(1)
    assert (combine_topk(padded, w, rows).double() - ref).abs().max() < 1e-5


def test_combine_topk_skips_empty_picks(interpreted_kernels, exact_interpreter):
    """Given the pairs' expert ids, a pair of id -1 (an empty pick) adds nothing: its row, which no
    expert wrote (NaN here), and its weight (nonzero here) are ignored, in token-major and gathered
    order, with and without the addend; the local backend's combine off CUDA does the same."""
    combine_topk = interpreted_kernels.combine.combine_topk
    g = torch.Generator().manual_seed(4)
    y = torch.randn(12, 40, generator=g).to(torch.bfloat16)
    w = torch.rand(4, 3, generator=g) + 0.5
    ids = torch.tensor([[2, -1, 0], [-1, -1, -1], [1, 3, 2], [-1, 0, 3]])
    empty = (ids < 0).reshape(-1)
    poisoned = y.masked_fill(empty.unsqueeze(1), float("nan"))
    ref = (y.masked_fill(empty.unsqueeze(1), 0).view(4, 3, 40).double() * w.double()[..., None]).sum(1)
    got = combine_topk(poisoned, w, pair_ids=ids)
    assert (got.double() - ref).abs().max() < 1e-5 and got[1].eq(0).all()
    rows = torch.tensor([[7, 0, 3], [11, 2, 5], [1, 9, 4], [6, 10, 8]])
    padded = torch.full((14, 40), float("nan"), dtype=torch.bfloat16)
    padded[rows.reshape(-1)] = poisoned
    assert (combine_topk(padded, w, rows, pair_ids=ids).double() - ref).abs().max() < 1e-5
    shared = torch.randn(4, 40, generator=g).to(torch.bfloat16)
    with_shared = combine_topk(poisoned, w, addend=shared, out_dtype=torch.bfloat16, pair_ids=ids)
    assert torch.equal(with_shared, torch.add(got, shared, out=torch.empty_like(shared)))
    with pytest.raises(ValueError, match=r"pair_ids must be a contiguous \[4, 3\] index"):
        combine_topk(y, w, pair_ids=ids[:, :2])
    from moeshard.dispatch.base import Dispatched
    from moeshard.dispatch.local import LocalState
    backend = LocalBackend(BackendContext(MoEConfig(num_experts=4, top_k=3, hidden_size=40, intermediate_size=8,
                                                    dtype=torch.bfloat16), QuantConfig(), empty_picks=True))
    d = Dispatched(None, LocalState(w, ids))
    assert (backend.combine(poisoned, d).double() - ref).abs().max() < 1e-5
    assert torch.equal(backend.combine_final(poisoned, d, shared, torch.bfloat16), with_shared)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_topk_adds_and_rounds_as_the_layer_did(interpreted_kernels, exact_interpreter, dtype):
    """The combine that finishes the layer's sum: the top-k sum plus the shared experts' rows in
    fp32, rounded once to the model dtype, bit for bit what the combine then torch's mixed add
    (or cast) gave; the local backend's combine_final off CUDA gives the same bits."""
    combine_topk = interpreted_kernels.combine.combine_topk
    g = torch.Generator().manual_seed(3)
    y = torch.randn(12, 1100, generator=g).to(dtype)  # H over one 1024-column block
    w = torch.rand(4, 3, generator=g)
    shared = torch.randn(4, 1100, generator=g).to(dtype)
    fp32 = combine_topk(y, w)
    want = torch.add(fp32, shared, out=torch.empty_like(shared))
    assert torch.equal(combine_topk(y, w, addend=shared, out_dtype=dtype), want)
    assert torch.equal(combine_topk(y, w, out_dtype=dtype), fp32.to(dtype))
    with pytest.raises(ValueError, match=r"addend must be \[4, 1100\]"):
        combine_topk(y, w, addend=shared[:3], out_dtype=dtype)
    from moeshard.dispatch.base import Dispatched
    from moeshard.dispatch.local import LocalState
    backend = LocalBackend(BackendContext(MoEConfig(num_experts=4, top_k=3, hidden_size=1100, intermediate_size=8,
                                                    dtype=dtype), QuantConfig()))
    d = Dispatched(None, LocalState(w))
    assert torch.equal(backend.combine_final(y, d, shared, dtype), want)
    assert torch.equal(backend.combine_final(y, d, None, dtype), fp32.to(dtype))


@pytest.mark.slow  # a second pytest in a subprocess, 8 s on 2 cores: `make test-slow`
def test_kernels_imported_compiled_are_an_error_not_a_skip(interpreted_kernels):
    """tests/conftest.py's guard: with the kernel modules imported in compiled mode before pytest
    starts (TRITON_INTERPRET unset), an interpreter test errors; it does not skip or pass."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys, moeshard.kernels.experts, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
            "'tests/test_kernels.py::test_combine_topk']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "1 error" in out and "Triton kernels imported in compiled mode" in out and "skipped" not in out, out[-3000:]


def test_local_backend_round_trip():
    T, K, H = 6, 3, 8
    backend = LocalBackend(BackendContext(MoEConfig(4, K, H, 16), QuantConfig()))
    x = torch.randn(T, H)
    routing = Routing(torch.randint(0, 4, (T, K)), torch.rand(T, K))
    d = backend.dispatch(x, routing)
    assert d.input.repeat == K and torch.equal(d.input.x, x)
    assert torch.equal(d.input.expert_ids, routing.topk_ids.reshape(-1))
    y = torch.randn(T * K, H)
    expected = weighted_sum(y, routing.topk_weights.reshape(-1), torch.arange(T).repeat_interleave(K), T)
    torch.testing.assert_close(backend.combine(y, d), expected, rtol=1e-6, atol=1e-6)
    empty = backend.dispatch(x[:0], Routing(routing.topk_ids[:0], routing.topk_weights[:0]))
    assert backend.combine(torch.empty(0, H), empty).shape == (0, H)


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block"])
def test_local_backend_dispatches_a_payload_made_before_the_routing(scheme):
    """``dispatch_payload`` (the layer's forward on CUDA makes the payload on a side stream while
    it routes) hands the experts what ``dispatch`` does: the same rows, scales, ids and weights."""
    T, K, H = 6, 3, 32
    backend = LocalBackend(BackendContext(MoEConfig(4, K, H, 16), QuantConfig(scheme)))
    x = torch.randn(T, H).to(torch.bfloat16)
    routing = Routing(torch.randint(0, 4, (T, K)), torch.rand(T, K))
    want, got = backend.dispatch(x, routing), backend.dispatch_payload(x, backend.payload(x), routing)
    a, b = want.input, got.input
    assert (a.repeat, a.padded) == (b.repeat, b.padded) and torch.equal(a.expert_ids, b.expert_ids)
    assert torch.equal(want.state.topk_weights, got.state.topk_weights)
    for u, v in ((a.x, b.x), (a.input_amax, b.input_amax)):
        if isinstance(u, torch.Tensor) or u is None:
            assert (u is None and v is None) or torch.equal(u, v)
        else:  # QuantizedActivations
            assert u.scheme == v.scheme and torch.equal(u.data.view(torch.uint8), v.data.view(torch.uint8))
            for s, t in ((u.row_scale, v.row_scale), (u.tensor_scale, v.tensor_scale)):
                assert (s is None and t is None) or torch.equal(s, t)


def test_local_backend_public_dispatches_do_not_call_each_other():
    """Checks wrap a backend's public ``dispatch`` and ``dispatch_payload`` on the instance to see
    each forward's routing (``harness.eplb``, the GPU payload test); if one called the other
    through the instance, a forward would be seen twice."""
    T, K, H = 5, 2, 16
    backend = LocalBackend(BackendContext(MoEConfig(4, K, H, 16), QuantConfig("fp8_tensor")))
    seen: list[str] = []
    for name in ("dispatch", "dispatch_payload"):
        method = getattr(backend, name)
        setattr(backend, name, lambda *a, method=method, name=name: seen.append(name) or method(*a))
    x = torch.randn(T, H).to(torch.bfloat16)
    routing = Routing(torch.randint(0, 4, (T, K)), torch.rand(T, K))
    backend.dispatch(x, routing)
    assert seen == ["dispatch"]
    seen.clear()
    backend.dispatch_payload(x, backend.payload(x), routing)
    assert seen == ["dispatch_payload"]


def test_selection_on_cpu():
    assert type(select_kernel("silu", torch.bfloat16, torch.device("cpu"), "none")) is GroupedExperts
    name, reason = kernel_choice(torch.bfloat16, "cpu", "fp8_block")
    assert name == "grouped" and "CUDA" in reason
    # Decode (a few rows per expert) takes 16-row tiles; prefill 128-row tiles.
    assert select_config(8, 256, 7168, 2048, "none").block_m == 16
    # 16 rows per expert on average: 32-row tiles, so that most experts take one tile.
    assert select_config(128, 8, 4096, 14336, "none").block_m == 32
    assert select_config(16384 * 2, 8, 4096, 14336, "none").block_m == 128
    # fp8_block steps must stay inside one 128-column scale group.
    fp8 = select_config(16384 * 2, 8, 4096, 14336, "fp8_block")
    assert 128 % fp8.gate_up.block_k == 0 and 128 % fp8.down.block_k == 0
    # Half tiles where an expert's last tile is a large share of its rows (DeepSeek-V3 and Qwen3
    # at 4096 tokens), not at Mixtral's thousands of rows per expert, where they measured slower.
    for scheme in ("none", "fp8_tensor", "fp8_block"):
        assert select_config(4096 * 8, 256, 7168, 2048, scheme).gate_up.half_tiles
        assert select_config(4096 * 8, 128, 2048, 768, scheme).gate_up.half_tiles
        assert not select_config(4096 * 2, 8, 4096, 14336, scheme).gate_up.half_tiles
        assert not select_config(16384 * 8, 256, 7168, 2048, scheme).gate_up.half_tiles
    # One token of Mixtral: two experts; narrow column tiles keep every SM busy.
    one = select_config(2, 8, 4096, 14336, "none", sms=132)
    assert 2 * (4096 // one.down.block_n) >= 132


def test_decode_tiles_take_deep_k_steps_where_they_were_measured_faster():
    """The fp8 schemes stream 16-row decode tiles with 256-column K steps (gate_up 32 columns at
    4 stages, down 64 at 3) from 16 routed rows on, where K is a multiple of 256: DeepSeek-V3,
    Mixtral and Qwen3 at 16 and 128 tokens ran 1.2-7% faster (fp8_block's steps as two scale
    groups each). One token (2 or 8 routed rows) ran slower and keeps 128-column steps (but in
    the down GEMM where it quantizes h as it loads it: ``configs.IN_DOWN_TILES``), as do
    bf16, nvfp4, the exact gate_up, 32-row tiles, a K that 256 does not divide, and 64-row tiles
    (Mixtral's 128 tokens: with 256-column steps 4-9% slower on one H200), but on an H100, where
    they ran 2.6-3.7% faster, both 64 columns wide (gate_up at 2 stages, down at 3)."""
    from moeshard.kernels.configs import DEEP_K_MIN_ROWS

    shapes = {"deepseek-v3": (256, 7168, 2048, 8), "mixtral": (8, 4096, 14336, 2), "qwen3": (128, 2048, 768, 8)}
    for scheme in ("fp8_tensor", "fp8_token", "fp8_block"):
        for name, (E, H, I, k) in shapes.items():  # noqa: E741
            for tokens in (16, 128 if name != "mixtral" else 16):
                cfg = select_config(tokens * k, E, H, I, scheme)
                assert (cfg.gate_up.block_m, cfg.gate_up.block_n, cfg.gate_up.block_k, cfg.gate_up.num_stages) == \
                    (16, 32, 256, 4), (name, tokens, cfg.gate_up)
                assert (cfg.down.block_n, cfg.down.block_k, cfg.down.num_stages) == (64, 256, 3), (name, cfg.down)
            one = select_config(k, E, H, I, scheme)
            # ... but the down GEMM that quantizes one token's per-row h as it loads it
            # (configs.IN_DOWN_TILES); one token's gate_up keeps the streaming width with
            # 256-column steps (configs._few_rows_gate_up)
            streaming_width = {"deepseek-v3": 64, "mixtral": 128, "qwen3": 32}[name]
            assert (one.gate_up.block_n, one.gate_up.block_k, one.gate_up.num_stages) == \
                (streaming_width, 256, 2 if streaming_width == 128 else 3), (name, one.gate_up)
            assert one.down.block_k == (256 if one.quantize_in_down else 128), (name, one)
        few = select_config(DEEP_K_MIN_ROWS - 1, 256, 7168, 2048, scheme).gate_up  # 15 tiles: 128 columns fill the SMs
        assert (few.block_n, few.block_k, few.num_stages) == (128, 256, 2), few
        assert select_config(4, 256, 7168 + 128, 2048, scheme).gate_up.block_k == 128  # H not a multiple of 256
        exact = select_config(128, 256, 7168, 2048, scheme, fp8_gate_up="exact")
        assert (exact.gate_up.block_k, exact.down.block_k) == (128, 256)  # the down GEMM is always fp8 MMA
        assert select_config(128, 256, 7168 + 128, 2048 + 128, scheme).gate_up.block_k == 128
        mixtral = select_config(256, 8, 4096, 14336, scheme)  # Mixtral at 128 tokens
        assert mixtral.block_m == 64 and mixtral.gate_up.block_k == mixtral.down.block_k == 128, mixtral
        h100 = select_config(256, 8, 4096, 14336, scheme, gpu="h100")
        assert (h100.block_m, h100.gate_up.block_n, h100.gate_up.block_k, h100.gate_up.num_stages) == \
            (64, 64, 256, 2), h100
        assert (h100.down.block_n, h100.down.block_k, h100.down.num_stages) == (64, 256, 3), h100
        # Everything else an H100 takes as the H200 does, but fp8_block's one-token GEMVs.
        for rows, E, H, I in ((16, 8, 4096, 14336), (2, 8, 4096, 14336), (128 * 8, 256, 7168, 2048),  # noqa: E741
                              (4096 * 2, 8, 4096, 14336), (256, 16, 4096, 14336)):
            h100, h200 = select_config(rows, E, H, I, scheme, gpu="h100"), select_config(rows, E, H, I, scheme)
            assert (h100.gemv is not None) == (scheme == "fp8_block" and rows == 2), (rows, scheme, h100.gemv)
            assert h200.gemv is None and dataclasses.replace(h100, gemv=None) == h200, (rows, scheme)
        thirty_two = select_config(256, 16, 4096, 14336, scheme)  # 16 rows per expert: 32-row tiles
        assert thirty_two.block_m == 32 and thirty_two.gate_up.block_k == thirty_two.down.block_k == 128
    for scheme in ("none", "nvfp4"):
        cfg = select_config(128, 256, 7168, 2048, scheme)
        assert cfg.gate_up.block_k <= 128 and cfg.down.block_k <= 128, (scheme, cfg)
    # Narrower where the widest would leave multiprocessors idle: two experts' down (Mixtral,
    # 2 x 4096 / 64 = 128 programs) at 32 columns.
    assert select_config(16, 2, 4096, 14336, "fp8_tensor", sms=132).down.block_n == 32
    with pytest.raises(ValueError, match=r"gpu='a100' is not one of \['h200', 'h100'\]"):
        select_config(256, 8, 4096, 14336, "fp8_tensor", gpu="a100")
    from moeshard.kernels.configs import gpu_kind
    assert gpu_kind(None) == "h200"  # no CUDA device: the tiles tuned on an H200


def test_fp8_down_tiles_follow_the_measured_choices():
    """The tiles the fp8 study measured fastest (docs/performance.md): at Mixtral's 128-token
    decode the fp8 down GEMM streams 64 x 128 tiles (the fused gate_up and bf16 keep 64 columns);
    at prefill the per-row schemes' down accumulates unpromoted in 128 x 256 tiles, fp8_block's
    down runs 64-row tiles over the 128-row plan, and the exact gate_up keeps split accumulation
    in both (64-row down tiles below 512 rows per expert)."""
    for scheme in ("fp8_tensor", "fp8_block"):
        cfg = select_config(256, 8, 4096, 14336, scheme)
        assert (cfg.block_m, cfg.gate_up.block_n, cfg.down.block_n) == (64, 64, 128)
    bf16 = select_config(256, 8, 4096, 14336, "none")
    assert (bf16.block_m, bf16.down.block_n) == (64, 64)
    mixtral = select_config(8192, 8, 4096, 14336, "fp8_tensor")
    assert (mixtral.down.block_m, mixtral.down.block_n, mixtral.down.fp8_acc) == (128, 256, "imprecise")
    deepseek = select_config(32768, 256, 7168, 2048, "fp8_token")
    assert (deepseek.block_m, deepseek.down.block_m, deepseek.down.block_n, deepseek.down.fp8_acc) == \
        (128, 128, 256, "imprecise")
    exact = select_config(32768, 256, 7168, 2048, "fp8_tensor", fp8_gate_up="exact")
    assert exact.gate_up.fp8_acc == exact.down.fp8_acc == "split"
    assert (exact.down.block_m, exact.down.block_n) == (64, 128)
    block = select_config(32768, 256, 7168, 2048, "fp8_block")
    assert (block.down.fp8_acc, block.down.block_m, block.gate_up.block_n) == ("split", 64, 128)


def test_fp8_block_gate_up_narrows_where_weight_scales_straddle_blocks():
    """fp8_block's Triton prefill gate_up: 128 x 128 x 128 where the intermediate size is a
    multiple of 128 (one weight scale per tile and K step), 64 x 128 x 128 with 8 warps and 3
    stages where it is not (gpt-oss's 2880: the taller tile's vector of scales spills, and it ran
    1.5x slower on one H100), with the down tile on the same 64-row plan and no half tiles (whose
    32 rows would sum in another order). Decode tiles and the other schemes are unchanged by it."""
    from moeshard.kernels.modes import one_w_scale_per_tile

    for M, E, H, I in [(16384, 128, 2880, 2880), (65536, 128, 2880, 2880), (32768, 8, 4096, 14400)]:
        cfg = select_config(M, E, H, I, "fp8_block")
        gate_up = cfg.gate_up
        assert (gate_up.block_m, gate_up.block_n, gate_up.block_k, gate_up.num_warps, gate_up.num_stages) == \
            (64, 128, 128, 8, 3), (M, E, H, I)
        assert cfg.block_m == cfg.down.block_m == 64 and not gate_up.half_tiles, (M, E, H, I)
        assert not one_w_scale_per_tile(3, 128, I, True)
        assert select_config(M, E, H, I, "fp8_token").gate_up.block_n == 128, (M, E, H, I)
    for M, E, H, I in [(32768, 256, 7168, 2048), (8192, 8, 4096, 14336), (32768, 128, 2048, 768)]:
        gate_up = select_config(M, E, H, I, "fp8_block").gate_up
        assert (gate_up.block_n, gate_up.num_stages) == (128, 3), (M, E, H, I)
    assert select_config(64, 128, 2880, 2880, "fp8_block").gate_up.block_m == 16  # decode keeps its tiles


def test_h_is_quantized_in_gate_up_where_it_was_measured_faster():
    """``ExpertsConfig.h_quant`` as scripts/h_quant_study.py measured it (``configs._h_quant``):
    fp8_block decode tiles 128 columns wide (Mixtral at one token; Qwen3 and DeepSeek-V3 at 128
    tokens a K that 256 does not divide keeps them) and Mixtral's prefill with its input laid
    out; the separate pass at Qwen3 and DeepSeek-V3 prefill, on narrower tiles (the 32-column
    decode tiles with 256-column K steps among them), and for every other scheme (fp8_token's row
    maxima: the test below). Without quantize_h the decode chain keeps PDL on the plan and
    gate_up only."""
    gate_up_cases = [(1024, 128, 2048 + 128, 768), (1024, 256, 7168 + 128, 2048), (2, 8, 4096, 14336),
                     (8192, 8, 4096, 14336), (32768, 8, 4096, 14336)]
    for M, E, H, I in gate_up_cases:
        assert select_config(M, E, H, I, "fp8_block").h_quant == "gate_up", (M, E, H, I)
        for scheme in ("none", "fp8_tensor", "nvfp4"):
            assert select_config(M, E, H, I, scheme).h_quant == "pass", (M, E, H, I, scheme)
        assert select_config(M, E, H, I, "fp8_token").h_quant != "gate_up", (M, E, H, I)
    for M, E, H, I in [(32768, 128, 2048, 768), (131072, 128, 2048, 768), (32768, 256, 7168, 2048),
                       (8, 256, 7168, 2048), (256, 8, 4096, 14336), (1024, 128, 2048, 768), (1024, 256, 7168, 2048)]:
        assert select_config(M, E, H, I, "fp8_block").h_quant == "pass", (M, E, H, I)
    assert select_config(1024, 128, 2048, 768, "fp8_block", pdl=True).pdl == "gate_up"
    # an intermediate size that is not a multiple of 128 keeps the pass
    assert select_config(32768, 8, 4096, 14400, "fp8_block").h_quant == "pass"


def test_row_maxima_come_from_gate_up_where_they_were_measured_faster():
    """fp8_token's ``h_quant="row_max"`` as the A/B measured it (``select_config``): decode tiles
    and the Gluon gate_up (Qwen3, Mixtral and DeepSeek-V3 prefill); the row-max pass on the Triton
    128-row prefill tile (where DeepSeek-V3 was 10-13% slower with the row maxima), and never for
    another scheme."""
    decode = [(8, 128, 2048, 768), (1024, 128, 2048, 768), (2, 8, 4096, 14336), (256, 8, 4096, 14336),
              (1024, 256, 7168, 2048)]
    gluon = [(32768, 128, 2048, 768), (131072, 128, 2048, 768), (8192, 8, 4096, 14336), (32768, 8, 4096, 14336),
             (32768, 256, 7168, 2048), (131072, 256, 7168, 2048)]
    for M, E, H, I in decode + gluon:
        cfg = select_config(M, E, H, I, "fp8_token", gluon=True, pdl=True)
        assert cfg.h_quant == "row_max", (M, E, H, I)
        for scheme in ("none", "fp8_tensor", "nvfp4"):
            assert select_config(M, E, H, I, scheme, gluon=True).h_quant == "pass", (M, E, H, I, scheme)
    # without the Gluon kernels (no Hopper GPU) the prefill's Triton tile keeps the pass, decode
    # the row maxima
    for M, E, H, I in [(32768, 256, 7168, 2048), (131072, 256, 7168, 2048), (32768, 8, 4096, 14336)]:
        cfg = select_config(M, E, H, I, "fp8_token")
        assert cfg.gate_up.engine == "triton" and cfg.h_quant == "pass", (M, E, H, I)
    assert select_config(2, 8, 4096, 14336, "fp8_token").h_quant == "row_max"
    # quantize_h still runs after gate_up: the decode chain may take it under PDL
    assert select_config(8, 128, 2048, 768, "fp8_token", pdl=True).pdl == "all"


def test_row_maxima_config_refusals(interpreted_kernels):
    with pytest.raises(ValueError, match="h_quant='row_max' takes fp8_token's row maxima.*decode_nvfp4='activations'"):
        ExpertsConfig(GemmConfig(32, 128, 128), GemmConfig(32, 128, 128), h_quant="row_max",
                      decode_nvfp4="activations")
    TritonExperts = interpreted_kernels.experts.TritonExperts
    x, ids, w = _problem(20, 2, 64, 128, torch.bfloat16, "fp8_tensor", seed=6)
    cfg = ExpertsConfig(GemmConfig(16, 64, 32), GemmConfig(16, 64, 32), h_quant="row_max")
    with pytest.raises(ValueError, match="h_quant='row_max' takes fp8_token's row maxima from the gate_up GEMM; the "
                                         "experts are fp8_tensor"):
        TritonExperts("silu", torch.bfloat16, config=cfg)(ExpertInput(x, ids), w)


def test_experts_config_refuses_down_tiles_that_do_not_divide_the_plan():
    """Both GEMMs run on one tile plan: a taller down tile would read past it (it was an illegal
    memory access on the GPU, not an error)."""
    with pytest.raises(ValueError, match="down.block_m=256 must divide gate_up.block_m=128"):
        ExpertsConfig(GemmConfig(128, 128, 64), GemmConfig(256, 64, 128))
    with pytest.raises(ValueError, match="down.block_m=48 must divide"):
        ExpertsConfig(GemmConfig(128, 128, 64), GemmConfig(48, 64, 128))
    with pytest.raises(ValueError, match="GemmConfig.fp8_acc: 'fast'"):
        GemmConfig(128, 128, 64, fp8_acc="fast")


def test_pdl_is_chosen_for_the_gpu_that_takes_it_and_refused_elsewhere(interpreted_kernels):
    """Programmatic dependent launch: ``select_config`` turns it on only when asked (the caller
    passes ``pdl.supported``), at decode only and with the same tiles: the plan and gate_up
    always, quantize_h and down too where quantize_h's grid fits in one wave (the choices the
    PDL study measured, docs/performance.md). A CPU never takes it, and a config that asks for it
    where it cannot run is refused, naming the field and the device."""
    k = interpreted_kernels
    TritonExperts, GemmConfig, ExpertsConfig = _experts_api(k)
    select = k.configs.select_config
    assert not k.pdl.supported(torch.device("cpu"))
    assert k.pdl.launch_options(False) == {}
    assert k.pdl.launch_options(True) == {"launch_pdl": True}
    # (routed rows, experts, hidden, intermediate): one token and 16 tokens of DeepSeek-V3, one of
    # Qwen3 and Mixtral, and prefill.
    deepseek_1, deepseek_16, qwen3_1, mixtral_1 = (8, 256, 7168, 2048), (128, 256, 7168, 2048), (8, 128, 2048, 768), \
        (2, 8, 4096, 14336)
    for scheme in SCHEMES:
        quantized = scheme != "none"
        for shape, chain in ((deepseek_1, "all" if quantized else "gate_up"), (qwen3_1, "all" if quantized else "gate_up"),
                             (deepseek_16, "gate_up"), (mixtral_1, "gate_up"), ((32768, 256, 7168, 2048), "off"),
                             ((8192, 8, 4096, 14336), "off")):
            off, on = select(*shape, scheme), select(*shape, scheme, pdl=True)
            assert (off.pdl, on.pdl) == ("off", chain), (scheme, shape, on.pdl)
            assert (off.gate_up, off.down) == (on.gate_up, on.down), (scheme, shape)
    assert k.configs.quantize_h_programs(128, 2048) == 128 and k.configs.quantize_h_programs(32, 14336) == 224
    gemm = GemmConfig(16, 32, 32, group_m=1)
    with pytest.raises(ValueError, match="ExpertsConfig.pdl: 'on' is not one of \\['off', 'gate_up', 'all'\\]"):
        ExpertsConfig(gemm, gemm, pdl="on")
    x, ids, w = _problem(6, 4, 64, 32, torch.bfloat16, "none", seed=0)
    with pytest.raises(ValueError, match="config.pdl='gate_up' but cpu does not take programmatic dependent launch"):
        TritonExperts("silu", torch.bfloat16, ExpertsConfig(gemm, gemm, pdl="gate_up"))(ExpertInput(x, ids), w)


def test_pdl_is_refused_on_rocm_whatever_capability_it_reports(interpreted_kernels, monkeypatch):
    """ROCm builds name their devices "cuda" and report their own capability numbers (9.4 on an
    MI300), which say nothing about NVIDIA's griddepcontrol instructions: ``pdl.supported`` must
    refuse them, and take the same numbers on an NVIDIA build."""
    pdl = interpreted_kernels.pdl
    if not hasattr(pdl.tl.extra.cuda, "gdc_wait"):
        pytest.skip("this Triton has no gdc instructions")
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 4))
    monkeypatch.setattr(torch.version, "hip", None)
    assert pdl.supported(torch.device("cuda:0"))
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")
    assert not pdl.supported(torch.device("cuda:0"))


def _bits(q) -> list[torch.Tensor]:
    return [t.view(torch.uint8) if t.element_size() == 1 else t
            for t in (q.data, q.row_scale, q.tensor_scale) if t is not None]


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("shape", [(1, 128), (1, 2304), (3, 1000), (17, 200), (3, 1008), (17, 208), (33, 384), (0, 64),
                                   (5, 0), (3, 8208)], ids=str)
def test_fused_input_quantization_equals_the_torch_path(interpreted_kernels, exact_interpreter, scheme, shape):
    """The layer's input quantized in one pass (``quantize_rows``) is bit for bit what
    ``quantize_activations`` makes: partial row blocks and scale groups (K a multiple of 16, not
    of 128), fp8_token's rows whole in registers and, past ``WHOLE_ROW`` columns (8208), in two
    passes of column steps, an all-zero row (the amax floor), magnitudes over ten decades (e4m3 subnormals,
    flushes to zero and nvfp4 blocks whose scale rounds to 0 among them), and a given domain
    amax larger than x's own, or 0, for the per-tensor schemes."""
    qr = interpreted_kernels.quant_rows
    g = torch.Generator().manual_seed(3)
    T, K = shape
    if scheme == "nvfp4" and K % 16:
        pytest.skip("nvfp4 takes K a multiple of 16 (refused: the test below)")
    x = (torch.randn(shape, generator=g) * torch.logspace(-6, 4, K or 1)[:K]).to(torch.bfloat16)
    if T > 2:
        x[2] = 0
    assert torch.equal(qr.input_amax(x), abs_amax(x, (0, 1)))
    # A domain amax of 0 takes the floor's scale, an infinite one an infinite scale (the kernel
    # computes fp8_tensor's scale itself).
    amaxes = [None, abs_amax(x, (0, 1)) * 3, torch.zeros(())] if scheme in ("fp8_tensor", "nvfp4") else [None]
    if scheme == "fp8_tensor":
        amaxes.append(torch.tensor(float("inf")))
    for amax in amaxes:
        got, want = qr.quantize_rows(x, scheme, amax=amax), quantize_activations(x, scheme, amax=amax)
        assert [t.shape for t in _bits(got)] == [t.shape for t in _bits(want)]
        assert all(torch.equal(a, b) for a, b in zip(_bits(got), _bits(want), strict=True))


def test_fp8_token_input_tiles(interpreted_kernels):
    """fp8_token's input tile (``token_tile``): whole rows of up to WHOLE_ROW columns, as many per
    program as WHOLE_ROW elements hold (Qwen3's 2048: 4; DeepSeek-V3's 7168, rounded to 8192: 1),
    no more than T needs; longer rows in 16-row programs of 128-column steps, fewer rows and wider
    steps at small T."""
    tile = interpreted_kernels.quant_rows.token_tile
    assert tile(16384, 2048) == (4, 2048, True)
    assert tile(16384, 4096) == (2, 4096, True)
    assert tile(16384, 7168) == (1, 8192, True)
    assert tile(1, 2048) == (1, 2048, True)
    assert tile(3, 100) == (4, 128, True)
    assert tile(5, 0) == (8, 1, True)
    assert tile(16384, 9000) == (16, 128, False)
    assert tile(1, 9000) == (1, 2048, False)


def test_fused_input_quantization_refuses_what_it_cannot_quantize(interpreted_kernels):
    qr = interpreted_kernels.quant_rows
    x = torch.randn(4, 40).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"quantize_rows: nvfp4 needs K % 16 == 0, got x.shape\[1\] \(K\)=40"):
        qr.quantize_rows(x, "nvfp4")
    with pytest.raises(ValueError, match=r"quantize_rows: amax must be an fp32 \[\] tensor"):
        qr.quantize_rows(x[:, :32], "nvfp4", amax=torch.ones(4, 1))
    with pytest.raises(ValueError, match="is not one of the modes"):
        qr.quantize_rows(x, "none")


def test_strided_expert_ids_are_read_as_their_values(interpreted_kernels, exact_interpreter):
    """A top-1 router's ids reach the experts as a strided view (column 0 of sorted indices
    [T, E]); the tile plan reads them as their values, not as the memory they sit in (the GPU
    check found a top-1 layer off by 3.6)."""
    TritonExperts = interpreted_kernels.experts.TritonExperts
    M, E, H, I = 40, 4, 64, 96
    x, ids, w = _problem(M, E, H, I, torch.bfloat16, "none", seed=5)
    strided = torch.stack([ids, (ids + 1) % E, (ids + 2) % E], dim=1)[:, 0]
    assert not strided.is_contiguous() and torch.equal(strided, ids)
    y = TritonExperts("silu", torch.bfloat16)(ExpertInput(x, strided), w)
    err, atol, rtol, ok = compare(y, expert_reference(x, ids, w, "silu", torch.bfloat16), torch.bfloat16, "none")
    assert ok, f"max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"



@pytest.mark.parametrize("activation, dtype", [("silu", torch.bfloat16), ("gelu", torch.float32),
                                               ("gelu_tanh", torch.float32), ("swiglu_clamped", torch.bfloat16),
                                               ("swiglu_clamped", torch.float32), ("silu_clamped", torch.bfloat16),
                                               ("swiglu_softcapped", torch.float32),
                                               ("swiglu_softcapped", torch.bfloat16)])
def test_glu_forward_and_backward_match_autograd_through_activate(interpreted_kernels, exact_interpreter,
                                                                 activation, dtype):
    """The one-pass gated activation of the experts' training forward (``kernels/glu.py``) and
    its backward against ``experts.base.activate`` and autograd through it: the same fp32
    arithmetic rounded once, so equal up to fp32 rounding of the transcendental functions (at
    most one unit in the last place of the rounded result). 37 rows and I = 300 leave partial
    row and column blocks. The clamped kinds' products reach past their limit (a third or so of
    them), and some sit exactly on it, where torch's clamp passes the gradient. The soft-capped
    kind's up products reach past its up cap (and its gate products past the gate cap), and many
    of both sit where tanh's argument is under 0.25, the kernels' polynomial branch."""
    from moeshard.activations import get_activation
    from moeshard.experts.base import activate

    glu = interpreted_kernels.glu
    gen = torch.Generator().manual_seed(11)
    limit = get_activation(activation).params.get("limit")
    gate_up = (torch.randn(37, 600, generator=gen) * (limit if limit else 3)).to(dtype)
    if limit:
        gate_up[0, :8] = torch.tensor([limit, -limit] * 4)  # gate on the bounds
        gate_up[0, 300:308] = torch.tensor([limit, -limit] * 4)  # up on the bounds
        assert float((gate_up[:, :300] > limit).float().mean()) > 0.1
    caps = get_activation(activation).params
    if "up_cap" in caps:
        gate_up[:, 300:] *= 10
        for part, cap in ((gate_up[:, :300], caps["gate_cap"]), (gate_up[:, 300:], caps["up_cap"])):
            assert float((part.abs() > cap).float().mean()) > 0.1
            assert float((part.abs() < cap / 4).float().mean()) > 0.1
    grad_h = torch.randn(37, 300, generator=gen).to(dtype)
    ref_in = gate_up.clone().requires_grad_(True)
    ref_h = activate(ref_in, activation, dtype)
    (ref_grad,) = torch.autograd.grad(ref_h, ref_in, grad_h)
    # Near a zero of act' (gelu at gate ~ -0.75) the derivative cancels: an absolute bound, of
    # the tensor's scale, covers the transcendental functions' last bits there.
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(glu.glu_forward(gate_up, activation, dtype), ref_h.detach(), rtol=rtol,
                               atol=rtol * float(ref_h.detach().abs().max()))
    grad = glu.glu_backward(gate_up, grad_h, activation)
    assert grad.dtype == dtype and grad.shape == gate_up.shape
    torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=rtol * float(ref_grad.abs().max()))
    h = glu.GatedActivation.apply(gate_up.clone().requires_grad_(True), activation, dtype)
    assert h.requires_grad
    from moeshard.activations import (
        KERNEL_MODES,
        UNGATED_KERNEL_MODES,
        ActivationKind,
        register_activation,
        unregister_activation,
    )
    register_activation(ActivationKind("portable_only", get_activation("silu").act, None, "a kind without a mode"))
    try:
        with pytest.raises(ValueError, match="'portable_only' has no kernel mode"):
            glu.glu_forward(gate_up, "portable_only", dtype)
    finally:
        unregister_activation("portable_only")
    # A new gated epilogue mode needs its training forward and derivative here; an ungated kind's
    # (h = act(up), one elementwise op) trains through torch's.
    assert glu.MODES == tuple(m for m in KERNEL_MODES if m not in UNGATED_KERNEL_MODES)
    assert glu.kernel_mode_of("relu2") is None
    with pytest.raises(ValueError, match=r"grad_h must be \[37, 300\]"):
        glu.glu_backward(gate_up, grad_h[:, :299], activation)


@pytest.mark.parametrize("K", [1, 3, 8])
def test_combine_topk_backward_matches_pair_rows_backward(interpreted_kernels, exact_interpreter, K):
    """The one-pass combine backward against the torch path (``pair_rows_backward`` on CPU):
    the rows' gradient bit for bit (one product rounded once), the weights' gradient within fp32
    summation order; H = 700 leaves a partial column block, K = 3 a padded k range."""
    from moeshard.dispatch.base import pair_rows_backward

    gen = torch.Generator().manual_seed(K)
    T, H = 5, 700
    grad_out = torch.randn(T, H, generator=gen)
    picked = torch.randn(T * K, H, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, K, generator=gen)
    got_rows, got_w = interpreted_kernels.combine.combine_topk_backward(grad_out, picked, w)
    want_rows, want_w = pair_rows_backward(grad_out, picked, w)
    assert got_rows.dtype == torch.bfloat16 and torch.equal(got_rows, want_rows)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-5)
    empty = interpreted_kernels.combine.combine_topk_backward(grad_out[:0], picked[:0], w[:0])
    assert empty[0].shape == (0, H) and empty[1].shape == (0, K)
    with pytest.raises(ValueError, match="fp32"):
        interpreted_kernels.combine.combine_topk_backward(grad_out.double(), picked, w)

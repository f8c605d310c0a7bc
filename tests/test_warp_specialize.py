"""The grouped GEMM's warp-specialized K loop (``GemmConfig.warp_specialize``): Triton's CPU
interpreter runs the kernel's logic; the GPU study times the compiled loop.

Under warp specialization the kernel cannot return early for a tile it skips (Triton 3.6's
Hopper pass fails on a loop after an early return), so such a tile runs its loop for no steps
and masks every store. These tests pin that down: the same bits as the plain loop, and nothing
written for the tiles of padding or of experts outside a window."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.quant import get_scheme, quantize_activations, quantize_weight


def _problem(scheme: str, E: int, H: int, I: int, counts: list[int], seed: int):
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(ids.numel(), H, generator=gen).to(torch.bfloat16)
    gu = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, generator=gen) / I**0.5).to(torch.bfloat16)
    if scheme == "none":
        return ids, x, ExpertWeights(gu, dn)
    return ids, quantize_activations(x, scheme), ExpertWeights(quantize_weight(gu, scheme),
                                                               quantize_weight(dn, scheme), scheme)


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_block"])
def test_the_warp_specialized_loop_gives_the_plain_loops_bits(interpreted_kernels, exact_interpreter, scheme):
    """gate_up on the laid-out input and down, both through TMA, with and without the
    warp-specialized loop: h at every used position, the per-expert amax and y bit for bit; the
    positions of tiles past the last stay unwritten (NaN) either way."""
    k = interpreted_kernels
    GemmConfig = k.configs.GemmConfig
    E, H, I = 4, 128, 96
    ids, x, w = _problem(scheme, E, H, I, [40, 30, 3, 17], seed=4)
    plan = k.align.align_rows(ids, E, 32)
    per_tensor = get_scheme(scheme).per_tensor_activation
    a = k.layout.lay_out_rows(x, plan)
    outs = {}
    for ws in (False, True):
        gemm = GemmConfig(32, 64, 32, group_m=2, num_warps=4, tma=True, warp_specialize=ws)
        amax = torch.zeros(E) if per_tensor else None
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16)
        k.grouped_gemm.moe_gemm(a, w.gate_up, plan, h, gemm, activation="silu", gather=False, amax=amax)
        h_q = h if scheme == "none" else k.quant.quantize_h(h, scheme, plan, amax)
        y = torch.full((ids.numel(), H), float("nan"), dtype=torch.bfloat16)
        k.grouped_gemm.moe_gemm(h_q, w.down, plan, y, gemm, activation=None, gather=False)
        outs[ws] = (h, amax, y)
    (h0, a0, y0), (h1, a1, y1) = outs[False], outs[True]
    used = plan.tile_expert.repeat_interleave(32) >= 0
    assert torch.equal(h0[used], h1[used]) and h1[~used].isnan().all() and h0[~used].isnan().all()
    assert a0 is None or torch.equal(a0, a1)
    assert not y1.isnan().any() and torch.equal(y0, y1)
    gemm = GemmConfig(32, 64, 32, group_m=2, num_warps=4, tma=True, warp_specialize=True)
    y_layer = k.experts.TritonExperts("silu", torch.bfloat16, k.configs.ExpertsConfig(gemm, gemm, lay_out_a=True))(
        ExpertInput(x, ids), w)
    assert torch.equal(y_layer, y0)


def test_a_skipped_tile_writes_nothing_under_warp_specialization(interpreted_kernels, exact_interpreter):
    """Decoded nvfp4 weights of a window of experts: the warp-specialized GEMMs leave every row
    of the other experts as it was (NaN), and windows covering every expert give the whole call."""
    k = interpreted_kernels
    nv = k.nvfp4_values.nvfp4_values
    gemm = k.configs.GemmConfig(16, 32, 32, group_m=1, num_warps=4, tma=True, warp_specialize=True)
    E, H, I = 4, 64, 48
    ids, x, w = _problem("nvfp4", E, H, I, [3, 5, 2, 4], seed=9)
    plan = k.align.align_rows(ids, E, 16)
    a = k.layout.lay_out_rows(nv(x), plan)
    position_expert = plan.tile_expert.repeat_interleave(16)
    h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16)
    k.grouped_gemm.moe_gemm(a, nv(w.gate_up, (1, 3)), plan, h, gemm, activation="silu", gather=False, experts=(1, 3))
    inside = (position_expert >= 1) & (position_expert < 3)
    assert not h[inside].isnan().any() and h[~inside].isnan().all()
    whole = torch.full_like(h, float("nan"))
    k.grouped_gemm.moe_gemm(a, nv(w.gate_up), plan, whole, dataclasses.replace(gemm, warp_specialize=False),
                            activation="silu", gather=False)
    assert torch.equal(h[inside], whole[inside])
    h_q = nv(k.quant.quantize_h(whole, "nvfp4", plan, whole.abs().float().amax().expand(E).contiguous()))
    y = torch.full((ids.numel(), H), float("nan"), dtype=torch.bfloat16)
    k.grouped_gemm.moe_gemm(h_q, nv(w.down, (0, 2)), plan, y, gemm, activation=None, gather=False, experts=(0, 2))
    assert y[ids >= 2].isnan().all() and not y[ids < 2].isnan().any()
    k.grouped_gemm.moe_gemm(h_q, nv(w.down, (2, 4)), plan, y, gemm, activation=None, gather=False, experts=(2, 4))
    y_plain = k.grouped_gemm.moe_gemm(h_q, nv(w.down), plan, torch.empty_like(y),
                                      dataclasses.replace(gemm, warp_specialize=False), activation=None, gather=False)
    assert torch.equal(y, y_plain)


def test_warp_specialization_is_refused_where_triton_would_not_partition_the_loop(interpreted_kernels):
    k = interpreted_kernels
    GemmConfig = k.configs.GemmConfig
    with pytest.raises(ValueError, match=r"GemmConfig.warp_specialize needs num_warps=4, tma=True and no half_tiles, "
                                         r"got num_warps=8, tma=True, half_tiles=False"):
        GemmConfig(128, 128, 64, num_warps=8, tma=True, warp_specialize=True)
    with pytest.raises(ValueError, match="got num_warps=4, tma=False"):
        GemmConfig(128, 128, 64, num_warps=4, warp_specialize=True)
    ids, x, w = _problem("none", 2, 64, 32, [5, 4], seed=1)
    plan = k.align.align_rows(ids, 2, 16)
    gemm = GemmConfig(16, 32, 32, group_m=1, num_warps=4, tma=True, warp_specialize=True)
    h = torch.empty(plan.padded_rows, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"moe_gemm: config.warp_specialize needs both operands through TMA, got A "
                                         r"through pointer loads \(gather=True\) and W through TMA"):
        k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation="silu", gather=True)

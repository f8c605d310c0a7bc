"""Ungated experts (relu2, Nemotron-H) on the Triton kernels, through Triton's interpreter: the
gate_up GEMM loads one weight tile per step and its epilogue computes h = relu(up)^2 from that
one product (``_act_one``), on every scheme, with and without TMA and expert biases, and on the
experts' other paths (h quantized by the gate_up GEMM, fp8_token's row maxima from its epilogue,
the input laid out for TMA, nvfp4 operands decoded, one token's direct tiles), against the fp64
reference; padding positions stay zero and half tiles give the whole tiles' bits. A kernel
that took the gated path (a second tile at N columns on) would read past the up rows, and one
that dropped the square would miss the reference by the products' size. The same cases run
compiled on a GPU in tests/gpu/test_ungated_cuda.py (the layer)."""

from __future__ import annotations

import pytest
import torch

from moeshard.activations import ActivationKind, register_activation, unregister_activation
from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.quant import quantize_activations, quantize_weight
from moeshard.reference import expert_reference
from moeshard.tolerances import compare

SCHEMES = ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"]
ACT = "relu2"


def _problem(M, E, H, I, scheme, bias, seed, dtype=torch.bfloat16):
    """x [M, H] (quantized for a quantized scheme), expert ids [M] and ungated ``ExpertWeights``
    (up rows [E, I, H]); about half the up products are negative (relu2 makes them 0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=gen).to(dtype)
    ids = torch.randint(0, E, (M,), generator=gen)
    ids[: M // 4] = E - 1  # one expert with several tiles, and likely an expert with none
    up = (torch.randn(E, I, H, generator=gen) * (2 / H**0.5)).to(dtype)
    dn = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
    b1 = (torch.randn(E, I, generator=gen)).to(dtype) if bias else None
    b2 = torch.randn(E, H, generator=gen).to(dtype) if bias else None
    if scheme == "none":
        return x, ids, ExpertWeights(up, dn, "none", b1, b2)
    w = ExpertWeights(quantize_weight(up, scheme), quantize_weight(dn, scheme), scheme, b1, b2)
    return quantize_activations(x, scheme), ids, w


def _reference_ok(y, x, ids, w, scheme):
    err, atol, rtol, ok = compare(y, expert_reference(x, ids, w, ACT, torch.bfloat16), torch.bfloat16, scheme)
    assert ok, f"max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_ungated_experts_match_reference(interpreted_kernels, exact_interpreter, scheme, bias, tma):
    k = interpreted_kernels
    M, E, H, I = 45, 4, 64, 96  # I = 96: the last 64-wide column tile is partial
    x, ids, w = _problem(M, E, H, I, scheme, bias, seed=7)
    gemm = k.configs.GemmConfig(16, 64, 32, group_m=2, tma=tma)
    y = k.experts.TritonExperts(ACT, torch.bfloat16, k.configs.ExpertsConfig(gemm, gemm))(ExpertInput(x, ids), w)
    _reference_ok(y, x, ids, w, scheme)
    # What a kernel without the square would give is far from it.
    register_activation(ActivationKind("relu_unsquared_k", torch.relu, None, "relu(up)", gated=False))
    try:
        relu = expert_reference(x, ids, w, "relu_unsquared_k", torch.bfloat16).out
    finally:
        unregister_activation("relu_unsquared_k")
    assert (y.double() - relu).abs().max() > 0.2 * relu.abs().max()


@pytest.mark.parametrize("scheme,options", [
    ("fp8_block", {"h_quant": "gate_up"}),  # h quantized as the gate_up GEMM stores it
    ("fp8_token", {"h_quant": "row_max"}),  # h's row maxima from the gate_up epilogue
    ("fp8_tensor", {"lay_out_a": True}),
    ("nvfp4", {"decode_nvfp4": "all", "decode_experts": 3}),  # weights decoded a window of experts at a time
    ("none", {"direct": True}),  # one token's rows, a tile each
])
def test_ungated_experts_on_every_experts_path(interpreted_kernels, exact_interpreter, scheme, options):
    k = interpreted_kernels
    direct = options.get("direct", False)
    E, H, I = 8, 128, 256
    x, ids, w = _problem(1 if direct else 45, E, H, I, scheme, True, seed=3)
    repeat = 1
    if direct:  # one token (scheme none: a model-dtype row) routed to four distinct experts
        ids, repeat = torch.tensor([6, 1, 3, 0]), 4
    inner = 128 if options.get("h_quant") == "gate_up" else 64
    gemm = k.configs.GemmConfig(16, inner, 128 if scheme == "fp8_block" else 64, group_m=2)
    cfg = k.configs.ExpertsConfig(gemm, gemm, **options)
    y = k.experts.TritonExperts(ACT, torch.bfloat16, cfg)(ExpertInput(x, ids, repeat=repeat), w)
    _reference_ok(y, x.expand(repeat, H) if direct else x, ids, w, scheme)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_ungated_gate_up_keeps_padding_rows_zero_and_half_tiles_equal(interpreted_kernels, exact_interpreter, tma):
    """h [P, I] (I columns, not 2I halves) with padding positions exactly zero, also with a bias
    (relu2 of a negative bias would be positive), and half tiles give the whole tiles' bits."""
    k = interpreted_kernels
    M, E, H, I = 90, 5, 64, 96
    x, _, w = _problem(M, E, H, I, "fp8_tensor", True, seed=13)
    ids = torch.tensor([0] * 40 + [1] * 30 + [2] * 3 + [3] * 17)[torch.randperm(M, generator=torch.Generator().manual_seed(1))]
    plan = k.align.align_rows(ids, E, 32)
    live = (plan.tile_expert >= 0).repeat_interleave(32)
    padding = live.clone()
    for e in range(E):
        padding[int(plan.start[e]):int(plan.start[e] + plan.count[e])] = False
    assert padding.sum() > 0
    outs = {}
    for half in (False, True):
        gemm = k.configs.GemmConfig(32, 64, 32, group_m=2, tma=tma, half_tiles=half)
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16)
        amax = torch.zeros(E)
        k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation=ACT, gather=True, amax=amax,
                                bias=w.gate_up_bias)
        outs[half] = (h, amax)
        assert (h[padding] == 0).all() and not h[live].isnan().any() and (h[live] >= 0).all()
    (h0, a0), (h1, a1) = outs[False], outs[True]
    assert torch.equal(h0[live], h1[live]) and torch.equal(a0, a1)

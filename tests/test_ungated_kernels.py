"""Ungated experts (relu2, Nemotron-H) on the Triton kernels, through Triton's interpreter: the
gate_up GEMM loads one weight tile per step and its epilogue computes h = relu(up)^2 from that
one product (``_act_one``). Every scheme and experts path, with and without TMA and expert
biases, runs against the fp64 reference in tests/test_kernel_epilogues.py (``relu2`` cases);
here: the output is far from what a kernel without the square gives, padding positions stay
zero with a bias and half tiles give the whole tiles' bits. A kernel that took the gated path (a
second tile at N columns on) would read past the up rows. The layer runs compiled on a GPU in
tests/gpu/test_ungated_cuda.py."""

from __future__ import annotations

import pytest
import torch
from test_kernel_epilogues import PADDED_EXPERTS, _problem, _reference_ok, gate_up_whole_and_half_tiles

from moeshard.activations import ActivationKind, register_activation, unregister_activation
from moeshard.experts.base import ExpertInput
from moeshard.reference import expert_reference

ACT = "relu2"


@pytest.mark.parametrize("scheme", ["none", "fp8_block"])
def test_ungated_experts_square_the_relu(interpreted_kernels, exact_interpreter, scheme):
    k = interpreted_kernels
    x, ids, w = _problem(45, 4, 64, 96, scheme, ACT, False, seed=7)
    gemm = k.configs.GemmConfig(16, 64, 32, group_m=2)
    y = k.experts.TritonExperts(ACT, torch.bfloat16, k.configs.ExpertsConfig(gemm, gemm))(ExpertInput(x, ids), w)
    _reference_ok(y, x, ids, w, ACT, scheme)
    register_activation(ActivationKind("relu_unsquared_k", torch.relu, None, "relu(up)", gated=False))
    try:
        relu = expert_reference(x, ids, w, "relu_unsquared_k", torch.bfloat16).out
    finally:
        unregister_activation("relu_unsquared_k")
    assert (y.double() - relu).abs().max() > 0.2 * relu.abs().max()


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_ungated_gate_up_keeps_padding_rows_zero_and_half_tiles_equal(interpreted_kernels, exact_interpreter, tma):
    """h [P, I] (I columns, not 2I halves) with padding positions exactly zero, also with a bias
    (relu2 of a negative bias would be positive), and half tiles give the whole tiles' bits."""
    I = 96
    x, _, w = _problem(len(PADDED_EXPERTS), 5, 64, I, "fp8_tensor", ACT, True, seed=13)
    for _plan, h, _amax, live in gate_up_whole_and_half_tiles(interpreted_kernels, x, w, ACT, tma, I).values():
        assert (h[live] >= 0).all()

"""The Triton GEMM epilogues' expert biases and clamped activations, through Triton's interpreter.

gpt-oss's experts carry a gate_up and a down bias and clamp both products (``swiglu_clamped``);
HY-V4's clamp them too (``silu_clamped``); Inkling 2's soft-cap both (``swiglu_softcapped``:
tanh caps of 4 on the gate and 25 on the up products); Nemotron-H's are ungated (``relu2``: one up product,
its gate_up [E, I, H]; run here with biases too). The Triton experts add the biases in the GEMMs'
epilogues and compute the activations there, so these models run on the fused kernels. Each
test runs the interpreted kernels (the ``interpreted_kernels`` fixture, tests/conftest.py) against
the reference or against the kernels' own path without the option under test; the gate_up
weights are scaled so that about a third of the products pass the activation's limit, and the
biases are of the products' size, so a bias or a clamp left out, or added twice, fails. The
same cases run on a GPU in tests/gpu/test_gpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from moeshard.activations import get_activation
from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.quant import quantize_activations, quantize_weight
from moeshard.reference import expert_reference
from moeshard.tolerances import compare

SCHEMES = ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"]


def _problem(M, E, H, I, scheme, activation, bias, seed, dtype=torch.bfloat16):
    """x [M, H] (quantized for a quantized scheme), expert ids [M] and ``ExpertWeights`` whose
    gate_up products reach past the activation's limit (the up cap for a soft-capped kind, 3 for
    the unclamped kinds)."""
    gen = torch.Generator().manual_seed(seed)
    limit = _reach(activation)
    x = torch.randn(M, H, generator=gen).to(dtype)
    ids = torch.randint(0, E, (M,), generator=gen)
    ids[: M // 4] = E - 1  # one expert with several tiles, and likely an expert with none
    P = get_activation(activation).products  # gate and up rows, or up rows alone (relu2)
    gu = (torch.randn(E, P * I, H, generator=gen) * (limit / H**0.5)).to(dtype)
    dn = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
    b13 = (torch.randn(E, P * I, generator=gen) * limit / 2).to(dtype) if bias else None
    b2 = torch.randn(E, H, generator=gen).to(dtype) if bias else None
    if scheme == "none":
        return x, ids, ExpertWeights(gu, dn, "none", b13, b2)
    w = ExpertWeights(quantize_weight(gu, scheme), quantize_weight(dn, scheme), scheme, b13, b2)
    return quantize_activations(x, scheme), ids, w


def _reach(activation: str) -> float:
    """The product size a problem reaches: the activation's limit, or its up cap."""
    params = get_activation(activation).params
    return params.get("limit", params.get("up_cap", 3.0))


def _reference_ok(y, x, ids, w, activation, scheme):
    err, atol, rtol, ok = compare(y, expert_reference(x, ids, w, activation, torch.bfloat16), torch.bfloat16, scheme)
    assert ok, f"max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"


def test_the_problem_reaches_past_the_limits():
    """The premise of every case here: a third or so of the gate_up products (the up half too)
    pass the activation's limit (or its up cap), so a kernel without the clamp or the cap differs."""
    for activation in ("swiglu_clamped", "silu_clamped", "swiglu_softcapped"):
        x, _, w = _problem(45, 4, 64, 96, "none", activation, True, seed=7)
        products = x.float() @ w.gate_up.float().flatten(0, 1).T
        assert 0.15 < float((products.abs() > _reach(activation)).float().mean()) < 0.6, activation


CASES = ([("swiglu_clamped", True, s) for s in SCHEMES] + [("silu_clamped", True, "none"),
         ("silu_clamped", False, "fp8_block"), ("silu_clamped", True, "fp8_token"), ("silu", True, "fp8_tensor"),
         ("gelu", True, "none"), ("swiglu_softcapped", False, "none"), ("swiglu_softcapped", True, "fp8_tensor"),
         ("swiglu_softcapped", False, "fp8_block")] + [("relu2", True, s) for s in SCHEMES] + [("relu2", False, "fp8_token")])


@pytest.mark.parametrize("activation,bias,scheme", CASES)
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_experts_with_biases_and_clamped_activations_match_reference(interpreted_kernels, exact_interpreter,
                                                                     activation, bias, scheme, tma):
    k = interpreted_kernels
    M, E, H, I = 45, 4, 64, 96  # I = 96: the last 64-wide column tile is partial
    x, ids, w = _problem(M, E, H, I, scheme, activation, bias, seed=7)
    gemm = k.configs.GemmConfig(16, 64, 32, group_m=2, tma=tma)
    y = k.experts.TritonExperts(activation, torch.bfloat16, k.configs.ExpertsConfig(gemm, gemm))(ExpertInput(x, ids), w)
    _reference_ok(y, x, ids, w, activation, scheme)


@pytest.mark.parametrize("scheme,options", [
    ("fp8_block", {"h_quant": "gate_up"}),  # h quantized as the gate_up GEMM stores it
    ("fp8_token", {"h_quant": "row_max"}),  # h's row maxima from the gate_up epilogue
    ("fp8_tensor", {"lay_out_a": True}),
    ("nvfp4", {"decode_nvfp4": "all", "decode_experts": 3}),  # weights decoded a window of experts at a time
    ("none", {"direct": True}),  # one token's rows, a tile each
])
@pytest.mark.parametrize("activation", ["swiglu_clamped", "relu2"])
def test_biased_experts_on_every_experts_path(interpreted_kernels, exact_interpreter, scheme, options, activation):
    """gpt-oss's experts (biases, ``swiglu_clamped``) and Nemotron-H's ungated ones (``relu2``,
    biases added here too) through the experts' other paths: the bias is read by the plan's
    expert index whatever window of weights a launch holds."""
    k = interpreted_kernels
    direct = options.get("direct", False)
    E, H, I = 8, 128, 256
    x, ids, w = _problem(1 if direct else 45, E, H, I, scheme, activation, True, seed=3)
    repeat = 1
    if direct:  # one token (scheme none: a model-dtype row) routed to four distinct experts
        ids, repeat = torch.tensor([6, 1, 3, 0]), 4
    inner = 128 if options.get("h_quant") == "gate_up" else 64
    gemm = k.configs.GemmConfig(16, inner, 128 if scheme == "fp8_block" else 64, group_m=2)
    cfg = k.configs.ExpertsConfig(gemm, gemm, **options)
    y = k.experts.TritonExperts(activation, torch.bfloat16, cfg)(ExpertInput(x, ids, repeat=repeat), w)
    _reference_ok(y, x.expand(repeat, H) if direct else x, ids, w, activation, scheme)


# Rows of 4 experts (and an empty fifth): a tile and a half tile (40), 30, 3 and 17 rows.
PADDED_EXPERTS = [0] * 40 + [1] * 30 + [2] * 3 + [3] * 17


def gate_up_whole_and_half_tiles(k, x, w, activation: str, tma: bool, I: int) -> dict:
    """The gate_up GEMM over ``PADDED_EXPERTS`` (rows shuffled) in 32-row tiles, whole and half
    (``GemmConfig.half_tiles``), with the experts' gate_up bias and a per-expert amax: checks that
    the padding positions of live tiles hold h = 0 and no live position NaN (h's memory starts as
    NaN); returns {half: (plan, h, amax, live positions)}, for the caller's further checks."""
    E = 5
    ids = torch.tensor(PADDED_EXPERTS)[torch.randperm(len(PADDED_EXPERTS), generator=torch.Generator().manual_seed(1))]
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
        k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation=activation, gather=True, amax=amax,
                                bias=w.gate_up_bias)
        assert (h[padding] == 0).all() and not h[live].isnan().any()
        outs[half] = (plan, h, amax, live)
    (_, h0, a0, _), (_, h1, a1, _) = outs[False], outs[True]
    assert torch.equal(h0[live], h1[live]) and torch.equal(a0, a1)
    return outs


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_biased_gate_up_keeps_padding_rows_zero_and_half_tiles_equal(interpreted_kernels, exact_interpreter, tma):
    """Padding positions of a live tile hold h = 0 with a bias too (the next stage reads whole
    tiles), and half tiles give the whole tiles' bits, in gate_up and in the down GEMM after it."""
    k = interpreted_kernels
    M, E, H, I = len(PADDED_EXPERTS), 5, 64, 96
    x, _, w = _problem(M, E, H, I, "fp8_tensor", "swiglu_clamped", True, seed=13)
    ys = []
    for half, (plan, h, amax, _) in gate_up_whole_and_half_tiles(k, x, w, "swiglu_clamped", tma, I).items():
        gemm = k.configs.GemmConfig(32, 64, 32, group_m=2, tma=tma, half_tiles=half)
        h_q = k.quant.quantize_h(h, "fp8_tensor", plan, amax)
        y = torch.full((M, H), float("nan"), dtype=torch.bfloat16)
        k.grouped_gemm.moe_gemm(h_q, w.down, plan, y, gemm, activation=None, gather=False, bias=w.down_bias)
        ys.append(y)
    assert not ys[1].isnan().any() and torch.equal(ys[0], ys[1])


def test_tp_shards_add_the_down_bias_once(interpreted_kernels, exact_interpreter):
    """Under TP each rank holds a slice of I and its gate_up bias slice; only TP rank 0 holds the
    down bias (the partial outputs are summed). Each shard's Triton output matches the reference
    of that shard's weights."""
    from moeshard.config import MoEConfig, QuantConfig
    from moeshard.sharding import ShardSpec, shard_experts

    k = interpreted_kernels
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=128, activation="swiglu_clamped",
                    expert_bias=True, renormalize=False, dtype=torch.bfloat16)
    x, ids, whole = _problem(37, 4, 64, 128, "none", "swiglu_clamped", True, seed=5)
    gemm = k.configs.GemmConfig(16, 64, 32)
    experts = k.experts.TritonExperts("swiglu_clamped", torch.bfloat16, k.configs.ExpertsConfig(gemm, gemm))
    for tp_rank in (0, 1):
        w = shard_experts(whole.gate_up, whole.down, cfg, QuantConfig(), ShardSpec(0, 4, tp_rank, 2),
                          whole.gate_up_bias, whole.down_bias)
        assert (w.down_bias is not None) == (tp_rank == 0) and w.gate_up_bias.shape == (4, 128)
        y = experts(ExpertInput(x, ids), w)
        _reference_ok(y, x, ids, w, "swiglu_clamped", "none")


def test_a_bias_is_added_once_after_rounding_the_product(interpreted_kernels, exact_interpreter):
    """By hand: a gate product of 1 + 2^-8 lies half-way between the bf16 values 1 and 1 + 2^-7
    and rounds to 1 (ties to even); adding a bias of 2^-8 and rounding again gives 1 once more,
    the gate the portable experts and the reference take. One fp32 sum, product and bias, would
    be 1 + 2^-7 exactly, and silu(1 + 2^-7) is another bf16 value than silu(1). One expert, one
    row, H = I = 16; the up products are 1."""
    k = interpreted_kernels
    H, I = 16, 16
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    x[0, :2] = torch.tensor([1.0, 2.0**-8])
    gu = torch.zeros(1, 2 * I, H, dtype=torch.bfloat16)
    gu[0, :I, 0], gu[0, :I, 1] = 1.0, 1.0  # every gate product 1 + 2^-8
    gu[0, I:, 0] = 1.0  # every up product 1
    b13 = torch.zeros(1, 2 * I, dtype=torch.bfloat16)
    b13[0, :I] = 2.0**-8
    plan = k.align.align_rows(torch.zeros(1, dtype=torch.int64), 1, 16)
    h = torch.empty(plan.padded_rows, I, dtype=torch.bfloat16)
    gemm = k.configs.GemmConfig(16, 16, 16)
    k.grouped_gemm.moe_gemm(x, gu, plan, h, gemm, activation="silu", gather=True, bias=b13)
    silu = torch.nn.functional.silu
    want, one_sum = silu(torch.tensor(1.0)).to(torch.bfloat16), silu(torch.tensor(1.0 + 2.0**-7)).to(torch.bfloat16)
    assert want != one_sum
    assert torch.equal(h[0], want.expand(I)), (h[0, 0].item(), want.item())


def test_moe_gemm_refuses_a_bias_it_cannot_add(interpreted_kernels):
    k = interpreted_kernels
    x, ids, w = _problem(8, 2, 32, 32, "none", "silu", True, seed=1)
    plan = k.align.align_rows(ids, 2, 16)
    h = torch.empty(plan.padded_rows, 32, dtype=torch.bfloat16)
    gemm = k.configs.GemmConfig(16, 32, 32)
    for bad in (w.gate_up_bias[:, :32], w.gate_up_bias.T.contiguous().T, w.gate_up_bias[:1]):
        with pytest.raises(ValueError, match=r"moe_gemm: bias must be a float \[E=2, N_w=64\]"):
            k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gemm, activation="silu", gather=True, bias=bad)
    gluon_tile = k.configs.GemmConfig(128, 128, 128, num_warps=8, fp8_acc="imprecise", engine="gluon")
    with pytest.raises(ValueError, match=r"engine 'gluon' .* does not take \['bias'\]"):
        k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h, gluon_tile,
                                activation="silu", gather=True, bias=w.gate_up_bias)


def test_the_kernel_constants_come_from_the_registry():
    """The epilogue reads each clamped or capped kind's parameters from its descriptor; a kind that claims a
    mode without that mode's parameters is refused at registration, naming them."""
    from moeshard.activations import KERNEL_PARAMS, ActivationKind, register_activation
    from moeshard.kernels.modes import act_constants

    assert all(len(names) <= 2 for names in KERNEL_PARAMS.values())  # the kernels take two: ACT_P0, ACT_P1

    assert act_constants("swiglu_clamped") == (1.702, 7.0)
    assert act_constants("silu_clamped") == (10.0, 0.0)  # the mode's parameters in KERNEL_PARAMS order
    assert act_constants("swiglu_softcapped") == (4.0, 25.0)
    assert act_constants("silu") == (0.0, 0.0) and act_constants(None) == (0.0, 0.0)
    with pytest.raises(ValueError, match=r"kernel_mode 3 computes with parameters \['alpha', 'limit'\], the kind has "
                                         r"\['limit'\]"):
        register_activation(ActivationKind("half_kind", get_activation("silu_clamped").act, 3, "x", {"limit": 1.0}))

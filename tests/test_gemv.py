"""One token's fp8 experts as matrix-vector products (``ExpertsConfig.gemv``, ``kernels.gemv``).

They sum exact e4m3 products in fp32 instead of on the tensor cores, so they are checked against
the reference within the scheme's tolerance (as every kernel is), and against a hand-computed row:
one expert, one weight row, whose products and scales are worked out here in float64. Planted
faults (a wrong scale group, the up rows' scale taken for the gate's) land far outside the
tolerance. Every other path of ``TritonExperts`` is unchanged by the option: its refusals are
checked by name.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeshard.activations import activation_names, get_activation
from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.quant import quantize_activations, quantize_weight
from moeshard.reference import Reference, expert_reference
from moeshard.tolerances import compare

SCHEMES = ["fp8_tensor", "fp8_token", "fp8_block"]
IDS = {"distinct": [5, 0, 3, 2], "padding": [2, -1, 0, 5], "repeated": [1, 1, 4, 0]}
# Every registered kind the GEMMs' epilogue computes: the layer takes the GEMVs for fp8_block's
# one-token rows whatever the family's activation.
KERNEL_ACTIVATIONS = [n for n in activation_names() if get_activation(n).kernel_mode is not None]


def _problem(scheme: str, H: int, I: int, E: int = 6, seed: int = 3, bias: bool = False):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16)
    biases = {}
    if bias:
        biases = {"gate_up_bias": (torch.randn(E, 2 * I, generator=g) * 0.1).to(torch.bfloat16),
                  "down_bias": (torch.randn(E, H, generator=g) * 0.1).to(torch.bfloat16)}
    w = ExpertWeights(quantize_weight(gu, scheme), quantize_weight(dn, scheme), scheme, **biases)
    x = (torch.randn(1, H, generator=g) * 3).to(torch.bfloat16)
    return x, w


def _reference(x: torch.Tensor, expert_ids: torch.Tensor, w: ExpertWeights, activation: str) -> Reference:
    """The reference of the rows whose id is not -1, each x's one row quantized as the experts
    quantize it (per-tensor amax over copies of a row is that row's)."""
    rows = expert_ids >= 0
    xq = quantize_activations(x.expand(int(rows.sum()), x.shape[1]).contiguous(), w.scheme)
    return expert_reference(xq, expert_ids[rows], w, activation, torch.bfloat16)


def _run(k, x, expert_ids, w, gemv, activation="silu"):
    """The experts' one-token call on gemv, its input quantized as the layer hands it over."""
    inp = ExpertInput(quantize_activations(x, w.scheme), expert_ids, repeat=len(expert_ids))
    return k.experts.TritonExperts(activation, torch.bfloat16, _config(k, gemv))(inp, w)


def _config(k, gemv, pdl: str = "off"):
    GemmConfig, ExpertsConfig = k.configs.GemmConfig, k.configs.ExpertsConfig
    tile = GemmConfig(16, 32, 128)
    return ExpertsConfig(tile, tile, direct=True, gemv=gemv, pdl=pdl)


# The per-row schemes take the GEMVs only where a config asks for them: their cases beyond the
# padding row run with the slow tests.
@pytest.mark.parametrize("shape, scheme, ids", [
    (shape, scheme, ids) if scheme == "fp8_block" or ids == "padding"
    else pytest.param(shape, scheme, ids, marks=pytest.mark.slow)
    for shape in ("even", "partial") for scheme in SCHEMES for ids in IDS])
def test_one_token_gemv_matches_the_reference(interpreted_kernels, exact_interpreter, scheme, ids, shape):
    """Every routed row against the reference; "partial": K not a multiple of the step (the down
    GEMV's last step masked) and N not a multiple of either block width."""
    k = interpreted_kernels
    H, I, gemv = (256, 384, k.configs.GemvConfig(16, 16, 256, 4)) if shape == "even" else \
        (384, 640, k.configs.GemvConfig(32, 8, 512, 2))  # noqa: E741
    x, w = _problem(scheme, H, I)
    expert_ids = torch.tensor(IDS[ids])
    y = _run(k, x, expert_ids, w, gemv)
    written = expert_ids >= 0
    err, atol, rtol, ok = compare(y[written], _reference(x, expert_ids, w, "silu"), torch.bfloat16, scheme)
    assert ok, f"{scheme} {ids} {shape}: max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"
    assert y[written].abs().sum() > 0


# fp8_block's one-token rows take the GEMVs (configs.ONE_TOKEN_BLOCK_GEMV), the per-row schemes'
# only where a config asks for them: their other activations run with the slow tests.
@pytest.mark.parametrize("scheme, activation", [
    (scheme, act) if scheme == "fp8_block" or act == "silu" else pytest.param(scheme, act, marks=pytest.mark.slow)
    for scheme in SCHEMES for act in KERNEL_ACTIVATIONS])
def test_one_token_gemv_takes_biases_and_every_kernel_activation(interpreted_kernels, exact_interpreter, scheme,
                                                                 activation):
    """Biases (gpt-oss's) and every activation kind with a kernel mode: the clamped and soft-capped
    kinds with products past their limits, and the ungated ones (one product per column of h)."""
    k = interpreted_kernels
    H, I = 256, 256  # noqa: E741
    x, w = _problem(scheme, H, I, bias=True)
    x = x * 2  # products up to about 20: past every kind's clamp and cap
    kind = get_activation(activation)
    if not kind.gated:
        w = ExpertWeights(quantize_weight(w.gate_up.dequantize()[:, :I].to(torch.bfloat16).contiguous(), scheme),
                          w.down, scheme, gate_up_bias=w.gate_up_bias[:, :I].contiguous(), down_bias=w.down_bias)
    expert_ids = torch.tensor([4, 1, 3])
    products = x.float() @ w.gate_up.dequantize()[expert_ids].float().transpose(1, 2)
    limits = [v for name, v in kind.params.items() if name in ("limit", "gate_cap")]
    assert products.abs().max() > max(limits, default=0.0), (activation, float(products.abs().max()), limits)
    y = _run(k, x, expert_ids, w, k.configs.GemvConfig(16, 16, 128, 4), activation)
    err, atol, rtol, ok = compare(y, _reference(x, expert_ids, w, activation), torch.bfloat16, scheme)
    assert ok, f"{scheme} {activation}: max |err| {err:.3g} > atol {atol} + rtol {rtol} |ref|"


def _hand_row(scheme: str):
    """One expert of H = I = 256 whose gate, up and down rows are all the same constant row w
    (values 1 and 2 by column, with distinct scales per 128-column group for fp8_block), and an
    input row x, with the answer worked out in float64: gate = up = dot(x, w) for every column of
    h, h = silu(gate) * gate, and y = dot(h_q, w_down) with h_q quantized as the reference does."""
    H = I = 256  # noqa: E741
    row = torch.where(torch.arange(H) < 128, 1.0, 2.0)
    gu = row.expand(2 * I, H).to(torch.bfloat16).contiguous()[None]
    dn = (row[:I] / 64).expand(H, I).to(torch.bfloat16).contiguous()[None]
    w = ExpertWeights(quantize_weight(gu, scheme), quantize_weight(dn, scheme), scheme)
    x = torch.where(torch.arange(H) % 2 == 0, 0.5, -0.25).to(torch.bfloat16)[None]
    return x, w


def _nan_after(scale: torch.Tensor, extra: int = 3) -> torch.Tensor:
    """``scale`` as a view of a buffer whose last dimension runs ``extra`` NaN groups further: a
    read past a row's last scale group sees NaN, whatever memory lies there."""
    padded = torch.full((*scale.shape[:-1], scale.shape[-1] + extra), float("nan"), dtype=scale.dtype)
    padded[..., : scale.shape[-1]] = scale
    return padded[..., : scale.shape[-1]]


def test_fp8_block_last_partial_step_reads_no_scale_past_k(interpreted_kernels, exact_interpreter):
    """fp8_block over K = 640 in 512-column steps: the last step's columns past K are zeros, and
    their groups' scales would lie past each row's five; with NaN there, the output stays finite and
    equal to the reference (it read none of them), in both GEMVs."""
    k = interpreted_kernels
    x, w = _problem("fp8_block", 640, 640)
    w = ExpertWeights(dataclasses.replace(w.gate_up, scale=_nan_after(w.gate_up.scale)),
                      dataclasses.replace(w.down, scale=_nan_after(w.down.scale)), "fp8_block")
    xq = quantize_activations(x, "fp8_block")
    xq = dataclasses.replace(xq, row_scale=_nan_after(xq.row_scale))
    ids = torch.tensor([1, 4])
    y = k.experts.TritonExperts("silu", torch.bfloat16, _config(k, k.configs.GemvConfig(16, 16, 512, 4)))(
        ExpertInput(xq, ids, repeat=2), w)
    assert torch.isfinite(y).all()
    assert compare(y, _reference(x, ids, w, "silu"), torch.bfloat16, "fp8_block")[3]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_token_gemv_on_a_hand_computed_row(interpreted_kernels, exact_interpreter, scheme):
    k = interpreted_kernels
    x, w = _hand_row(scheme)
    xq = quantize_activations(x, scheme)
    gate = float((xq.dequantize().double() * w.gate_up.dequantize()[0, 0].double()).sum())
    # 64 columns of 0.5 - 0.25 in each group: 64 * 0.25 * (1 + 2) = 48 (the values are exact in e4m3).
    assert gate == 48.0
    h = torch.tensor(gate / (1 + torch.exp(torch.tensor(-gate, dtype=torch.float64)).item()) * gate)
    h = h.to(torch.bfloat16).expand(1, 256)
    hq = quantize_activations(h, scheme)
    want = float((hq.dequantize().double() * w.down.dequantize()[0, 0].double()).sum())
    y = _run(k, x, torch.tensor([0]), w, k.configs.GemvConfig(16, 16, 256, 4))
    assert torch.equal(y, torch.full_like(y, want).to(torch.bfloat16)), (y[0, :4], want)


def test_one_token_gemv_planted_faults_fail_the_check(interpreted_kernels, exact_interpreter, monkeypatch):
    """fp8_block with each group scaled by another group's factor: the reference check fails, so
    the test above can see a wrong scale group."""
    k = interpreted_kernels
    x, w = _problem("fp8_block", 256, 256)
    s = w.gate_up.scale.clone()
    s[..., 1] *= 8.0
    s[..., 0] /= 8.0
    wrong = ExpertWeights(dataclasses.replace(w.gate_up, scale=s), w.down, "fp8_block")
    ids = torch.tensor([0, 3])
    assert compare(_run(k, x, ids, w, k.configs.GemvConfig()), _reference(x, ids, w, "silu"), torch.bfloat16,
                   "fp8_block")[3]
    y = _run(k, x, ids, wrong, k.configs.GemvConfig())
    assert not compare(y, _reference(x, ids, w, "silu"), torch.bfloat16, "fp8_block")[3]


def test_gemv_config_refuses_what_it_cannot_run(interpreted_kernels):
    k = interpreted_kernels
    GemvConfig, GemmConfig, ExpertsConfig = k.configs.GemvConfig, k.configs.GemmConfig, k.configs.ExpertsConfig
    with pytest.raises(ValueError, match=r"GemvConfig.block_k: a multiple of 128.*64"):
        GemvConfig(16, 16, 64)
    with pytest.raises(ValueError, match=r"GemvConfig.gate_up_block_n: expected a power of two, got 24"):
        GemvConfig(24, 16, 256)
    tile = GemmConfig(16, 32, 128)
    with pytest.raises(ValueError, match=r"ExpertsConfig.gemv .* needs direct=True.*direct=False"):
        ExpertsConfig(tile, tile, gemv=GemvConfig())
    x, ids = torch.randn(1, 64).to(torch.bfloat16), torch.tensor([0, 1])
    w = ExpertWeights(torch.randn(2, 128, 64).to(torch.bfloat16), torch.randn(2, 64, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"config.gemv computes fp8_tensor, fp8_token or fp8_block experts; "
                                         r"the experts are none"):
        k.experts.TritonExperts("silu", torch.bfloat16, _config(k, GemvConfig()))(ExpertInput(x, ids, repeat=2), w)


def test_gemv_kernels_refuse_mismatched_buffers(interpreted_kernels):
    k = interpreted_kernels
    gemv = k.gemv
    x, w = _problem("fp8_tensor", 256, 256)
    xq = quantize_activations(x, "fp8_tensor")
    ids = torch.tensor([0, 1])
    cfg = k.configs.GemvConfig()
    with pytest.raises(ValueError, match=r"gate_up_gemv: h must be .*\[2, 256\].*\[2, 128\]"):
        gemv.gate_up_gemv(xq, w.gate_up, ids, torch.empty(2, 128, dtype=torch.bfloat16), cfg, activation="silu",
                          x_row_div=2)
    with pytest.raises(ValueError, match=r"gate_up_gemv: amax \(per expert\) and row_amax"):
        gemv.gate_up_gemv(xq, w.gate_up, ids, torch.empty(2, 256, dtype=torch.bfloat16), cfg, activation="silu",
                          x_row_div=2, amax=torch.zeros(6), row_amax=torch.zeros(2))
    with pytest.raises(ValueError, match=r"down_gemv: fp8_tensor needs h_amax, a contiguous float32 \[6\] buffer"):
        gemv.down_gemv(torch.empty(2, 256, dtype=torch.bfloat16), w.down, ids, torch.empty(2, 256, dtype=torch.bfloat16),
                       cfg, h_amax=None)
    with pytest.raises(ValueError, match=r"gate_up_gemv: takes fp8_tensor, fp8_token or fp8_block weights"):
        gemv.gate_up_gemv(xq, w.gate_up.dequantize(), ids, torch.empty(2, 256, dtype=torch.bfloat16), cfg,
                          activation="silu", x_row_div=2)

"""``repeat``: the local backend hands the experts each token once for its K routed rows.

Routed row m of an ``ExpertInput`` (or ``Dispatched``) with ``repeat = K`` is x[m // K]. Every
consumer must give exactly what it gives for the explicitly repeated rows with ``repeat = 1``:
bit for bit, for every scheme, quantized before dispatch or deferred, in ``GroupedExperts``, in
``TritonExperts`` (Triton's CPU interpreter) and through the whole ``MoELayer``.

The Triton kernels come from the ``interpreted_kernels`` fixture (tests/conftest.py): run or fail
on CPU with triton, skipped with the reason without triton or with CUDA.
"""

from __future__ import annotations

import pytest
import torch

from moeshard.config import MoEConfig, QuantConfig
from moeshard.dispatch.base import BackendContext, Dispatched, weighted_sum
from moeshard.dispatch.local import LocalBackend
from moeshard.experts import GroupedExperts
from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.layer import MoELayer
from moeshard.presets import PRESETS
from moeshard.quant import QuantizedActivations, get_scheme, quantize_activations, quantize_weight
from moeshard.quant.schemes import BUILTIN_SCHEMES
from moeshard.router import Routing
from moeshard.weights import MoEWeights

QUANTIZED = ["fp8_tensor", "fp8_token", "fp8_block", "nvfp4"]
T, K, E, H, I = 9, 3, 5, 160, 64  # H = 160: one full and one partial 128-column fp8_block group


@pytest.fixture
def kernels(interpreted_kernels):
    """(TritonExperts, ExpertsConfig, GemmConfig, moe_gemm), interpreted."""
    k = interpreted_kernels
    return k.experts.TritonExperts, k.configs.ExpertsConfig, k.configs.GemmConfig, k.grouped_gemm.moe_gemm


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _problem(scheme: str, dtype=torch.bfloat16, seed: int = 0, h: int = H, i: int = I):
    """x [T, h] (rows of very different magnitudes, so per-row scales differ), ids [T * K] with one
    expert left empty, and the experts' weights in ``scheme``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, h, generator=g) * torch.exp(torch.randn(T, 1, generator=g))).to(dtype)
    ids = torch.randint(0, E - 1, (T * K,), generator=g)
    gu = (torch.randn(E, 2 * i, h, generator=g) / h**0.5).to(dtype)
    dn = (torch.randn(E, h, i, generator=g) / i**0.5).to(dtype)
    if scheme == "none":
        return x, ids, ExpertWeights(gu, dn)
    return x, ids, ExpertWeights(quantize_weight(gu, scheme), quantize_weight(dn, scheme), scheme)


def _expand(x, k: int = K):
    """The explicitly repeated rows: row m = x[m // k] (what ``local`` dispatched before)."""
    if isinstance(x, QuantizedActivations):
        return x.index_rows(torch.arange(x.shape[0]).repeat_interleave(k))
    return x.repeat_interleave(k, dim=0)


def _inputs(x, ids, scheme: str, mode: str) -> tuple[ExpertInput, ExpertInput]:
    """(repeat = K on x's T rows, repeat = 1 on the T * K expanded rows) for one way of quantizing.

    mode: "model" (scheme none, or deferred quantization with the layer's amax), "deferred-no-amax"
    (deferred, the experts take the amax themselves), "early" (quantized before dispatch with one
    amax), "early-row-amax" (per-tensor schemes quantized with a per-row amax [T, 1]).
    """
    per_tensor = get_scheme(scheme).per_tensor_activation
    amax = x.abs().amax().float() if per_tensor else None
    if mode == "model":
        return ExpertInput(x, ids, amax, repeat=K), ExpertInput(_expand(x), ids, amax)
    if mode == "deferred-no-amax":
        return ExpertInput(x, ids, repeat=K), ExpertInput(_expand(x), ids)
    if mode == "early-row-amax":
        amax = x.abs().amax(dim=1, keepdim=True).float()
    q = quantize_activations(x, scheme, amax=amax)
    return ExpertInput(q, ids, repeat=K), ExpertInput(_expand(q), ids)


def _modes(scheme: str) -> list[str]:
    if scheme == "none":
        return ["model"]
    modes = ["model", "deferred-no-amax", "early"]
    return modes + ["early-row-amax"] if get_scheme(scheme).per_tensor_activation else modes


CASES = [(s, m) for s in ["none", *QUANTIZED] for m in _modes(s)]


# -- the containers -----------------------------------------------------------------------------
NO_QUANT = QuantConfig()


def _local(quant: QuantConfig = NO_QUANT) -> LocalBackend:
    return LocalBackend(BackendContext(MoEConfig(E, K, 32, 16), quant))


def test_local_dispatch_keeps_tokens_unexpanded():
    x = torch.randn(T, 32)
    routing = Routing(torch.randint(0, E, (T, K)), torch.rand(T, K))
    d = _local().dispatch(x, routing)
    assert d.input.repeat == K
    assert d.input.x is x  # no copy at all
    assert torch.equal(d.input.expert_ids, routing.topk_ids.reshape(-1))
    # Quantized before dispatch: each token once, with its own row scales.
    q = _local(QuantConfig("fp8_token")).dispatch(x, routing).input
    want = quantize_activations(x, "fp8_token")
    assert q.repeat == K and isinstance(q.x, QuantizedActivations)
    assert torch.equal(_bits(q.x.data), _bits(want.data)) and torch.equal(q.x.row_scale, want.row_scale)
    # combine is unchanged: y has one row per routed row, token-major.
    y = torch.randn(T * K, 8)
    expected = weighted_sum(y, routing.topk_weights.reshape(-1), torch.arange(T).repeat_interleave(K), T)
    torch.testing.assert_close(_local().combine(y, d), expected, rtol=1e-6, atol=1e-6)
    empty = _local().dispatch(x[:0], Routing(routing.topk_ids[:0], routing.topk_weights[:0]))
    assert empty.input.repeat == K and empty.input.x.shape == (0, 32) and empty.input.expert_ids.shape == (0,)
    assert _local().combine(torch.empty(0, 8), empty).shape == (0, 8)


def test_expert_input_defaults_to_one_row_per_routed_row():
    ids = torch.zeros(4, dtype=torch.int64)
    inp = ExpertInput(torch.zeros(4, 2), ids)
    assert inp.repeat == 1 and inp.num_rows == 4
    assert ExpertInput(torch.zeros(2, 2), ids, repeat=2).num_rows == 4


@pytest.mark.parametrize("rows,repeat", [(4, 2), (3, 1), (1, 3)])
def test_expert_input_refuses_rows_that_do_not_match(rows, repeat):
    with pytest.raises(ValueError, match=f"x has {rows} rows and repeat={repeat}.*expert_ids has 4"):
        ExpertInput(torch.zeros(rows, 2), torch.zeros(4, dtype=torch.int64), repeat=repeat)


@pytest.mark.parametrize("repeat", [0, -1, 2.0, True])
def test_expert_input_refuses_a_bad_repeat(repeat):
    with pytest.raises(ValueError, match="ExpertInput.repeat"):
        ExpertInput(torch.zeros(2, 2), torch.zeros(4, dtype=torch.int64), repeat=repeat)


# -- the portable experts ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scheme,mode", CASES)
def test_grouped_experts_bit_identical(scheme, mode, dtype):
    x, ids, w = _problem(scheme, dtype)
    with_repeat, expanded = _inputs(x, ids, scheme, mode)
    experts = GroupedExperts("silu", dtype)
    y = experts(with_repeat, w)
    assert y.shape == (T * K, H) and y.dtype == dtype
    assert torch.equal(y, experts(expanded, w))


# -- the Triton experts, interpreted ----------------------------------------------------------
@pytest.mark.parametrize("scheme,mode", [("none", "model"), ("fp8_block", "early"), ("fp8_tensor", "model"),
                                         ("nvfp4", "early-row-amax")])
def test_triton_experts_bit_identical(kernels, exact_interpreter, scheme, mode):
    TritonExperts, ExpertsConfig, GemmConfig, _ = kernels
    x, ids, w = _problem(scheme, seed=1, h=64, i=48)  # I = 48: a partial 32-wide column tile
    with_repeat, expanded = _inputs(x, ids, scheme, mode)
    gemm = GemmConfig(16, 32, 32, group_m=2)
    experts = TritonExperts("silu", torch.bfloat16, ExpertsConfig(gemm, gemm))
    y = experts(with_repeat, w)
    assert torch.equal(y, experts(expanded, w))
    # And the numbers are the experts' (not, say, a row read as zeros in both runs).
    ref = GroupedExperts("silu", torch.bfloat16)(expanded, w).float()
    assert (y.float() - ref).abs().max() <= 0.1 * ref.abs().max()


def test_moe_gemm_refuses_a_row_div_it_cannot_use(kernels, interpreted_kernels):
    _, _, GemmConfig, moe_gemm = kernels
    x, ids, w = _problem("none", h=64, i=32)
    plan = interpreted_kernels.align.align_rows(ids, E, 16)
    h = torch.empty(plan.padded_rows, 32, dtype=torch.bfloat16)
    gemm = GemmConfig(16, 32, 32, group_m=1)
    with pytest.raises(ValueError, match="a has 9 rows, a_row_div=2"):
        moe_gemm(x, w.gate_up, plan, h, gemm, activation="silu", gather=True, a_row_div=2)
    with pytest.raises(ValueError, match="needs gather=True"):
        moe_gemm(h, w.down, plan, torch.empty(T * K, 64, dtype=torch.bfloat16), gemm, activation=None,
                 gather=False, a_row_div=K)


# -- the layer --------------------------------------------------------------------------------
class _ExpandingLocal(LocalBackend):
    """``local`` as it was: every routed row copied out (repeat = 1)."""

    def dispatch(self, x, routing):
        d = super().dispatch(x, routing)
        inp = d.input
        return Dispatched(ExpertInput(_expand(inp.x, inp.repeat), inp.expert_ids, inp.input_amax), d.state)


@pytest.mark.parametrize("quant", [QuantConfig(s) for s in BUILTIN_SCHEMES] + [QuantConfig(s, True) for s in QUANTIZED],
                         ids=lambda q: q.scheme + ("+defer" if q.defer_input_quant else ""))
def test_layer_output_unchanged(quant):
    cfg = PRESETS["deepseek-v3"].config("small", torch.bfloat16)
    assert cfg.top_k == 4
    g = torch.Generator().manual_seed(3)
    w = MoEWeights.random(cfg, g)
    x = torch.randn(11, cfg.hidden_size, generator=g).to(cfg.dtype)
    layer = MoELayer(cfg, quant=quant, weights=w)
    out = layer(x)
    layer.backend = _ExpandingLocal(layer.backend.ctx)
    assert torch.equal(out, layer(x))


def test_triton_experts_declare_their_accumulation(kernels):
    """fp8 schemes run (at least) the down GEMM on the fp8 tensor cores, in both gate_up modes."""
    from moeshard.numerics import ACCUMULATION

    TritonExperts = kernels[0]
    for mode in ("mma", "exact"):
        experts = TritonExperts("silu", torch.bfloat16, fp8_gate_up=mode)
        for scheme in ("fp8_tensor", "fp8_token", "fp8_block"):
            assert experts.accumulation(scheme) == ACCUMULATION["fp8_mma"]
        assert experts.accumulation("none") == experts.accumulation("nvfp4") == ACCUMULATION["fp32"]
    with pytest.raises(ValueError, match=r"fp8_gate_up 'fast' is not one of \['mma', 'exact'\]"):
        TritonExperts("silu", torch.bfloat16, fp8_gate_up="fast")


def test_repeated_rows_backward_sums_each_tokens_rows_once():
    """A training forward gathers a token's K routed rows through ``RepeatedRows``: its backward
    is the per-token sum of the K row gradients, checked by finite differences in fp64, and in
    bf16 rounded once (fp32 sum) rather than K times by atomic adds."""
    from moeshard.experts.grouped import RepeatedRows, inverse_permutation

    gen = torch.Generator().manual_seed(5)
    order = torch.randperm(T * K, generator=gen)
    x = torch.randn(T, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    inverse = inverse_permutation(order)
    assert torch.autograd.gradcheck(lambda x: RepeatedRows.apply(x, order, inverse, K), (x,))
    xb = x.detach().to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(T * K, 4, generator=gen).to(torch.bfloat16)
    (grad,) = torch.autograd.grad(RepeatedRows.apply(xb, order, inverse, K), xb, g)
    exact = torch.zeros(T, 4, dtype=torch.float64).index_add_(0, order // K, g.double())
    assert torch.equal(grad, exact.float().to(torch.bfloat16))


def test_unpadded_training_forward_matches_padded():
    """The local backend's input says it has no padding rows (``padded=False``): the training
    forward then skips the padding masks, with the same output and gradients as with them."""
    gen = torch.Generator().manual_seed(6)
    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float32) / H**0.5,
                      torch.randn(E, H, I, generator=gen, dtype=torch.float32) / I**0.5)
    ids = torch.randint(0, E, (T * K,), generator=gen)
    x = torch.randn(T, H, generator=gen, requires_grad=True)
    g = torch.randn(T * K, H, generator=gen)
    kernel = GroupedExperts("silu", torch.float32)
    results = []
    for padded in (True, False):
        inp = ExpertInput(x, ids, repeat=K, padded=padded)
        gu = w.gate_up.clone().requires_grad_(True)
        y = kernel(inp, ExpertWeights(gu, w.down))
        results.append((y, *torch.autograd.grad(y, (x, gu), g)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_permuted_rows_backward_is_the_inverse_gather():
    """The unsort of the experts' rows (``PermutedRows``): finite differences in fp64."""
    from moeshard.experts.grouped import PermutedRows, inverse_permutation

    gen = torch.Generator().manual_seed(8)
    order = torch.randperm(12, generator=gen)
    inverse = inverse_permutation(order)
    t = torch.randn(12, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.equal(PermutedRows.apply(t, inverse, order), t[inverse])
    assert torch.autograd.gradcheck(lambda t: PermutedRows.apply(t, inverse, order), (t,))

"""The reference's slack: ambiguous roundings priced exactly, nothing else let through.

* hand-computed: a gate sum exactly halfway between two bf16 values may round either way, and
  the slack is that difference through the activation times the down weight; a sum far from
  any boundary gets only the down GEMM's accumulation term;
* property: a result computed with gate_up sums that differ from the exact ones within the
  accumulation contract (as a correct kernel's do) passes ``compare``, also where flips of fp8 /
  nvfp4 buckets make it fail the table alone; a real bug (one expert scaled by 1 + 2^-5) fails;
* output roundings by hand (TP slices whose partial outputs cancel, a bias added after the
  product rounds), and on the layer: every preset within the bound at eight times the usual
  inputs, a shared expert off by a few percent outside it.
"""

from __future__ import annotations

import pytest
import torch

from moeshard.experts.base import activate
from moeshard.numerics import ACCUMULATION
from moeshard.quant import fake_quantize_activations, get_scheme, quantize_activations, quantize_weight
from moeshard.reference import Reference, expert_rows
from moeshard.tolerances import compare

BF16 = torch.bfloat16
U = ACCUMULATION["fp32"]
R = 2.0**-8  # bf16's unit roundoff


def _one_unit(gate: float, up: float, down: float):
    """H = I = 1, x = [[1]]: the gate and up sums are exactly ``gate`` and ``up``."""
    x = torch.ones(1, 1, dtype=torch.float64)
    w13 = torch.tensor([[gate], [up]], dtype=torch.float64)
    w2 = torch.tensor([[down]], dtype=torch.float64)
    return expert_rows(x, w13, w2, "silu", BF16, "none")


def _h(gate: float, up: float) -> float:
    return float(activate(torch.tensor([[gate, up]], dtype=BF16), "silu", BF16).double())


def _with_output_rounding(y: float, before: float) -> float:
    """The slack ``before`` plus what rounding the output y to bf16 may add: u (|y| + before)."""
    return before + R * (abs(y) + before)


def test_a_sum_halfway_between_bf16_values_may_round_either_way():
    halfway = 1 + 2**-8  # between the bf16 neighbours 1 and 1 + 2^-7
    y, slack = _one_unit(halfway, 1.0, 3.0)
    lo, hi = _h(1.0, 1.0), _h(1 + 2**-7, 1.0)
    assert float(y) == 3.0 * lo  # round half to even: the gate becomes 1.0
    doubt = 3.0 * abs(hi - lo) + U * 3.0 * abs(lo)
    assert float(slack) == pytest.approx(_with_output_rounding(3.0 * lo, doubt), rel=1e-12)
    assert 3.0 * abs(hi - lo) > 0.02  # a whole bf16 step of h: twice the table's bf16 atol


def test_a_sum_away_from_boundaries_gets_the_accumulation_and_the_output_rounding():
    y, slack = _one_unit(1.25, 1.0, 3.0)
    h = _h(1.25, 1.0)
    assert float(slack) == pytest.approx(_with_output_rounding(3.0 * h, U * 3.0 * abs(h)), rel=1e-12)
    assert float(slack) < 3.0 * h * 2**-7  # under a whole bf16 step of y


def _layer_like(x, w13, w2, scheme: str, noise: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """What a kernel with gate_up sums ``exact + noise`` computes (then the layer's roundings)."""
    gate_up = (x @ w13.T + noise).to(BF16)
    h = activate(gate_up, "silu", BF16)
    if scheme != "none":
        amax = h.abs().amax().float() if get_scheme(scheme).per_tensor_activation else None
        h = fake_quantize_activations(h, scheme, amax=amax)
    return (h.double() @ w2.T * scale).to(BF16)


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
def test_results_within_the_accumulation_contract_pass_and_a_bug_does_not(scheme):
    gen = torch.Generator().manual_seed(3)
    R, H, I = 512, 256, 384
    x, w13, w2 = torch.randn(R, H, generator=gen), torch.randn(2 * I, H, generator=gen) / H**0.5, \
        torch.randn(H, I, generator=gen) / I**0.5
    if scheme != "none":
        x = quantize_activations(x.to(BF16), scheme).dequantize(torch.float32)
        w13 = quantize_weight(w13.to(BF16)[None], scheme).dequantize(torch.float32)[0]
        w2 = quantize_weight(w2.to(BF16)[None], scheme).dequantize(torch.float32)[0]
    x, w13, w2 = x.double(), w13.double(), w2.double()
    y, slack = expert_rows(x, w13, w2, "silu", BF16, scheme)
    ref = Reference(y, slack)
    # Sums off by up to 90% of the contract, with random signs: a legitimate kernel.
    bound = U * (x.abs() @ w13.abs().T)
    noise = 0.9 * bound * (torch.rand(bound.shape, generator=gen, dtype=torch.float64) * 2 - 1)
    # Scaled up so that this small problem shows flips (the contract itself is tiny).
    noisy = _layer_like(x, w13, w2, scheme, noise * 2**10)
    wide = Reference(*expert_rows(x, w13, w2, "silu", BF16, scheme, accumulation=U * 2**10))
    assert compare(_layer_like(x, w13, w2, scheme, noise), ref, BF16, scheme)[3]
    assert compare(noisy, wide, BF16, scheme)[3]
    if scheme != "none":  # flips of fp8 / nvfp4 buckets exceed the table alone
        assert not compare(noisy, wide.out, BF16, scheme)[3]
    assert not compare(_layer_like(x, w13, w2, scheme, noise, scale=1 + 2**-5), ref, BF16, scheme)[3]


def test_the_layer_passes_its_kernels_accumulation_on():
    """(TritonExperts' declarations are checked in tests/test_local_repeat.py, with the kernels
    imported in interpreter mode.)"""
    from moeshard.config import QuantConfig
    from moeshard.experts import GroupedExperts
    from moeshard.layer import MoELayer
    from moeshard.presets import PRESETS

    assert GroupedExperts("silu", BF16).accumulation("fp8_block") == U
    layer = MoELayer(PRESETS["mixtral-8x7b"].config("small", BF16), quant=QuantConfig("fp8_token"))
    assert layer.accumulation == layer.kernel.accumulation("fp8_token") == U  # CPU: the portable kernel


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
def test_batched_reference_is_the_loop_over_experts_bit_for_bit(scheme):
    """reference_forward batches every expert, TP slice and slack candidate into one quantization
    pass; each element must be what a loop over experts and slices computes, bit for bit: each
    slice's h quantized alone, times its columns of the down weight, the slices' products summed."""
    from moeshard.config import MoEConfig, QuantConfig
    from moeshard.reference import DequantizedExperts, reference_forward
    from moeshard.router import route_tokens
    from moeshard.weights import MoEWeights

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=512, dtype=BF16)
    gen = torch.Generator().manual_seed(11)
    w = MoEWeights.random(cfg, gen)
    x = torch.randn(37, 256, generator=gen).to(BF16)
    shards = 2
    experts = DequantizedExperts.of(w, scheme, BF16)
    got = reference_forward(x, w, cfg, QuantConfig(scheme), intermediate_shards=shards, experts=experts)
    assert torch.equal(got.out, reference_forward(x, w, cfg, QuantConfig(scheme), intermediate_shards=shards).out)

    routing = route_tokens(x, w.gate, cfg)
    per_tensor = get_scheme(scheme).per_tensor_activation
    xq = x.double() if scheme == "none" else fake_quantize_activations(
        x, scheme, amax=x.abs().amax().float() if per_tensor else None).double()
    out, slack = torch.zeros(37, 256, dtype=torch.float64), torch.zeros(37, 256, dtype=torch.float64)
    for e in range(cfg.num_experts):
        tok, k = (routing.topk_ids == e).nonzero(as_tuple=True)
        if not tok.numel():
            continue
        w13, w2 = experts.gate_up[e], experts.down[e]
        y, s = expert_rows(xq[tok], w13, w2, "silu", BF16, scheme, shards)
        # the value, written out: each TP slice of h quantized alone, with one scalar amax
        h = activate((xq[tok] @ w13.T).to(BF16), "silu", BF16)
        slices = []
        for cols in h.split(256, dim=1):
            amax = cols.abs().amax().float() if per_tensor else None
            slices.append(cols.double() if scheme == "none" else fake_quantize_activations(cols, scheme, amax=amax).double())
        # each TP slice's partial output, summed: what the ranks' all-reduce adds
        assert torch.equal(y, torch.stack([c @ w2_s.T for c, w2_s in zip(slices, w2.chunk(shards, dim=1),
                                                                        strict=True)]).sum(dim=0))
        weight = routing.topk_weights[tok, k].double().unsqueeze(1)
        out[tok] += y * weight
        slack[tok] += s * weight.abs()
    assert torch.equal(got.out, out) and torch.equal(got.slack, slack)
    assert bool((got.slack > 0).all())


# -- tensors made inside the reference live beside its inputs ----------------------------------
@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
def test_reference_makes_its_tensors_on_the_inputs_device(scheme):
    """Why this test exists: the reference once built a group index with a bare ``torch.arange``
    (on the CPU), so with CUDA inputs every per-tensor scheme crashed in ``scatter_reduce`` —
    invisible to CI, which has no GPU. Here the inputs are CPU tensors while factory functions
    default to the meta device: any tensor the reference makes without naming the inputs' device
    lands on meta, and mixing it with the inputs raises, exactly as it would on CUDA. The results
    must be those of a plain run."""
    from moeshard import MoEConfig, QuantConfig
    from moeshard.experts.base import ExpertWeights
    from moeshard.reference import expert_reference, reference_forward
    from moeshard.weights import MoEWeights

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=128, dtype=BF16)
    w = MoEWeights.random(cfg, torch.Generator().manual_seed(0))
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).to(BF16)
    plain = reference_forward(x, w, cfg, QuantConfig(scheme))
    with torch.device("meta"):
        strayless = reference_forward(x, w, cfg, QuantConfig(scheme))
    assert torch.equal(plain.out, strayless.out) and torch.equal(plain.slack, strayless.slack)

    assert w.gate_up is not None and w.down is not None
    ew = ExpertWeights(w.gate_up, w.down) if scheme == "none" else \
        ExpertWeights(quantize_weight(w.gate_up, scheme), quantize_weight(w.down, scheme), scheme)
    xin = quantize_activations(x, scheme) if scheme != "none" else x
    ids = torch.tensor([1, 1, 3, 0, 1, 3, 3, 1, 0])
    plain = expert_reference(xin, ids, ew, "silu", BF16)
    with torch.device("meta"):
        strayless = expert_reference(xin, ids, ew, "silu", BF16)
    assert torch.equal(plain.out, strayless.out) and torch.equal(plain.slack, strayless.slack)


def _reference_inputs():
    from moeshard.presets import PRESETS
    from moeshard.weights import MoEWeights

    cfg = PRESETS["mixtral-8x7b"].config("small")
    return cfg, MoEWeights.random(cfg, torch.Generator().manual_seed(0)), torch.randn(3, cfg.hidden_size)


@pytest.mark.parametrize("change, message", [
    (lambda x, kw: (x[0], kw), "x must be [T, hidden_size="),
    (lambda x, kw: (x.long(), kw), "x must be in the model dtype"),
    # The layer refuses x in another dtype; a reference of it would be of no layer's computation.
    (lambda x, kw: (x.double(), kw), "x must be in the model dtype cfg.dtype=torch.float32, got torch.float64"),
    (lambda x, kw: (x.numpy(), kw), "x must be a torch.Tensor"),
    (lambda x, kw: (x, {**kw, "quant": "fp8_block"}), "quant must be a QuantConfig or None, got 'fp8_block'"),
    (lambda x, kw: (x, {**kw, "intermediate_shards": 0}), "intermediate_shards: must be a positive integer, got 0"),
    (lambda x, kw: (x, {**kw, "intermediate_shards": 7}), "intermediate_shards=7 does not divide"),
    (lambda x, kw: (x, {**kw, "accumulation": -1.0}), "accumulation: must be a finite number in [0, 0.0625], got -1.0"),
    (lambda x, kw: (x, {**kw, "accumulation": float("nan")}), "accumulation: must be a finite number"),
    (lambda x, kw: (x, {**kw, "input_amax": torch.tensor(-1.0)}), "input_amax must be finite and >= 0 (an amax), "
                                                                   "got -1.0"),
    (lambda x, kw: (x, {**kw, "input_amax": torch.tensor(float("inf"))}), "input_amax must be finite"),
    (lambda x, kw: (x, {**kw, "with_slack": 1}), "with_slack: must be a bool"),
])
def test_reference_forward_refuses_bad_arguments_naming_them(change, message):
    from moeshard.reference import reference_forward

    cfg, w, x = _reference_inputs()
    x, kwargs = change(x, {})
    with pytest.raises(ValueError) as info:
        reference_forward(x, w, cfg, **kwargs)
    assert message in str(info.value)


def test_each_tp_slice_rounds_its_partial_output():
    """Two TP slices whose partial outputs cancel: the sum is 0, but each slice rounds its own
    partial output (a TP rank's), so the slack keeps u (|p_0| + |p_1|)."""
    x = torch.ones(1, 1, dtype=torch.float64)
    w13 = torch.tensor([[1.25], [1.25], [1.0], [1.0]], dtype=torch.float64)  # gate rows, then up rows
    w2 = torch.tensor([[3.0, -3.0]], dtype=torch.float64)
    h = _h(1.25, 1.0)
    accumulated = U * 2 * 3.0 * h
    whole_y, whole = expert_rows(x, w13, w2, "silu", BF16, "none", shards=1)
    sliced_y, sliced = expert_rows(x, w13, w2, "silu", BF16, "none", shards=2)
    assert float(whole_y) == float(sliced_y) == 0.0
    assert float(whole) == pytest.approx(_with_output_rounding(0.0, accumulated), rel=1e-12)
    assert float(sliced) == pytest.approx(accumulated + R * (2 * 3.0 * h + accumulated), rel=1e-12)


def test_a_biased_output_rounds_twice():
    """The product rounds, then the sum with the bias: u (|p| + s) and u (|p + b| + s + that)."""
    from moeshard.reference import expert_rows_batched

    x = torch.ones(1, 1, dtype=torch.float64)
    w13 = torch.tensor([[1.25], [1.0]], dtype=torch.float64)
    w2 = torch.tensor([[3.0]], dtype=torch.float64)
    b13, b2 = torch.zeros(2, dtype=torch.float64), torch.tensor([-5.0], dtype=torch.float64)
    [(y, slack)] = expert_rows_batched([x], [w13], [w2], "silu", BF16, "none", biases=([b13], [b2]))
    p = 3.0 * _h(1.25, 1.0)
    accumulated = U * p
    first = R * (p + accumulated)
    assert float(y) == pytest.approx(p - 5.0, rel=1e-15)
    assert float(slack) == pytest.approx(accumulated + first + R * (abs(p - 5.0) + accumulated + first), rel=1e-12)


def _layer_and_inputs(preset: str, scale: float):
    from moeshard.config import QuantConfig
    from moeshard.layer import MoELayer
    from moeshard.presets import PRESETS
    from moeshard.weights import MoEWeights

    cfg = PRESETS[preset].config("small", BF16)
    weights = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(0))
    x = (torch.randn(300, cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * scale).to(BF16)
    return MoELayer(cfg, QuantConfig("none"), weights=weights), cfg, weights, x


def _presets() -> list[str]:
    from moeshard.presets import PRESETS
    return list(PRESETS)


@pytest.mark.parametrize("preset", _presets())
def test_a_correct_layer_passes_at_eight_times_the_usual_inputs(preset):
    """Larger inputs make the routed outputs larger than their cancelling sum: before the
    output roundings were priced, correct layers failed at twice the usual scale (DeepSeek-V3,
    HY-V4) and at four times (Mixtral, gpt-oss). scripts/input_scale_study.py shows the range."""
    from moeshard.reference import reference_forward
    from moeshard.tolerances import compare_rows

    layer, cfg, weights, x = _layer_and_inputs(preset, 8.0)
    c = compare_rows(layer(x), reference_forward(x, weights, cfg, accumulation=layer.accumulation), BF16, "none")
    assert c.ok, c


@pytest.mark.parametrize("preset", [p for p in _presets() if p in (
    "qwen2-57b-a14b", "deepseek-v3", "cohere2-moe", "llama4-scout", "hy-v4")])
@pytest.mark.parametrize(("scale", "fault"), [(1.0, 2**-5), (8.0, 2**-6)])
def test_a_wrong_shared_expert_fails(preset, scale, fault):
    """Planted fault: the shared experts' contribution times 1 + ``fault``. The rounding terms
    of the shared MLP, its gate and its scale must not cover it. At the usual scale 2^-5 fails
    (1.4-2.7 times the bound), while 2^-6 stays within it for the gated and the halved shared
    experts (Qwen2 0.83, Cohere2 0.95), where the table's atol (0.01) is large against outputs
    of 0.1 to 1; at eight times the scale 2^-6 fails."""
    from moeshard.reference import reference_forward
    from moeshard.tolerances import compare_rows

    layer, cfg, weights, x = _layer_and_inputs(preset, scale)
    correct = layer._shared
    layer._shared = lambda rows: correct(rows) * (1 + fault)
    c = compare_rows(layer(x), reference_forward(x, weights, cfg, accumulation=layer.accumulation), BF16, "none")
    assert not c.ok, c


def test_within_checks_every_element_against_atol_plus_rtol_times_the_reference():
    """Hand-computed: |2 - 2.1| = 0.1 is over atol 0.05 alone, within 0.05 + 0.05 * 2.1 = 0.155;
    a NaN never passes; an empty pair passes; slack widens the bound by element."""
    from moeshard.tolerances import within

    out, ref = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1])
    assert not within(out, ref, 0.05, 0.0).ok
    c = within(out, ref, 0.05, 0.05)
    assert c.ok and abs(c.max_abs_err - 0.1) < 1e-6 and abs(c.err_to_bound - 0.1 / 0.155) < 1e-6
    assert within(out, ref, 0.05, 0.0, slack=torch.tensor([0.0, 0.06])).ok
    assert not within(torch.tensor([1.0, float("nan")]), ref, 1.0, 1.0).ok
    assert within(torch.empty(0), torch.empty(0), 0.0, 0.0).ok

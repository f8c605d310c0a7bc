"""MoELayer on one device: every router x quant x dtype x token count against the reference,
transformers state dicts, quantization error bounds, refusals."""


import re

import pytest
import torch

from moeshard.config import MoEConfig, QuantConfig
from moeshard.layer import MoELayer
from moeshard.presets import PRESETS
from moeshard.quant import get_scheme
from moeshard.quant.schemes import BUILTIN_SCHEMES
from moeshard.reference import reference_forward
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights

QUANTS = [QuantConfig(s) for s in BUILTIN_SCHEMES] + [QuantConfig(s, True) for s in BUILTIN_SCHEMES[1:]]


def _inputs(cfg, T, seed):
    g = torch.Generator().manual_seed(seed)
    return MoEWeights.random(cfg, g), torch.randn(T, cfg.hidden_size, generator=g).to(cfg.dtype)


DTYPES = ("float32", "bfloat16", "float16")


def _quant_id(q: QuantConfig) -> str:
    return q.scheme + ("+defer" if q.defer_input_quant else "")


def _rotated():
    """Every (dtype, quant) pair once, the presets rotating through them (each preset, with its
    routing, activation and bias kinds, meets several schemes and dtypes), as ``moeshard check``
    rotates them; the whole product runs in ``make test-slow``."""
    names = sorted(PRESETS)
    pairs = [(d, q) for d in DTYPES for q in QUANTS]
    return [pytest.param(names[i % len(names)], d, q, id=f"{names[i % len(names)]}-{d}-{_quant_id(q)}")
            for i, (d, q) in enumerate(pairs)]


def _every():
    return [pytest.param(p, d, q, id=f"{p}-{d}-{_quant_id(q)}", marks=pytest.mark.slow)
            for p in sorted(PRESETS) for d in DTYPES for q in QUANTS]


@pytest.mark.parametrize("preset, dtype, quant", _rotated() + [p for p in _every()
                                                                if p.id not in {r.id for r in _rotated()}])
def test_layer_matches_reference(preset, dtype, quant):
    cfg = PRESETS[preset].config("small", getattr(torch, dtype))
    for T, seed in ((0, 1), (1, 2), (7, 3), (64, 4)):
        w, x = _inputs(cfg, T, seed)
        layer = MoELayer(cfg, quant=quant, weights=w)
        out = layer(x)
        assert out.shape == (T, cfg.hidden_size) and out.dtype == cfg.dtype
        err, atol, rtol, ok = compare(out, reference_forward(x, w, cfg, quant), cfg.dtype, quant.scheme)
        assert ok, f"T={T}: max error {err} over atol={atol} rtol={rtol}"


def test_unquantized_fp32_is_tight():
    cfg = PRESETS["deepseek-v3"].config("small")
    w, x = _inputs(cfg, 33, 7)
    out = MoELayer(cfg, weights=w)(x)
    assert (out.double() - reference_forward(x, w, cfg).out).abs().max() < 1e-5


@pytest.mark.parametrize("scheme", BUILTIN_SCHEMES[1:])
def test_quantization_error_is_bounded_and_not_zero(scheme):
    """The quantized layer against the unquantized one: relative RMS within the scheme's bound,
    and visibly non-zero (the weights really are quantized)."""
    cfg = PRESETS["mixtral-8x7b"].config("small")
    w, x = _inputs(cfg, 64, 11)
    plain = reference_forward(x, w, cfg).out
    out = MoELayer(cfg, quant=QuantConfig(scheme), weights=w)(x).double()
    rel = float((out - plain).pow(2).mean().sqrt() / plain.pow(2).mean().sqrt())
    assert 1e-3 < rel <= get_scheme(scheme).quant_error, rel


def test_defer_input_quant_equals_early_quantization():
    cfg = PRESETS["qwen3-30b-a3b"].config("small")
    w, x = _inputs(cfg, 20, 5)
    for scheme in BUILTIN_SCHEMES[1:]:
        early = MoELayer(cfg, quant=QuantConfig(scheme), weights=w)(x)
        late = MoELayer(cfg, quant=QuantConfig(scheme, True), weights=w)(x)
        assert torch.equal(early, late), scheme


def test_planted_bug_is_caught_by_the_reference():
    """The comparison can fail: a 2% change to one expert's weights exceeds the fp32 tolerance."""
    cfg = PRESETS["mixtral-8x7b"].config("small")
    w, x = _inputs(cfg, 64, 3)
    layer = MoELayer(cfg, weights=w)
    with torch.no_grad():
        layer.experts.down_proj[3] *= 1.02
    assert not compare(layer(x), reference_forward(x, w, cfg), cfg.dtype, "none")[3]


def _hf_block(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        c = transformers.Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
        cfg = MoEConfig(8, 2, 32, 16, renormalize=False, num_shared_experts=1, shared_intermediate_size=24,
                        shared_expert_gate=True)
        return Qwen2MoeSparseMoeBlock(c), cfg
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        c = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
        return MixtralSparseMoeBlock(c), MoEConfig(8, 2, 32, 16)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    c = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True)
    return Qwen3MoeSparseMoeBlock(c), MoEConfig(8, 2, 32, 16, renormalize=True)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_transformers_state_dict_loads_as_is(kind):
    block, cfg = _hf_block(kind)
    for p in block.parameters():  # transformers may leave some tensors uninitialised
        torch.nn.init.normal_(p, std=0.2)
    layer = MoELayer(cfg)
    layer.load_state_dict(block.state_dict())
    x = torch.randn(9, 32)
    with torch.no_grad():
        expected = block(x.unsqueeze(0))
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert torch.allclose(layer(x), expected.reshape(9, 32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor"])
def test_the_routed_experts_run_the_tensors_the_layer_holds_after_they_are_replaced(scheme):
    """Edge case from a review: the kernels' view of the routed experts was made once, so after
    ``load_state_dict(..., assign=True)`` (the way into a layer built on the meta device) the
    layer ran the new router with the old experts, silently (4.3 off the reference)."""
    cfg, quant = MoEConfig(4, 2, 32, 32), QuantConfig(scheme)
    g = torch.Generator().manual_seed(0)
    old, new = MoEWeights.random(cfg, g), MoEWeights.random(cfg, g)
    x = torch.randn(5, 32, generator=g)
    layer = MoELayer(cfg, quant=quant, weights=old)
    layer(x)  # the view of the old tensors is made
    layer.load_state_dict(MoELayer(cfg, quant=quant, weights=new).state_dict(), assign=True)
    with torch.no_grad():
        out = layer(x)
    assert compare(out, reference_forward(x, new, cfg, quant, accumulation=layer.accumulation), cfg.dtype, scheme)[3]


def test_replaced_experts_are_not_kept_alive_by_the_kernels_view():
    """After ``load_state_dict(..., assign=True)`` the layer's cached view of its experts must
    not hold the old tensors until the next forward: a model loading many layers would keep
    every old set of expert weights allocated at once."""
    import gc
    import weakref

    cfg = MoEConfig(4, 2, 32, 32)
    g = torch.Generator().manual_seed(0)
    layer = MoELayer(cfg, weights=MoEWeights.random(cfg, g))
    with torch.no_grad():
        layer(torch.randn(3, 32, generator=g))  # the view of the first tensors is made
    old = weakref.ref(layer.experts.gate_up_proj)
    layer.load_state_dict(MoELayer(cfg, weights=MoEWeights.random(cfg, g)).state_dict(), assign=True)
    gc.collect()
    assert old() is None


def test_functional_call_runs_and_differentiates_the_experts_it_is_given():
    """``torch.func.functional_call`` puts the given tensors in place of the layer's: the routed
    experts among them give the output and receive the gradient (they were ignored: the output
    was the given router's with the layer's own experts, and the experts' gradient None)."""
    from torch.func import functional_call

    cfg = MoEConfig(4, 2, 32, 32)
    g = torch.Generator().manual_seed(0)
    own, given = MoEWeights.random(cfg, g), MoEWeights.random(cfg, g)
    x = torch.randn(5, 32, generator=g)
    layer = MoELayer(cfg, weights=own)
    params = {k: v.detach().clone().requires_grad_(True)
              for k, v in MoELayer(cfg, weights=given).named_parameters()}
    out = functional_call(layer, params, (x,))
    assert compare(out.detach(), reference_forward(x, given, cfg, accumulation=layer.accumulation), cfg.dtype,
                   "none")[3]
    out.sum().backward()
    grad = params["experts.gate_up_proj"].grad
    assert grad is not None and grad.abs().max() > 0
    with torch.no_grad():  # afterwards the layer runs its own experts again
        assert compare(layer(x), reference_forward(x, own, cfg, accumulation=layer.accumulation), cfg.dtype,
                       "none")[3]


def test_from_state_dict_quantizes():
    cfg = PRESETS["deepseek-v3"].config("small")
    w, x = _inputs(cfg, 8, 9)
    layer = MoELayer.from_state_dict(w.state_dict(), cfg, quant=QuantConfig("fp8_block"))
    assert layer.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert "experts.gate_up_proj_scale" in layer.state_dict()
    assert compare(layer(x), reference_forward(x, w, cfg, QuantConfig("fp8_block")), cfg.dtype, "fp8_block")[3]


@pytest.mark.parametrize("bad,match", [
    (lambda cfg: torch.zeros(3, cfg.hidden_size + 1), r"x must be \[T, hidden_size=128\], got \(3, 129\)"),
    (lambda cfg: torch.zeros(3, cfg.hidden_size, dtype=torch.float64), r"x.dtype is torch.float64"),
    (lambda cfg: torch.zeros(cfg.hidden_size), r"got \(128,\)"),
    (lambda cfg: torch.zeros(3, cfg.hidden_size).numpy(), r"x must be a torch.Tensor .* got numpy.ndarray"),
    (lambda cfg: [[0.0] * cfg.hidden_size], r"x must be a torch.Tensor .* got builtins.list"),
])
def test_bad_input_is_refused(bad, match):
    cfg = PRESETS["mixtral-8x7b"].config("small")
    with pytest.raises(ValueError, match=match):
        MoELayer(cfg)(bad(cfg))


def test_bad_weights_are_refused():
    cfg = PRESETS["mixtral-8x7b"].config("small")
    w = MoEWeights.random(cfg)
    sd = w.state_dict()
    sd["experts.down_proj"] = sd["experts.down_proj"][:, :, :-1]
    with pytest.raises(ValueError, match=r"down: expected shape \(8, 128, 512\), got \(8, 128, 511\)"):
        MoELayer.from_state_dict(sd, cfg)
    del sd["gate.weight"]
    with pytest.raises(ValueError, match="missing tensor 'gate.weight'"):
        MoELayer.from_state_dict(sd, cfg)


def test_a_layer_given_its_routing_needs_no_router_and_one_that_routes_refuses_to_go_without():
    """``MoEExperts`` takes its ids and weights from transformers' router (ZAYA's is an MLP, with no
    [E, H] weight), so its weights may hold no router, and it holds none itself; ``MoELayer``
    routes, so weights without a router are refused by name, as is routing from them."""
    from dataclasses import replace

    from moeshard.integrations.given_routing import MoEExperts

    cfg = PRESETS["mixtral-8x7b"].config("small")
    full = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(0))
    bare = replace(full, gate=None)
    bare.validate(cfg, router=False)
    with pytest.raises(ValueError, match=r"MoEWeights.gate: missing; expected shape \(8, 128\)"):
        MoELayer(cfg, weights=bare)
    with pytest.raises(ValueError, match=r"MoEWeights.gate: missing; these weights take their routing as given"):
        bare.router_weight  # noqa: B018 - the property raises
    with pytest.raises(ValueError, match=r"MoEWeights.gate: expected shape \(8, 128\), got \(9, 128\)"):
        MoEExperts(cfg, weights=replace(full, gate=torch.zeros(9, cfg.hidden_size)))
    experts, routed = MoEExperts(cfg, weights=bare), MoEExperts(cfg, weights=full)
    assert not hasattr(experts, "gate") and not hasattr(routed, "gate")
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 3], [1, 2], [7, 0], [4, 5], [0, 0]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(experts(x, ids, weights), routed(x, ids, weights))


def test_zero_computation_experts_pass_the_row_through_scaled_by_their_weight():
    """LongCat-Flash's router picks among E routed and Z zero-computation experts: ids E .. E + Z - 1
    add weight * row (hand-computed here), the routed picks what the layer computes for them."""
    from moeshard.integrations.given_routing import MoEExperts

    cfg = PRESETS["mixtral-8x7b"].config("small")  # E = 8
    weights = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(0))
    with_identity, plain = MoEExperts(cfg, weights=weights, identity_experts=2), MoEExperts(cfg, weights=weights)
    x = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 8], [9, 8], [3, 5], [9, 1]])
    w = torch.tensor([[0.5, 0.25], [1.5, 2.0], [0.75, 0.125], [0.5, 1.0]])
    with torch.no_grad():
        got = with_identity(x, ids, w)
        routed_only = plain(x, ids.masked_fill(ids >= 8, 0), w.masked_fill(ids >= 8, 0))
    through = torch.tensor([[0.25], [3.5], [0.0], [0.5]])  # each row's zero-computation weights, summed
    torch.testing.assert_close(got, routed_only + x * through, rtol=1e-6, atol=1e-6)
    # Those picks reach the layer as empty picks (id -1), and count in no expert's load.
    assert with_identity.expert_loads().tolist() == [1, 1, 0, 1, 0, 1, 0, 0]
    with pytest.raises(ValueError, match=r"identity_experts must be an int >= 0, got -1"):
        MoEExperts(cfg, weights=weights, identity_experts=-1)


def test_unsupported_backend_is_refused_with_reason():
    cfg = PRESETS["mixtral-8x7b"].config("small")
    with pytest.raises(ValueError, match="all2all needs expert parallelism"):
        MoELayer(cfg, backend="all2all")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        MoELayer(cfg, backend="nope")


def test_zero_tokens_every_quant():
    cfg = PRESETS["deepseek-v3"].config("small", torch.bfloat16)
    for q in QUANTS:
        out = MoELayer(cfg, quant=q)(torch.zeros(0, cfg.hidden_size, dtype=torch.bfloat16))
        assert out.shape == (0, cfg.hidden_size)


def test_what_has_no_backward_is_refused_by_name_and_runs_without_grad():
    """Gradients flow wherever a backward is proved (``moeshard.autograd.support``); a
    quantized scheme and a backend without a backward are refused, naming them, when x or a
    parameter requires grad; under no_grad the same layer runs."""
    import extension_example

    cfg = PRESETS["mixtral-8x7b"].config("small")
    weights = MoEWeights.random(cfg, torch.Generator().manual_seed(0))
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for scheme in ("fp8_tensor", "fp8_token", "fp8_block", "nvfp4"):
        layer = MoELayer(cfg, quant=QuantConfig(scheme), weights=weights)
        with pytest.raises(ValueError, match=f"x requires grad, but quant '{scheme}' has no backward"):
            layer(x.clone().requires_grad_())
        layer.gate.weight.requires_grad_(True)
        with pytest.raises(ValueError, match=f"parameter 'gate.weight' requires grad, but quant '{scheme}'"):
            layer(x)
        with torch.no_grad():
            assert layer(x.clone().requires_grad_()).shape == x.shape
    extension_example.ensure_registered()
    try:
        layer = extension_example.layer(cfg, backend="local_blocks", weights=weights)
        with pytest.raises(ValueError, match="backend 'local_blocks' has no backward"):
            layer(x.clone().requires_grad_())
    finally:
        extension_example.unregister()
    layer = MoELayer(cfg, weights=weights).requires_grad_(True)
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all() and layer.experts.down_proj.grad is not None


def test_training_runs_the_portable_experts_in_place_of_the_triton_kernels():
    """The Triton expert kernels are forward only: a forward that carries gradients runs
    GroupedExperts instead; inference keeps the layer's kernel."""
    from moeshard.experts.grouped import GroupedExperts
    from moeshard.kernels.experts import TritonExperts

    class CountingTriton(TritonExperts):
        calls = 0

        def __call__(self, inp, weights):  # counts, then computes as the portable path does
            type(self).calls += 1
            return GroupedExperts.__call__(self, inp, weights)

    cfg = PRESETS["qwen3-30b-a3b"].config("small", torch.bfloat16)
    layer = MoELayer(cfg, weights=MoEWeights.random(cfg, torch.Generator().manual_seed(0)))
    layer.kernel = CountingTriton(cfg.activation, cfg.dtype)
    x = torch.randn(2, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    out.float().sum().backward()
    assert CountingTriton.calls == 0 and x.grad is not None
    with torch.no_grad():
        assert torch.equal(layer(x), out)
    assert CountingTriton.calls == 1


def test_a_backend_assigned_after_build_is_the_one_the_forward_calls():
    """``layer.backend`` may be replaced after the layer is built (the planted faults and the
    EPLB check's spies do it): the forward must call the new backend's combine, not a method
    bound when the layer was built (on CUDA the same holds for its payload methods)."""
    cfg = PRESETS["deepseek-v3"].config("small", torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    layer = MoELayer(cfg, weights=MoEWeights.random(cfg, g))
    x = torch.randn(9, cfg.hidden_size, generator=g).to(cfg.dtype)
    calls = []

    class Counting(type(layer.backend)):  # type: ignore[misc]
        def combine_final(self, *args, **kwargs):
            calls.append("combine_final")
            return super().combine_final(*args, **kwargs)

        def combine(self, *args, **kwargs):
            calls.append("combine")
            return super().combine(*args, **kwargs)

    with torch.no_grad():
        out = layer(x)
        layer.backend = Counting(layer.backend.ctx)
        assert torch.equal(layer(x), out)
    assert calls[:1] == ["combine_final"]  # (the local backend's combine_final calls its combine)


@pytest.mark.parametrize("extra", ["shared_expert.gate_proj.weight", "gate.bias", "gate.e_score_correction_bias",
                                   "experts.gate_up_projj"])
def test_from_state_dict_refuses_a_tensor_the_config_does_not_read(extra):
    """A state dict holding a shared expert (or a router bias, a correction bias, a misspelt name)
    under a config without it built a layer that silently dropped it; ``load_state_dict`` refused
    the same dict."""
    cfg = MoEConfig(4, 2, 16, 8)
    state = MoEWeights.random(cfg, torch.Generator().manual_seed(0)).state_dict()
    MoELayer.from_state_dict(state, cfg)
    with pytest.raises(ValueError, match=rf"state dict: unexpected tensor\(s\) \['{re.escape(extra)}'\]: the config "
                                         r"reads none of them \(num_shared_experts=0"):
        MoELayer.from_state_dict({**state, extra: torch.zeros(4)}, cfg)


@pytest.mark.parametrize("name, field", [("gate.weight", "gate"), ("experts.down_proj", "down")])
def test_meta_weights_are_refused_naming_the_tensor(name, field):
    """A state dict of a model built on the meta device (shapes, no data) failed inside torch's
    copy ("Cannot copy out of meta tensor") without naming the tensor."""
    cfg = MoEConfig(4, 2, 16, 8)
    state = MoEWeights.random(cfg, torch.Generator().manual_seed(0)).state_dict()
    with pytest.raises(ValueError, match=rf"MoEWeights.{field}: a meta tensor \(a shape without data\); materialise "
                                         r"the weights first"):
        MoELayer.from_state_dict({**state, name: state[name].to("meta")}, cfg)


@pytest.mark.parametrize("cast", ["bfloat16", "double"])
def test_a_layer_cast_after_it_was_built_is_refused_naming_both_dtypes(cast):
    """``MoELayer(cfg).bfloat16()`` changed the tensors, not the config the kernels follow: a
    TypeError from inside a GEMM ("activations torch.float32 and weights torch.bfloat16 differ")."""
    cfg = MoEConfig(4, 2, 16, 8)
    layer = getattr(MoELayer(cfg, weights=MoEWeights.random(cfg, torch.Generator().manual_seed(0))), cast)()
    with pytest.raises(ValueError, match=rf"the layer's experts are torch.{'float64' if cast == 'double' else cast} "
                                         r"but its cfg.dtype is torch.float32"):
        layer(torch.randn(3, 16))

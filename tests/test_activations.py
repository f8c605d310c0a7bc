"""Activation kinds are a registry read by the config, the experts, the shared experts and the
reference: hand-computed values of each built-in kind, refusals with their reason, and the kinds
beyond silu and gelu (gpt-oss's and HY-V4's clamped SwiGLUs and Gemma 4's tanh-approximate
GELU) through the layer and the reference, and a shared MLP with an
activation of its own."""

import math

import pytest
import torch

from moeshard.activations import ActivationKind, activation_names, get_activation, register_activation
from moeshard.config import MoEConfig
from moeshard.experts.base import activate
from moeshard.layer import MoELayer
from moeshard.reference import reference_forward
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights


def _sigmoid(v: float) -> float:
    return 1 / (1 + math.exp(-v))


def test_builtin_kinds_by_hand():
    gate = torch.tensor([[-1.0, 0.5, 9.0]])
    up = torch.tensor([[2.0, -8.0, 3.0]])
    silu = [g * _sigmoid(g) * u for g, u in zip(gate[0].tolist(), up[0].tolist(), strict=True)]
    gelu = [g * 0.5 * (1 + math.erf(g / math.sqrt(2))) * u for g, u in zip(gate[0].tolist(), up[0].tolist(), strict=True)]
    gelu_tanh = [g * 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
                 for g, u in zip(gate[0].tolist(), up[0].tolist(), strict=True)]
    # clamped: gate min(., 7), up clamp(-7, 7), (u + 1) * g * sigmoid(1.702 g)
    clamped = [(2.0 + 1) * -1.0 * _sigmoid(-1.702), (-7.0 + 1) * 0.5 * _sigmoid(0.851), (3.0 + 1) * 7.0 * _sigmoid(7 * 1.702)]
    # silu_clamped (HY-V4): silu(min(gate, 10)) * clamp(up, -10, 10); gate 12 and up -11 pass the limit
    silu_clamped = [-1.0 * _sigmoid(-1.0) * 2.0, 10.0 * _sigmoid(10.0) * -10.0]
    # swiglu_softcapped (Inkling 2): 4 tanh(g / 4) * sigmoid(g) * 25 tanh(u / 25); gate 9 near its cap
    softcapped = [4 * math.tanh(g / 4) * _sigmoid(g) * 25 * math.tanh(u / 25)
                  for g, u in zip(gate[0].tolist(), up[0].tolist(), strict=True)]
    assert softcapped[2] < 4 * _sigmoid(9.0) * 3.0  # the cap bites: below 4 * sigmoid(9) * 3
    for name, want, (g, u) in (("silu", silu, (gate, up)), ("gelu", gelu, (gate, up)),
                               ("swiglu_softcapped", softcapped, (gate, up)),
                               ("gelu_tanh", gelu_tanh, (gate, up)), ("swiglu_clamped", clamped, (gate, up)),
                               ("silu_clamped", silu_clamped, (torch.tensor([[-1.0, 12.0]]), torch.tensor([[2.0, -11.0]])))):
        got = activate(torch.cat([g, u], dim=1), name, torch.float32)[0].tolist()
        assert got == pytest.approx(want, rel=1e-6), name
    assert dict(get_activation("swiglu_clamped").params) == {"alpha": 1.702, "limit": 7.0}
    assert dict(get_activation("silu_clamped").params) == {"limit": 10.0}


def test_config_and_registry_refuse_with_the_values():
    with pytest.raises(ValueError, match=r"MoEConfig.activation: 'relu' is not one of \['silu', 'gelu'"):
        MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, activation="relu")
    with pytest.raises(ValueError, match="registered already"):
        register_activation(get_activation("silu"))
    with pytest.raises(ValueError, match=r"kernel_mode 0 is not a free mode"):
        register_activation(ActivationKind("silu2", get_activation("silu").act, 0, "copy"))
    assert activation_names()[:2] == ("silu", "gelu")


def test_a_kind_without_a_kernel_mode_is_refused_by_triton_with_its_reason():
    """Every built-in kind has a Triton epilogue (the ungated relu2 an ungated mode); a kind
    registered without one runs on the portable experts, and the Triton experts refuse it naming
    why."""
    from moeshard.activations import unregister_activation
    from moeshard.kernel_choice import select_kernel

    assert [name for name in activation_names() if get_activation(name).kernel_refusal() is not None] == []
    register_activation(ActivationKind("portable_only", get_activation("silu").act, None, "a kind without a mode"))
    try:
        reason = get_activation("portable_only").kernel_refusal()
        assert reason is not None and "no Triton epilogue" in reason
        assert type(select_kernel("portable_only", torch.bfloat16, torch.device("cpu"), "none")).__name__ == \
            "GroupedExperts"
        try:
            from moeshard.kernels.experts import TritonExperts
        except ImportError:
            return
        with pytest.raises(ValueError, match="TritonExperts: activation 'portable_only'.*no Triton epilogue"):
            TritonExperts("portable_only", torch.bfloat16)
    finally:
        unregister_activation("portable_only")


def test_shared_experts_run_their_own_activation():
    """``MoEConfig.shared_activation`` (HY-V4: the routed experts clamp, the shared MLP does not):
    the layer and the reference run it in the shared MLP only, and it changes the output where the
    shared products pass the routed activation's limit; a name not registered, or one without
    shared experts, is refused naming the field."""
    base = dict(num_experts=4, top_k=2, hidden_size=16, intermediate_size=32, activation="silu_clamped",
                num_shared_experts=1, shared_intermediate_size=16)
    cfg = MoEConfig(**base, shared_activation="silu")
    torch.manual_seed(0)
    w = MoEWeights.random(cfg)
    x = torch.randn(12, 16) * 40  # large enough that many gate and up products pass the limit of 10
    layer = MoELayer.from_state_dict(w.state_dict(), cfg)
    out = layer(x)
    assert compare(out, reference_forward(x, w, cfg), cfg.dtype, "none")[3]
    same = MoEConfig(**base)  # the shared MLP clamped too
    assert not torch.allclose(out, MoELayer.from_state_dict(w.state_dict(), same)(x))
    assert not compare(out, reference_forward(x, w, same), cfg.dtype, "none")[3]
    with pytest.raises(ValueError, match=r"MoEConfig.shared_activation: 'relu' is not one of"):
        MoEConfig(**base, shared_activation="relu")
    with pytest.raises(ValueError, match=r"MoEConfig.shared_activation: 'silu' needs num_shared_experts > 0"):
        MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=32, shared_activation="silu")


@pytest.mark.parametrize("activation", ["swiglu_clamped", "gelu_tanh", "silu_clamped"])
def test_kinds_beyond_silu_and_gelu_through_layer_and_reference(activation):
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=32, activation=activation,
                    num_shared_experts=1, shared_intermediate_size=16)
    torch.manual_seed(0)
    w = MoEWeights.random(cfg)
    x = torch.randn(12, 16) * 4  # large enough that some gate and up products pass the limit
    layer = MoELayer.from_state_dict(w.state_dict(), cfg)
    ok = compare(layer(x), reference_forward(x, w, cfg), cfg.dtype, "none")[3]
    assert ok


def test_ungated_relu2_by_hand_and_its_refusals():
    """relu2 (Nemotron-H): h = relu(up)^2 on up products alone; the experts' first weight holds
    I rows, not 2I. Refused by name: calling it as a GLU, an ungated kind with a gated kernel mode
    (or a gated kind with an ungated one), and ungated shared experts (the shared MLP is a gated one)."""
    kind = get_activation("relu2")
    assert not kind.gated and kind.products == 1 and get_activation("silu").products == 2
    up = torch.tensor([[-2.0, 0.0, 0.5, 3.0]])
    assert activate(up, "relu2", torch.float32)[0].tolist() == [0.0, 0.0, 0.25, 9.0]
    with pytest.raises(TypeError, match="'relu2' is ungated: call apply"):
        kind(up, up)
    with pytest.raises(ValueError, match=r"an ungated kind needs an ungated mode of \[32\] or None, got kernel_mode 3"):
        register_activation(ActivationKind("relu2_mode", kind.act, 3, "copy", {"alpha": 1.0, "limit": 1.0},
                                           gated=False))
    with pytest.raises(ValueError, match=r"a gated kind needs a gated mode \(below 32\) or None, got kernel_mode 32"):
        register_activation(ActivationKind("glu_mode32", get_activation("silu").act, 32, "copy"))
    with pytest.raises(ValueError, match="gated must be True or False, got 1"):
        register_activation(ActivationKind("half_gated", kind.act, None, "copy", gated=1))
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, activation="relu2")
    assert cfg.gate_up_size == 16 and MoEWeights.random(cfg).gate_up.shape == (4, 16, 8)
    with pytest.raises(ValueError, match=r"MoEConfig.activation: 'relu2' is ungated, but the shared experts "
                                         r"\(num_shared_experts=1\) are gated MLPs"):
        MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, activation="relu2",
                  num_shared_experts=1, shared_intermediate_size=8)
    ok = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, activation="relu2",
                   num_shared_experts=1, shared_intermediate_size=8, shared_activation="silu")
    assert ok.shared_act == "silu"

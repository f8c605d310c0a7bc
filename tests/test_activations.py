"""Activation kinds are a registry read by the config, the experts, the shared experts and the
reference: hand-computed values of each built-in kind, refusals with their reason, and the kinds
beyond silu and gelu (gpt-oss's clamped SwiGLU, without a Triton epilogue, and Gemma 4's
tanh-approximate GELU) through the layer and the reference."""

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
    gate_up = torch.cat([gate, up], dim=1)
    for name, want in (("silu", silu), ("gelu", gelu), ("gelu_tanh", gelu_tanh), ("swiglu_clamped", clamped)):
        got = activate(gate_up, name, torch.float32)[0].tolist()
        assert got == pytest.approx(want, rel=1e-6), name
    assert dict(get_activation("swiglu_clamped").params) == {"alpha": 1.702, "limit": 7.0}


def test_config_and_registry_refuse_with_the_values():
    with pytest.raises(ValueError, match=r"MoEConfig.activation: 'relu' is not one of \['silu', 'gelu'"):
        MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, activation="relu")
    with pytest.raises(ValueError, match="registered already"):
        register_activation(get_activation("silu"))
    with pytest.raises(ValueError, match=r"kernel_mode 0 is not a free mode"):
        register_activation(ActivationKind("silu2", get_activation("silu").act, 0, "copy"))
    assert activation_names()[:2] == ("silu", "gelu")


def test_a_kind_without_a_kernel_mode_is_refused_by_triton_with_its_reason():
    reason = get_activation("swiglu_clamped").kernel_refusal()
    assert reason is not None and "no Triton epilogue" in reason and get_activation("silu").kernel_refusal() is None
    try:
        from moeshard.kernels.experts import TritonExperts
    except ImportError:
        return
    with pytest.raises(ValueError, match="TritonExperts: activation 'swiglu_clamped'.*no Triton epilogue"):
        TritonExperts("swiglu_clamped", torch.bfloat16)


@pytest.mark.parametrize("activation", ["swiglu_clamped", "gelu_tanh"])
def test_kinds_beyond_silu_and_gelu_through_layer_and_reference(activation):
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=32, activation=activation,
                    num_shared_experts=1, shared_intermediate_size=16)
    torch.manual_seed(0)
    w = MoEWeights.random(cfg)
    x = torch.randn(12, 16) * 4  # large enough that some gate and up products pass the limit
    layer = MoELayer.from_state_dict(w.state_dict(), cfg)
    ok = compare(layer(x), reference_forward(x, w, cfg), cfg.dtype, "none")[3]
    assert ok

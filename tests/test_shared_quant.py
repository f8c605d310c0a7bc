"""Quantized shared experts (``QuantConfig.shared``): the shared MLP run as one quantized expert,
against the reference that quantizes it the same way; refusals; no stale quantized weights."""

from __future__ import annotations

import pytest
import torch

from moeshard.config import QuantConfig
from moeshard.layer import MoELayer
from moeshard.presets import PRESETS
from moeshard.reference import reference_forward
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights

SHARED = [QuantConfig("fp8_block", shared="fp8_block"), QuantConfig("fp8_tensor", shared="fp8_token"),
          QuantConfig("nvfp4", shared="fp8_block")]
# Every preset with shared experts: DeepSeek's, Qwen2-MoE's sigmoid-gated one, Cohere2's scaled one, ...
WITH_SHARED = sorted(name for name in PRESETS if PRESETS[name].config("small").has_shared_experts)


def _inputs(cfg, T, seed):
    g = torch.Generator().manual_seed(seed)
    return MoEWeights.random(cfg, g), torch.randn(T, cfg.hidden_size, generator=g).to(cfg.dtype)


@pytest.mark.parametrize("preset", WITH_SHARED)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_with_quantized_shared_experts_matches_the_reference(preset, dtype):
    cfg = PRESETS[preset].config("small", getattr(torch, dtype))
    quant = SHARED[(WITH_SHARED.index(preset) + (dtype == "bfloat16")) % len(SHARED)]
    for T, seed in ((0, 1), (1, 2), (7, 3), (64, 4)):
        w, x = _inputs(cfg, T, seed)
        layer = MoELayer(cfg, quant=quant, weights=w)
        out = layer(x)
        assert out.shape == (T, cfg.hidden_size) and out.dtype == cfg.dtype
        err, atol, rtol, ok = compare(out, reference_forward(x, w, cfg, quant, accumulation=layer.accumulation),
                                      cfg.dtype, quant.scheme)
        assert ok, f"{quant.name} T={T}: max error {err} over atol={atol} rtol={rtol}"


@pytest.mark.parametrize("quant", SHARED[:2], ids=lambda q: q.name)
def test_the_reference_tells_quantized_from_model_dtype_shared_experts(quant):
    """The comparison can fail both ways: the layer with quantized shared experts against the
    reference of model-dtype ones, and the other way round. The shared output moves by the
    scheme's quantization error, well beyond the tolerance."""
    cfg = PRESETS["deepseek-v3"].config("small")
    w, x = _inputs(cfg, 64, 5)
    plain = QuantConfig(quant.scheme)
    quantized_out = MoELayer(cfg, quant=quant, weights=w)(x)
    plain_out = MoELayer(cfg, quant=plain, weights=w)(x)
    assert compare(quantized_out, reference_forward(x, w, cfg, quant), cfg.dtype, quant.scheme)[3]
    assert not compare(quantized_out, reference_forward(x, w, cfg, plain), cfg.dtype, quant.scheme)[3]
    assert not compare(plain_out, reference_forward(x, w, cfg, quant), cfg.dtype, quant.scheme)[3]


def test_loading_new_weights_requantizes_the_shared_experts():
    """The quantized shared weights are made from the model-dtype parameters, and again after
    ``load_state_dict`` writes them in place: never the stale ones of the first forward."""
    cfg = PRESETS["deepseek-v3"].config("small")
    quant = QuantConfig("fp8_block", shared="fp8_block")
    w1, x = _inputs(cfg, 16, 6)
    w2, _ = _inputs(cfg, 0, 7)
    layer = MoELayer(cfg, quant=quant, weights=w1)
    first = layer(x)
    fresh = MoELayer(cfg, quant=quant, weights=w2)
    layer.load_state_dict(fresh.state_dict())
    assert torch.equal(layer(x), fresh(x))
    assert not torch.equal(layer(x), first)


def test_quantized_shared_experts_keep_the_model_dtype_state_dict():
    """The state dict holds the shared MLP's model-dtype weights under transformers' names (a
    checkpoint loads as it is); the quantized copies are not saved."""
    cfg = PRESETS["deepseek-v3"].config("small", torch.bfloat16)
    w, _ = _inputs(cfg, 0, 8)
    state = MoELayer(cfg, quant=QuantConfig("fp8_block", shared="fp8_block"), weights=w).state_dict()
    shared = {k: v for k, v in state.items() if k.startswith("shared_experts.")}
    assert sorted(shared) == ["shared_experts.down_proj.weight", "shared_experts.gate_proj.weight",
                              "shared_experts.up_proj.weight"]
    assert all(v.dtype == torch.bfloat16 for v in shared.values())
    assert torch.equal(shared["shared_experts.gate_proj.weight"], w.shared_gate.to(torch.bfloat16))


@pytest.mark.parametrize("kwargs, match", [
    ({"scheme": "none", "shared": "fp8_block"}, r"QuantConfig.shared: 'fp8_block' with scheme='none'"),
    ({"scheme": "fp8_block", "shared": "fp8_tensor"}, r"QuantConfig.shared: 'fp8_tensor' takes one activation scale "
                                                      r"per tensor; .* would depend on the layout"),
    ({"scheme": "fp8_block", "shared": "nvfp4"}, r"QuantConfig.shared: 'nvfp4' takes one activation scale per tensor"),
    ({"scheme": "fp8_block", "shared": "int3"}, r"QuantConfig.shared"),
])
def test_a_shared_scheme_that_cannot_run_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_quantized_shared_experts_without_shared_experts_are_refused():
    cfg = PRESETS["mixtral-8x7b"].config("small")
    w, x = _inputs(cfg, 4, 9)
    quant = QuantConfig("fp8_block", shared="fp8_block")
    with pytest.raises(ValueError, match=r"MoELayer \(rank 0\): QuantConfig.shared='fp8_block', but the model has no "
                                         r"shared experts \(num_shared_experts=0\)"):
        MoELayer(cfg, quant=quant, weights=w)
    with pytest.raises(ValueError, match=r"reference_forward: QuantConfig.shared='fp8_block', but the model has no "
                                         r"shared"):
        reference_forward(x, w, cfg, quant)


def test_run_takes_shared_quant_and_refuses_it_before_any_rank_starts(capsys):
    from moeshard.cli import main

    assert main(["run", "--random", "deepseek-v3", "--quant", "fp8_block", "--shared-quant", "fp8_block", "--tp", "2",
                 "--tokens", "5"]) == 0
    assert "shared experts fp8_block" in " ".join(capsys.readouterr().out.split())
    assert main(["run", "--random", "mixtral-8x7b", "--quant", "fp8_block", "--shared-quant", "fp8_token", "--tp", "2",
                 "--tokens", "5"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert ("--shared-quant: QuantConfig.shared='fp8_token', but the model has no shared experts "
            "(num_shared_experts=0)") in err and "rank" not in err


def test_the_shared_schemes_offered_are_the_ones_quant_config_takes():
    """The CLI's and the bench's choices for --shared-quant come from the scheme registry:
    exactly the schemes QuantConfig.shared accepts."""
    from moeshard.bench.runner import BenchOptions
    from moeshard.config import shared_schemes
    from moeshard.quant.schemes import scheme_names

    assert shared_schemes() == ("fp8_token", "fp8_block")
    for s in scheme_names():
        if s in shared_schemes():
            QuantConfig("fp8_tensor", shared=s)
            BenchOptions(shared_quant=s).validate()
        elif s != "none":
            with pytest.raises(ValueError, match="QuantConfig.shared"):
                QuantConfig("fp8_tensor", shared=s)
            with pytest.raises(ValueError, match=r"BenchOptions.shared_quant: .* is not 'none' or one of "
                                                 r"\['fp8_token', 'fp8_block'\]"):
                BenchOptions(shared_quant=s).validate()

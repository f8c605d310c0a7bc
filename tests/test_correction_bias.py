"""DeepSeek-V3's auxiliary-loss-free bias update on one device (``update_correction_bias``): the
rule by hand (an expert at the mean keeps its bias), that it steers routing away from an
overloaded expert, the load windows it reads and resets, the layers it leaves alone, and its
refusals. The same update under EP, SP, TP and DP equals one device's in
tests/test_backward_functions.py."""

import pytest
import torch
from torch import nn

from moeshard.config import MoEConfig
from moeshard.layer import MoELayer
from moeshard.presets import PRESETS
from moeshard.training import update_correction_bias
from moeshard.training.correction_bias import MAX_SPEED
from moeshard.weights import MoEWeights


def _layer(preset: str = "deepseek-v3", seed: int = 0, **kwargs) -> MoELayer:
    cfg = PRESETS[preset].config("small")
    return MoELayer(cfg, weights=MoEWeights.random(cfg, torch.Generator().manual_seed(seed)), **kwargs)


def _small() -> MoELayer:
    cfg = MoEConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8, scoring="sigmoid",
                    use_correction_bias=True)
    return MoELayer(cfg, weights=MoEWeights.random(cfg, torch.Generator().manual_seed(0)))


def test_the_rule_by_hand_an_expert_at_the_mean_keeps_its_bias():
    layer = _small()
    layer.gate.e_score_correction_bias.zero_()  # exact sums below
    start = layer.gate.e_score_correction_bias.clone()
    layer.loads.record(torch.tensor([[0], [0], [1], [2]]))  # loads [2, 1, 1, 0]: mean 1
    (loads,) = update_correction_bias(layer, None, 0.125)
    assert loads.tolist() == [2, 1, 1, 0]
    assert (layer.gate.e_score_correction_bias - start).tolist() == [-0.125, 0.0, 0.0, 0.125]
    layer.loads.record(torch.tensor([[3], [3], [3], [1], [2], [2]]))  # [0, 1, 2, 3]: mean 1.5
    update_correction_bias(layer, None, 0.125)
    assert (layer.gate.e_score_correction_bias - start).tolist() == [0.0, 0.125, -0.125, 0.0]


def test_the_bias_steers_tokens_away_from_an_overloaded_expert():
    layer = _layer()
    x = torch.randn(64, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer(x)
    before = layer.expert_loads()
    assert layer.gate.e_score_correction_bias.requires_grad is False
    assert "gate.e_score_correction_bias" not in dict(layer.named_parameters())  # a buffer: never trained
    (loads,) = update_correction_bias(layer, None, 0.05)
    assert torch.equal(loads, before)
    assert int(layer.expert_loads().sum()) == 0  # the window was emptied
    with torch.no_grad():
        layer(x)
    after = layer.expert_loads()
    busiest = int(before.argmax())
    assert after[busiest] < before[busiest]
    assert (after.max() - after.min()) < (before.max() - before.min())  # more even


def test_only_layers_with_a_correction_bias_are_updated_in_module_order():
    model = nn.ModuleDict({"a": _layer("mixtral-8x7b"), "b": _layer("deepseek-v3", 1),
                           "c": _layer("ernie-4.5-21b-a3b", 2)})
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for layer in model.values():
            layer(x)
    ernie_start = model["c"].gate.e_score_correction_bias.clone()
    loads = update_correction_bias(model, None, 1e-3)
    assert [t.shape[0] for t in loads] == [16, 8]  # deepseek-v3's 16 experts, then ERNIE's 8
    assert int(model["a"].expert_loads().sum()) == 16 * 2  # mixtral's window is left as it was
    assert not torch.equal(model["c"].gate.e_score_correction_bias, ernie_start)


def test_reset_false_keeps_counting():
    layer = _layer()
    x = torch.randn(8, layer.cfg.hidden_size)
    with torch.no_grad():
        layer(x)
        update_correction_bias(layer, None, 1e-3, reset=False)
        layer(x)
    assert int(layer.expert_loads().sum()) == 2 * 8 * layer.cfg.top_k


def test_refusals_name_the_field_and_value():
    layer = _layer(load_window=1)
    for speed in (0, -1e-3, float("nan"), True, 2 * MAX_SPEED):
        with pytest.raises(ValueError, match=r"update_correction_bias\.speed: must be a finite number in \(0, 1\]"):
            update_correction_bias(layer, None, speed)
    with pytest.raises(ValueError, match="update_correction_bias.reset: must be a bool, got 1"):
        update_correction_bias(layer, None, 1e-3, reset=1)
    with pytest.raises(ValueError, match="update_correction_bias: the model has no MoELayer"):
        update_correction_bias(nn.Linear(2, 2), None, 1e-3)
    with pytest.raises(ValueError, match="none of the model's 1 MoE layers has a correction bias \\(routing 'softmax', "
                                         "use_correction_bias=False\\)"):
        update_correction_bias(_layer("mixtral-8x7b"), None, 1e-3)
    x = torch.randn(4, layer.cfg.hidden_size)
    with torch.no_grad():
        layer(x)
        layer(x)
    with pytest.raises(ValueError, match="MoE layer 0 ran 2 forwards since its loads were last reset, more than its "
                                         "load_window=1"):
        update_correction_bias(layer, None, 1e-3)

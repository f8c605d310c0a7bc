"""Ungated experts (``ActivationKind.gated`` False: Nemotron-H's relu2) through the verification
matrix: the ``nemotron-3-nano`` preset under every layout, backend and scheme of world sizes 1
and 2, outputs and gradients against the fp64 reference; TP slices of the up rows alone, by
hand; and a planted fault (relu for relu2) that the matrix must catch."""

import faults
import pytest
import torch

from moeshard.activations import activation_names, unregister_activation
from moeshard.config import QuantConfig
from moeshard.harness.cases import MatrixOptions, generate
from moeshard.harness.runner import Runner
from moeshard.presets import PRESETS
from moeshard.sharding import ShardSpec, shard_experts
from moeshard.weights import MoEWeights

PRESET = "nemotron-3-nano"


def _cases(world_sizes=(1, 2), backward=True, quants=None):
    opts = MatrixOptions(world_sizes=world_sizes, presets=(PRESET,), backward=backward, eplb="off", quants=quants)
    return [c for c in generate(opts) if not c.skipped]


def test_every_layout_backend_and_scheme_matches_the_reference_with_gradients():
    cases = _cases()
    assert {c.preset for c in cases} == {PRESET}
    assert {c.parallel.name for c in cases} >= {"dp1-tp1-noep", "dp1-tp2-noep", "dp2-tp1-ep", "dp1-tp2-ep"}
    assert any(c.grad for c in cases) and len({c.quant.scheme for c in cases}) >= 5
    outcomes = Runner().run(cases)
    bad = [(o.case.id, o.status, o.reason) for o in outcomes if o.status != "pass"]
    assert outcomes and not bad, bad[:5]


def test_relu_for_relu2_is_caught():
    cases = [c for c in _cases(backward=False, quants=("none",)) if sum(c.tokens) >= 3]
    try:
        outcomes = Runner(layer_factory=faults.UnsquaredRelu).run(cases)
    finally:  # the one-rank cases run in this process, which registered the fault's kind
        if "relu_unsquared" in activation_names():
            unregister_activation("relu_unsquared")
    assert outcomes and all(o.status == "fail" for o in outcomes), [(o.case.id, o.status) for o in outcomes]


@pytest.mark.parametrize("scheme", ["none", "fp8_token", "fp8_block"])
def test_tp_slices_hold_the_up_rows_alone(scheme):
    """TP rank r keeps up rows [r I/tp, (r+1) I/tp) of an ungated expert (no gate half to take)
    and the same columns of down; the slices' dequantized weights tile the whole expert's."""
    cfg = PRESETS[PRESET].config("small", torch.float32)
    w = MoEWeights.random(cfg, torch.Generator().manual_seed(0))
    quant = QuantConfig(scheme)
    whole = shard_experts(w.gate_up, w.down, cfg, quant, ShardSpec(0, cfg.num_experts))
    I, tp = cfg.intermediate_size, 2
    for r in range(tp):
        part = shard_experts(w.gate_up, w.down, cfg, quant, ShardSpec(0, cfg.num_experts, r, tp))
        rows = slice(r * I // tp, (r + 1) * I // tp)
        gu, dn = part.gate_up, part.down
        gu, dn = (gu if scheme == "none" else gu.dequantize()), (dn if scheme == "none" else dn.dequantize())
        full_gu = whole.gate_up if scheme == "none" else whole.gate_up.dequantize()
        full_dn = whole.down if scheme == "none" else whole.down.dequantize()
        assert gu.shape == (cfg.num_experts, I // tp, cfg.hidden_size)
        assert torch.equal(gu, full_gu[:, rows]) and torch.equal(dn, full_dn[:, :, rows])

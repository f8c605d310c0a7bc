"""The reference's output-rounding terms in real parallel layouts, at large inputs.

Under TP each rank's experts round their partial output over one slice of I, so the layer's
sum carries one rounding per slice; under EP the rows reach their experts on other ranks. The
reference prices each slice's rounding (``intermediate_shards``), and a correct layer must stay
within its bound at inputs eight times the usual, where the experts' large outputs cancel to a
small sum, on every rank of each layout. ``tests/test_reference.py`` checks the terms by hand
and on one rank. Without the terms the worst rank of each layout reads 3.5 to 7.7 times its
bound; with one rounding priced per expert instead of one per TP slice, TP2 and TP4 read 1.05
to 5.7 times it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.spawn import spawn

BF16 = torch.bfloat16
# routed only; a down bias (added on TP rank 0 only) and a clamped activation; a shared expert
# and routed scaling; a gated shared expert
PRESETS = ("mixtral-8x7b", "gpt-oss-120b", "deepseek-v3", "qwen2-57b-a14b")


def _worker(dp: int, tp: int, ep: bool, scale: float) -> dict[str, float]:
    from moeshard.config import QuantConfig
    from moeshard.layer import MoELayer
    from moeshard.parallel.groups import ParallelGroups
    from moeshard.presets import PRESETS as ALL
    from moeshard.reference import reference_forward
    from moeshard.tolerances import compare_rows
    from moeshard.weights import MoEWeights

    config = ParallelConfig(dp=dp, tp=tp, enable_ep=ep)
    groups = ParallelGroups.build(config)
    dp_rank = config.dp_rank(dist.get_rank())
    ratios = {}
    for name in PRESETS:
        cfg = ALL[name].config("small", BF16)
        weights = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(0))
        layer = MoELayer(cfg, QuantConfig("none"), weights=weights, groups=groups)
        # each DP rank its own tokens, the same on the TP ranks of one DP rank
        gen = torch.Generator().manual_seed(100 + dp_rank)
        x = (torch.randn(300, cfg.hidden_size, generator=gen) * scale).to(BF16)
        ref = reference_forward(x, weights, cfg, intermediate_shards=1 if ep else tp, accumulation=layer.accumulation)
        ratios[name] = compare_rows(layer(x), ref, BF16, "none").err_to_bound
    return ratios


@pytest.mark.parametrize(("dp", "tp", "ep"), [
    (1, 2, False), (2, 1, True),
    # four ranks each: `make test-slow`
    pytest.param(1, 4, False, marks=pytest.mark.slow), pytest.param(2, 2, True, marks=pytest.mark.slow)])
def test_a_correct_layer_stays_within_the_bound_at_large_inputs_on_every_rank(dp, tp, ep):
    per_rank = spawn(_worker, dp * tp, args=(dp, tp, ep, 8.0), timeout_s=240, preload=("moeshard.layer",))
    worst = {name: max(r[name] for r in per_rank) for name in PRESETS}
    assert all(ratio <= 1.0 for ratio in worst.values()), worst

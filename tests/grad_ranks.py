"""Rank functions for the autograd refusal of ``MoELayer`` (importable in spawned ranks:
``tests/`` is on their ``sys.path``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.presets import PRESETS
from moeshard.weights import MoEWeights


def _refusal(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def grad_refusals() -> dict[str, str | None]:
    """On each rank of a world of 2: what the collective layouts say to an input requiring grad,
    to a parameter requiring grad under grad mode, and (None: it ran) the same under no_grad."""
    cfg = PRESETS["mixtral-8x7b"].config("small")
    weights = MoEWeights.random(cfg, torch.Generator().manual_seed(0))
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    seen: dict[str, str | None] = {}
    for layout, backend in (("dp2-tp1-ep", "all2all"), ("dp1-tp2-noep", "local")):
        parallel = ParallelConfig.parse(layout)
        layer = MoELayer(cfg, groups=ParallelGroups.build(parallel), backend=backend, weights=weights)
        seen[f"{layout} x"] = _refusal(lambda layer=layer: layer(x.clone().requires_grad_()))
        layer.gate.weight.requires_grad_(True)
        seen[f"{layout} param"] = _refusal(lambda layer=layer: layer(x))
        with torch.no_grad():
            seen[f"{layout} no_grad"] = _refusal(lambda layer=layer: layer(x.clone().requires_grad_()))
        layer.gate.weight.requires_grad_(False)
    return seen

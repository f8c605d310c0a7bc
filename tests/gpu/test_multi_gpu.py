"""Two GPUs over NCCL: the ``low_latency`` backend under EP and SP, eager and captured in a CUDA
graph, against the single-device reference; ranks replay graphs captured at different token
counts (0 included) and their collectives still match."""

import pytest
import torch
import torch.distributed as dist

from moeshard.bench.timing import graphed
from moeshard.config import QuantConfig
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.spawn import spawn
from moeshard.presets import PRESETS
from moeshard.reference import reference_forward
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

QUANTS = ("none", "fp8_block", "fp8_tensor", "nvfp4")
MAX_TOKENS = 9


def _tokens(layout: ParallelConfig, trial: int) -> list[int]:
    """Tokens per DP rank: uneven, with an empty rank, changing between trials."""
    return [[5, 0], [1, 9], [0, 3]][trial] if layout.dp == 2 else [[5], [1], [9]][trial]


def _inputs(cfg, counts: list[int], trial: int) -> list[torch.Tensor]:
    return [(torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(100 * trial + d)) + 0.05 * d)
            .to(cfg.dtype) for d, n in enumerate(counts)]


def _worker() -> list[dict]:
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = PRESETS["deepseek-v3"].config("small", torch.bfloat16)
    weights = MoEWeights.random(cfg, torch.Generator().manual_seed(7))
    out = []
    for layout in (ParallelConfig(2, 1, True), ParallelConfig(1, 2, True)):
        groups = ParallelGroups.build(layout)
        dp_rank = layout.dp_rank(rank)
        for scheme in QUANTS:
            quant = QuantConfig(scheme)
            layer = MoELayer(cfg, quant, groups=groups, backend="low_latency", weights=weights, device=device,
                             max_tokens_per_rank=MAX_TOKENS)
            graphs: dict[int, tuple] = {}
            for trial in range(3):
                counts = _tokens(layout, trial)
                xs = _inputs(cfg, counts, trial)
                x = xs[dp_rank].to(device)
                eager = layer(x)
                T = x.shape[0]
                if T not in graphs:  # one graph per token count, captured by each rank on its own
                    static_x = torch.zeros_like(x)
                    graphs[T] = (graphed(lambda static_x=static_x, layer=layer: layer(static_x)), static_x)
                graph, static_x = graphs[T]
                static_x.copy_(x)
                graph()
                torch.cuda.synchronize()
                static_out = graph.output
                domain = torch.cat(xs)
                offset = sum(counts[:dp_rank])
                ref = reference_forward(domain.to(device), weights, cfg, quant,
                                        accumulation=layer.accumulation).rows(offset, offset + T)
                out.append({"layout": layout.name, "quant": scheme, "trial": trial, "tokens": T,
                            "eager_ok": compare(eager, ref, cfg.dtype, scheme)[3],
                            "graph_ok": compare(static_out, ref, cfg.dtype, scheme)[3],
                            "graph_equals_eager": torch.equal(static_out, eager)})
            del layer, graphs
    return out


def test_low_latency_eager_and_graphed_match_the_reference():
    per_rank = spawn(_worker, 2, device="cuda", timeout_s=600)
    for rank, records in enumerate(per_rank):
        assert len(records) == 2 * len(QUANTS) * 3
        for r in records:
            assert r["eager_ok"] and r["graph_ok"] and r["graph_equals_eager"], (rank, r)

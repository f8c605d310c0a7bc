"""Rank functions of the backward tests (importable in spawned ranks: ``tests/`` is on their
``sys.path``), all run in one world of 2.

``gradchecks``: ``torch.autograd.gradcheck`` in fp64 of every custom Function, on every rank at
once. A distributed function has no Jacobian of its own on one rank, so each check is of a
*global* function F that every rank computes identically (the replicated loss of
``moeshard.autograd``): every rank holds the same global inputs, ``shard_rows`` hands each rank
its rows, the Function under test runs, ``gather_rows`` gives every rank every output. gradcheck
then perturbs the same element on every rank at once, which changes exactly one rank's input,
and seeds the same output element on every rank: its numerical and analytical Jacobians are F's.
A wrong backward anywhere in F (``shard_rows`` / ``gather_rows`` included: a summing gather
would make F's Jacobian 2x) fails on every rank. The per-rank work between them depends on the
rank, so a backward that mixed ranks up would fail too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeshard.autograd import routed
from moeshard.autograd.collectives import gather_rows, shard_rows, tp_copy, tp_reduce
from moeshard.config import MoEConfig, QuantConfig
from moeshard.dispatch.base import BackendContext
from moeshard.dispatch.registry import BACKENDS, build_groups
from moeshard.experts.base import ExpertInput
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.sequence import SequenceChunk
from moeshard.router import Routing

E, K, H = 4, 2, 3  # experts, top-k, hidden size of the gradient checks


def _toy_experts(inp: ExpertInput, scale: float = 1.0) -> torch.Tensor:
    """A smooth function of each routed row and its expert (padding rows: zero): y = scale *
    tanh(x * (1 + e))."""
    ids = inp.expert_ids
    x = inp.x
    assert isinstance(x, torch.Tensor)  # unquantized rows
    rows = x[torch.arange(ids.shape[0]) // inp.repeat]
    e = ids.clamp_min(0).to(rows.dtype).unsqueeze(1)
    return scale * torch.tanh(rows * (1 + e)) * (ids >= 0).to(rows.dtype).unsqueeze(1)


def _ids(n: int) -> torch.Tensor:
    """int64 [n, K]: distinct experts per token, spread over both ranks' experts."""
    t = torch.arange(n).unsqueeze(1)
    return (t + torch.arange(K) * (E // K + 1)) % E


def _check(fn, inputs) -> bool | str:
    try:
        return bool(torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5))
    except Exception as exc:  # noqa: BLE001 - the message is the test's evidence
        return f"{type(exc).__name__}: {str(exc)[:400]}"


def gradchecks() -> dict[str, bool | str]:
    """name -> True, or why gradcheck failed, on this rank."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=8, intermediate_size=16)
    ep = build_groups(ParallelConfig(2, 1, True), "cpu")
    tp = build_groups(ParallelConfig(1, 2, False), "cpu")
    results: dict[str, bool | str] = {}

    for sizes in ([2, 3], [0, 4], [1, 0]):
        x = torch.randn(sum(sizes), H, dtype=torch.float64, generator=gen, requires_grad=True)

        def rows(x, sizes=sizes):
            mine = shard_rows(x, sizes, rank, ep.ep_group, "ep")
            return gather_rows(mine * (rank + 1) + mine.sin(), sizes, rank, ep.ep_group, "ep")
        results[f"shard_rows/gather_rows {sizes}"] = _check(rows, (x,))

    x = torch.randn(3, H, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(3, K, dtype=torch.float64, generator=gen, requires_grad=True)

    def tp_pair(x, w):
        xc, wc = tp_copy(x, w, group=tp.tp_group)
        return tp_reduce(torch.sin(xc * (rank + 1)) * wc.sum(dim=1, keepdim=True), tp.tp_group)
    results["tp_copy/tp_reduce"] = _check(tp_pair, (x, w))

    def tp_local(x, w):  # the local backend under TP: each rank's experts a different "slice"
        backend = BACKENDS["local"].factory(BackendContext(cfg, QuantConfig(), tp))
        xc, wc = tp_copy(x, w, group=tp.tp_group)
        d = routed.dispatch(backend, xc, Routing(_ids(xc.shape[0]), wc))
        y = _toy_experts(d.input, 1.0 + rank)
        return tp_reduce(routed.combine(backend, y, wc, d), tp.tp_group)
    results["local under TP"] = _check(tp_local, (x, w))

    # every EP backend, with uneven ranks, an empty rank, and SP's chunks of 1 token over 2 ranks
    for sizes in ([2, 3], SequenceChunk.of(1, rank, 2).rows_per_rank):
        n = sum(sizes)
        x = torch.randn(n, H, dtype=torch.float64, generator=gen, requires_grad=True)
        w = torch.rand(n, K, dtype=torch.float64, generator=gen, requires_grad=True)
        for name, spec in BACKENDS.items():
            if spec.layouts != "ep":
                continue
            backend = spec.factory(BackendContext(cfg, QuantConfig(), ep, max(max(sizes), 1)))

            def ep_routed(x, w, sizes=sizes, backend=backend):
                mine, wm = shard_rows(x, sizes, rank, ep.ep_group, "ep"), shard_rows(w, sizes, rank, ep.ep_group, "ep")
                ids = _ids(sum(sizes))[sum(sizes[:rank]):sum(sizes[:rank + 1])]
                d = routed.dispatch(backend, mine, Routing(ids, wm))
                out = routed.combine(backend, _toy_experts(d.input), wm, d)
                return gather_rows(out, sizes, rank, ep.ep_group, "ep")
            results[f"{name} {sizes}"] = _check(ep_routed, (x, w))
    return results

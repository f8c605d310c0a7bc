"""Dispatch backends against a plain torch.distributed reference, with rank-tagged rows.

Each rank routes tokens whose first column is ``rank * 1000 + token``; after dispatch a rank
must hold exactly the (source rank, token, expert) triples whose expert it owns, as computed
from every rank's routing gathered with ``dist.all_gather_object``; after an "expert" that
multiplies a row by (1 + its global expert id), combine must return
x[t] * sum_k w[t, k] * (1 + ids[t, k]) for every token.
"""

import pytest
import torch
import torch.distributed as dist

from moeshard.config import QuantConfig
from moeshard.dispatch.all2all import All2AllBackend
from moeshard.dispatch.registry import BACKENDS
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.spawn import RankFailure, spawn
from moeshard.router import Routing

E, K, H = 8, 3, 6
TOKEN_SETS = {2: [(5, 3), (0, 4), (1, 0), (7, 7)], 4: [(1, 0, 3, 2), (0, 0, 0, 2), (6, 1, 9, 0)]}


def _routing(rank: int, T: int, seed: int) -> tuple[torch.Tensor, Routing]:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    w = torch.rand(T, K, generator=g)
    x = torch.zeros(T, H)
    x[:, 0] = rank * 1000 + torch.arange(T, dtype=torch.float32)
    x[:, 1:] = torch.rand(T, H - 1, generator=g)
    return x, Routing(ids, w)


def _worker(world: int) -> list[dict]:
    rank = dist.get_rank()
    torch.set_num_threads(1)
    groups = ParallelGroups.build(ParallelConfig(dp=world, tp=1, enable_ep=True))
    results = []
    for backend in ("allgather_reducescatter", "all2all"):
        be = BACKENDS[backend].factory(E, groups)
        per_rank = E // world
        for seed, tokens in enumerate(TOKEN_SETS[world]):
            for with_scale in (False, True):
                x, routing = _routing(rank, tokens[rank], seed)
                scale = (x[:, :1] * 2).to(torch.uint8) if with_scale else None  # a per-row "scale" to carry
                d = be.dispatch(x, scale, routing)
                got = sorted((int(r[0]) // 1000, int(r[0]) % 1000, int(e) + rank * per_rank)
                             for r, e in zip(d.x, d.expert_ids))
                everyone = [None] * world
                dist.all_gather_object(everyone, (x[:, 0].tolist(), routing.topk_ids.tolist()))
                want = sorted((src, int(tag) % 1000, e) for src, (tags, ids) in enumerate(everyone)
                              for tag, row in zip(tags, ids) for e in row if e // per_rank == rank)
                scale_ok = (d.x_scale is None) == (not with_scale) and (
                    not with_scale or torch.equal(d.x_scale, (d.x[:, :1] * 2).to(torch.uint8)))
                y = d.x * (1 + d.expert_ids + rank * per_rank).unsqueeze(1).float()
                out = be.combine(y, d)
                expect = x * (routing.topk_weights * (1 + routing.topk_ids).float()).sum(1, keepdim=True)
                results.append(dict(backend=backend, tokens=tokens, scale=with_scale, rows_ok=got == want,
                                    scale_ok=scale_ok, combine_err=float((out - expect).abs().max() / expect.abs().max().clamp_min(1)) if out.numel() else 0.0,
                                    shape_ok=tuple(out.shape) == (tokens[rank], H)))
    return results


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request):
    return request.param, spawn(_worker, request.param, args=(request.param,), timeout_s=120)


def test_backends_move_exactly_the_routed_rows(world_results):
    world, per_rank = world_results
    for rank, results in enumerate(per_rank):
        assert len(results) == 2 * len(TOKEN_SETS[world]) * 2
        for r in results:
            assert r["rows_ok"] and r["scale_ok"] and r["shape_ok"], (rank, r)
            assert r["combine_err"] < 1e-6, (rank, r)  # relative to the largest value (~5e4)


def _disagreeing_hidden_size():
    from moeshard.config import MoEConfig
    from moeshard.layer import MoELayer
    rank = dist.get_rank()
    groups = ParallelGroups.build(ParallelConfig(dp=2, tp=1, enable_ep=True))
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16 if rank == 0 else 32, intermediate_size=16)
    MoELayer(cfg, groups=groups, backend="all2all")


def test_ranks_that_disagree_are_refused_together_not_hung():
    with pytest.raises(RankFailure) as info:
        spawn(_disagreeing_hidden_size, 2, timeout_s=60)
    failure = info.value
    assert set(failure.errors) == {0, 1}, str(failure)
    for rank, err in failure.errors.items():
        assert err.type_name == "ValueError"
        assert f"(rank {rank}): ranks disagree on hidden_size: rank 0=16, rank 1=32" in err.message


def test_all2all_refuses_cuda_without_side_channel():
    groups = ParallelGroups(config=ParallelConfig(2, 1, True), rank=1, world_size=2, tp_group=None, dp_group=None,
                            ep_group=object(), tp_ranks=[1], dp_ranks=[0, 1], ep_ranks=[0, 1], side_group=None,
                            device=torch.device("cuda", 1))
    with pytest.raises(ValueError, match=r"all2all \(rank 1\): on CUDA the count exchange needs a gloo side "
                                         r"channel, but ParallelGroups.side_group is None"):
        All2AllBackend(E, groups)


def test_registry_refusal_reason_is_the_layers():
    from moeshard.dispatch.registry import support
    ok, reason = support("local", QuantConfig("nvfp4"), ParallelConfig(2, 2, True))
    assert not ok and reason == "local runs without expert parallelism only; layout dp2-tp2-ep has EP on"


def _disagreeing_quant():
    from moeshard.config import MoEConfig
    from moeshard.layer import MoELayer
    rank = dist.get_rank()
    groups = ParallelGroups.build(ParallelConfig(dp=1, tp=2, enable_ep=False))
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=64)
    # rank 1's quant would also fail its own alignment check (fp8_block needs 128-aligned TP
    # slices): it must still reach the exchange, so rank 0 is not left waiting.
    MoELayer(cfg, quant=QuantConfig("fp8_block" if rank else "none"), groups=groups)


def test_disagreeing_quant_is_named_on_every_rank():
    with pytest.raises(RankFailure) as info:
        spawn(_disagreeing_quant, 2, timeout_s=60)
    assert set(info.value.errors) == {0, 1}, str(info.value)
    for err in info.value.errors.values():
        assert "ranks disagree on quant: rank 0=none, rank 1=fp8_block" in err.message

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

from moeshard.config import MoEConfig, QuantConfig
from moeshard.dispatch.base import BackendContext
from moeshard.dispatch.registry import BACKENDS
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.spawn import RankFailure, spawn
from moeshard.quant import QuantizedActivations, quantize_activations, to_wire
from moeshard.router import Routing

E, K, H = 8, 3, 32
CFG = MoEConfig(E, K, H, 16)
TOKEN_SETS = {2: [(5, 3), (0, 4), (1, 0), (7, 7)], 4: [(1, 0, 3, 2), (0, 0, 0, 2), (6, 1, 9, 0)]}
WIRE_QUANTS = ("fp8_token", "nvfp4")
MAX_TOKENS = 9  # low_latency's fixed capacity: the most tokens any rank routes below
EP_BACKENDS = ("allgather_reducescatter", "all2all", "low_latency")  # row scales of two dtypes; nvfp4 also a per-tensor scale


def _routing(rank: int, T: int, seed: int) -> tuple[torch.Tensor, Routing]:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    w = torch.rand(T, K, generator=g)
    x = torch.zeros(T, H)
    x[:, 0] = rank * 1000 + torch.arange(T, dtype=torch.float32)
    x[:, 1:] = torch.rand(T, H - 1, generator=g)
    return x, Routing(ids, w)


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(to_wire(a), to_wire(b))


def _worker(world: int) -> list[dict]:
    rank = dist.get_rank()
    torch.set_num_threads(1)
    groups = ParallelGroups.build(ParallelConfig(dp=world, tp=1, enable_ep=True))
    results = []
    for backend in EP_BACKENDS:
        be = BACKENDS[backend].factory(BackendContext(CFG, QuantConfig(), groups, MAX_TOKENS))
        per_rank = E // world
        for seed, tokens in enumerate(TOKEN_SETS[world]):
            x, routing = _routing(rank, tokens[rank], seed)
            d = be.dispatch(x, routing)
            rows, ids = d.input.x, d.input.expert_ids
            # (source rank, token, global expert, row) of every row that is not padding (id -1)
            got = [(int(r[0]) // 1000, int(r[0]) % 1000, int(e) + rank * per_rank, i)
                   for i, (r, e) in enumerate(zip(rows, ids, strict=True)) if e >= 0]
            everyone = [None] * world
            dist.all_gather_object(everyone, (x, routing.topk_ids.tolist()))
            want = sorted((src, t, e) for src, (xs, ids_) in enumerate(everyone)
                          for t, row in enumerate(ids_) for e in row if e // per_rank == rank)
            y = rows * (1 + ids + rank * per_rank).unsqueeze(1).float()
            out = be.combine(y, d)
            expect = x * (routing.topk_weights * (1 + routing.topk_ids).float()).sum(1, keepdim=True)
            # Quantized before dispatch: row i of the quantized dispatch is the same (source, token)
            # as row i above; it must arrive as that token's quantization on its rank, bit for bit,
            # with its scales (the per-tensor one over the whole EP group).
            wire_ok = {}
            domain = torch.cat([xs for xs, _ in everyone])
            for scheme in WIRE_QUANTS:
                dq = BACKENDS[backend].factory(BackendContext(CFG, QuantConfig(scheme), groups, MAX_TOKENS)).dispatch(
                    x, routing).input
                q = dq.x
                ok = isinstance(q, QuantizedActivations) and q.shape == (len(ids), H)
                amax = domain.abs().amax().float() if domain.numel() else torch.zeros(())
                for src, t, _, i in got if ok else []:
                    ref = quantize_activations(everyone[src][0][t:t + 1], scheme, amax=amax)
                    ok = ok and _same_bits(q.data[i:i + 1], ref.data) and _same_bits(
                        None if q.row_scale is None else q.row_scale[i:i + 1], ref.row_scale)
                    ok = ok and _same_bits(q.tensor_scale, ref.tensor_scale)
                wire_ok[scheme] = ok and torch.equal(dq.expert_ids, ids)
            results.append(dict(backend=backend, tokens=tokens, rows_ok=sorted(g[:3] for g in got) == want, wire_ok=wire_ok,
                                combine_err=(float((out - expect).abs().max() / expect.abs().max().clamp_min(1))
                                             if out.numel() else 0.0),
                                shape_ok=tuple(out.shape) == (tokens[rank], H)))
    return results


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request):
    return request.param, spawn(_worker, request.param, args=(request.param,), timeout_s=120,
                                  preload=("moeshard.layer",))


def test_backends_move_exactly_the_routed_rows(world_results):
    world, per_rank = world_results
    for rank, results in enumerate(per_rank):
        assert len(results) == len(EP_BACKENDS) * len(TOKEN_SETS[world])
        for r in results:
            assert r["rows_ok"] and r["shape_ok"], (rank, r)
            assert all(r["wire_ok"].values()), (rank, r)
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


def _disagreeing_routing_fields():
    """Every field of MoEConfig beyond the sizes, one layer each, rank 1 with another value."""
    from moeshard.config import MoEConfig
    from moeshard.layer import MoELayer
    rank = dist.get_rank()
    groups = ParallelGroups.build(ParallelConfig(dp=1, tp=2, enable_ep=False))
    base = dict(num_experts=4, top_k=2, hidden_size=32, intermediate_size=32)
    other = {"activation": "gelu", "scoring": "sigmoid", "renormalize": False, "routed_scaling_factor": 2.0,
             "router_dtype": "model", "num_shared_experts": 1, "shared_scale": 2.0}
    messages = {}
    for name, value in other.items():
        extra = {"shared_intermediate_size": 16} if name in ("num_shared_experts", "shared_scale") else {}
        if name == "shared_scale":
            extra["num_shared_experts"] = 1
        try:
            MoELayer(MoEConfig(**base, **extra, **({name: value} if rank == 1 else {})), groups=groups)
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def test_ranks_that_disagree_on_any_config_field_are_refused_naming_it():
    """Edge case from a review: only sizes, dtype, quantization and layout were exchanged, so a
    rank with another activation, routing or scale ran without an error and its peers got a
    mixed result (dp1-tp2, rank 1 with gelu: every rank's output 5% off, exit 0)."""
    per_rank = spawn(_disagreeing_routing_fields, 2, timeout_s=120)
    for rank, messages in enumerate(per_rank):
        assert set(messages) == {"activation", "scoring", "renormalize", "routed_scaling_factor", "router_dtype",
                                 "num_shared_experts", "shared_scale"}, messages
        # Every rank's value, not digests: the failure path exchanges the values themselves.
        assert messages["activation"] == (f"MoELayer (rank {rank}): ranks disagree on MoEConfig.activation: "
                                          f"rank 0='silu', rank 1='gelu'")
        assert messages["routed_scaling_factor"].endswith("MoEConfig.routed_scaling_factor: rank 0=1.0, rank 1=2.0")


def test_all2all_refused_on_cuda_without_side_channel():
    """all2all's CUDA count exchange needs the gloo side group: its registry entry says so, and the
    layer refuses the combination with this reason at construction (before any collective)."""
    from moeshard.dispatch.registry import support
    ok, reason = support("all2all", QuantConfig(), ParallelConfig(2, 1, True), device="cuda", has_side_group=False)
    assert not ok and reason.startswith("all2all on cuda needs a gloo side channel for its counts, but "
                                        "ParallelGroups.side_group is None")
    assert support("all2all", QuantConfig(), ParallelConfig(2, 1, True), device="cpu", has_side_group=False)[0]


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


def test_support_enforces_the_side_group_and_the_kernels_layouts():
    from moeshard.dispatch.registry import support
    from moeshard.experts.base import EXPERT_BLOCKS
    ep2 = ParallelConfig(2, 1, True)
    ok, reason = support("all2all", QuantConfig(), ep2, device="cuda", has_side_group=False)
    assert not ok and "all2all on cuda needs a gloo side channel" in reason and "side_channel=True" in reason
    assert support("all2all", QuantConfig(), ep2, device="cuda", has_side_group=True) == (True, "")
    assert support("all2all", QuantConfig(), ep2, device="cpu", has_side_group=False) == (True, "")
    ok, reason = support("local", QuantConfig(), ParallelConfig(), kernel_layouts=(EXPERT_BLOCKS,))
    assert not ok and reason == "local hands the experts 'flat' rows, but the expert kernel accepts ['expert_blocks']"

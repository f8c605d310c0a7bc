"""MoELayer with expert-parallel load balancing on two CPU ranks (one spawn, every scenario
inside): load statistics over the window and the EP group, rebalancing that moves exactly the
changed slots' bytes (quantized weights with their scales), ranks that disagree on a placement
refused together; and, without ranks, the refusals and checkpoint loading per slot."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moeshard.checkpoint.loader import load_moe_block
from moeshard.config import MoEConfig, QuantConfig
from moeshard.eplb import Layout, Placement, hierarchical
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.spawn import spawn
from moeshard.presets import PRESETS
from moeshard.quant import QuantizedWeight, to_wire
from moeshard.reference import reference_forward
from moeshard.router import route_tokens
from moeshard.sharding import shard_experts, shard_spec
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights

EP2 = ParallelConfig(2, 1, True)
CFG = PRESETS["qwen3-30b-a3b"].config("small")  # 16 experts, top-4
TOKENS = [(5, 9), (0, 3), (7, 1)]  # per forward, per DP rank


def _tokens(step: int, d: int) -> torch.Tensor:
    return torch.randn(TOKENS[step][d], CFG.hidden_size, generator=torch.Generator().manual_seed(100 * step + d))


def _weights() -> MoEWeights:
    return MoEWeights.random(CFG, torch.Generator().manual_seed(7))


def _slot_bytes(layer: MoELayer) -> list[list[torch.Tensor]]:
    """Every local slot's tensors as bytes."""
    tensors = layer.experts.slot_tensors()
    return [[to_wire(t[i]).clone() for t in tensors] for i in range(tensors[0].shape[0])]


def _worker() -> dict:
    from moeshard.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    groups = ParallelGroups.build(EP2)
    rank, out = groups.rank, {}
    layout = Layout(16, 2, 1)
    w = _weights()

    # Loads: a window of two forwards, all-reduced over the EP group.
    layer = MoELayer(CFG, groups=groups, weights=w, placement=Placement.initial(layout), load_window=2)
    for step in range(3):
        layer(_tokens(step, rank))
    out["loads"] = layer.expert_loads().tolist()
    out["own_loads"] = layer.expert_loads(all_reduce=False).tolist()
    layer.reset_expert_loads()
    out["reset"] = layer.expert_loads().tolist()

    # A rebalance to the same placement moves nothing; to another, exactly the changed slots.
    same = layer.rebalance(layer.placement)
    out["same"] = (same.rewritten, same.sent, same.bytes_sent)
    # Quantized weights and their scales: after a rebalance each slot holds, byte for byte, what a
    # fresh shard of the new placement holds.
    for scheme in ("fp8_block", "nvfp4"):
        quant = QuantConfig(scheme)
        layer = MoELayer(CFG, quant=quant, groups=groups, weights=w, placement=Placement.initial(layout))
        new = hierarchical([100.0] + [1.0] * 15, layout).aligned_to(layer.placement)
        stats = layer.rebalance(new)
        fresh = shard_experts(w.gate_up, w.down, CFG, quant, shard_spec(EP2, rank, 16, new))
        parts = [getattr(wt, f) for wt in (fresh.gate_up, fresh.down) for f in ("data", "scale", "global_scale")]
        want = [[to_wire(t[i]) for t in parts if t is not None] for i in range(new.slots_per_rank)]
        got = _slot_bytes(layer)
        # The lengths are compared first, so the strict zips never see different lengths.
        same_bytes = len(got) == len(want) and all(
            len(g) == len(wt) and all(torch.equal(a, b) for a, b in zip(g, wt, strict=True))
            for g, wt in zip(got, want, strict=True))
        out[f"moved_{scheme}"] = (stats.rewritten, stats.received, stats.copied, stats.sent, stats.bytes_sent, same_bytes)
        x = _tokens(0, rank)
        ref = reference_forward(torch.cat([_tokens(0, 0), _tokens(0, 1)]), w, CFG, quant,
                                accumulation=layer.accumulation)
        lo = 0 if rank == 0 else TOKENS[0][0]
        out[f"ok_{scheme}"] = compare(layer(x), ref.rows(lo, lo + x.shape[0]), CFG.dtype, scheme)[3]

    # Ranks that disagree on a placement: every rank raises, nobody hangs.
    mine = Placement.initial(layout) if rank == 0 else hierarchical([5.0] + [1.0] * 15, layout)
    try:
        MoELayer(CFG, groups=groups, weights=w, placement=mine)
        out["construct"] = "no error"
    except ValueError as exc:
        out["construct"] = str(exc)
    layer = MoELayer(CFG, groups=groups, weights=w, placement=Placement.initial(layout))
    try:
        layer.rebalance(mine)
        out["rebalance"] = "no error"
    except ValueError as exc:
        out["rebalance"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 2, timeout_s=240, preload=("moeshard.layer",))


def _expected_loads(steps) -> list[int]:
    w = _weights()
    counts = torch.zeros(16, dtype=torch.int64)
    for step in steps:
        for d in range(2):
            ids = route_tokens(_tokens(step, d), w.gate, CFG).topk_ids
            counts += torch.bincount(ids.flatten(), minlength=16)
    return counts.tolist()


def test_loads_count_the_window_over_the_ep_group(results):
    want = _expected_loads([1, 2])  # window 2: the first forward fell out
    for rank, r in enumerate(results):
        assert r["loads"] == want, rank
        w = _weights()
        own = sum(torch.bincount(route_tokens(_tokens(s, rank), w.gate, CFG).topk_ids.flatten(), minlength=16)
                  for s in (1, 2))
        assert r["own_loads"] == own.tolist()
        assert r["reset"] == [0] * 16


def test_rebalance_moves_exactly_the_changed_slots_with_their_scales(results):
    layout = Layout(16, 2, 1)
    old = Placement.initial(layout)
    new = hierarchical([100.0] + [1.0] * 15, layout).aligned_to(old)
    S = old.slots_per_rank
    for rank, r in enumerate(results):
        assert r["same"] == (0, 0, 0)
        changed = sum(old.slots[s] != new.slots[s] for s in range(rank * S, (rank + 1) * S))
        for scheme in ("fp8_block", "nvfp4"):
            rewritten, received, copied, sent, bytes_sent, equal = r[f"moved_{scheme}"]
            assert rewritten == changed and received + copied == changed and equal, (rank, scheme, r[f"moved_{scheme}"])
            assert bytes_sent > 0 or sent == 0
            assert r[f"ok_{scheme}"], (rank, scheme)
    assert results[0]["moved_nvfp4"][3] == results[1]["moved_nvfp4"][1]  # what 0 sends, 1 receives


def test_ranks_that_disagree_on_a_placement_all_raise(results):
    for rank, r in enumerate(results):
        assert f"MoELayer (rank {rank}): ranks disagree on placement" in r["construct"], r["construct"]
        assert f"MoELayer (rank {rank}): ranks disagree on placement" in r["rebalance"], r["rebalance"]


# ----------------------------------------------------------------------------- without ranks

def test_layer_refusals():
    cfg = PRESETS["mixtral-8x7b"].config("small")
    with pytest.raises(ValueError, match=r"MoELayer \(rank 0\): placement .* needs expert parallelism; layout "
                                         r"dp1-tp1-noep has EP off"):
        MoELayer(cfg, placement=Placement(8, 1, (1, 0, 2, 3, 4, 5, 6, 7)))
    with pytest.raises(ValueError, match=r"placement is for 8 experts on 2 EP ranks, but num_experts=8 and layout "
                                         r"dp1-tp1-noep has EP size 1"):
        MoELayer(cfg, placement=Placement.identity(8, 2))
    with pytest.raises(ValueError, match="load_window must be an int >= 1, got 0"):
        MoELayer(cfg, load_window=0)
    layer = MoELayer(cfg, placement=Placement.identity(8, 1))
    x = torch.randn(5, cfg.hidden_size)
    layer(x)
    assert int(layer.expert_loads().sum()) == 10  # counted without EP too (one rank, no group)


@pytest.mark.parametrize("quant", ["none", "fp8_tensor", "nvfp4"])
def test_checkpoint_reads_each_slot_once_as_its_logical_expert(tmp_path, quant):
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=64)
    gen = torch.Generator().manual_seed(5)
    p = "model.layers.0.mlp."
    gate_up, down = torch.randn(8, 128, 32, generator=gen), torch.randn(8, 32, 64, generator=gen)
    save_file({p + "gate.weight": torch.randn(8, 32, generator=gen), p + "experts.gate_up_proj": gate_up,
               p + "experts.down_proj": down}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": 32, "moe_intermediate_size": 64,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "dtype": "float32"}))
    pl = hierarchical([30.0, 1, 1, 9, 1, 1, 1, 1], Layout(8, 2, 2))
    for rank in range(2):
        block = load_moe_block(tmp_path, 0, parallel=EP2, rank=rank, quant=quant, placement=pl)
        assert block.spec.logical_experts == pl.rank_slots(rank) and block.placement == pl
        want = shard_experts(gate_up, down, cfg, QuantConfig(quant), block.spec)
        for got, exp in ((block.local_experts.gate_up, want.gate_up), (block.local_experts.down, want.down)):
            if isinstance(exp, QuantizedWeight):
                for field in ("data", "scale", "global_scale"):
                    a, b = getattr(got, field), getattr(exp, field)
                    assert (a is None) == (b is None) and (a is None or torch.equal(to_wire(a), to_wire(b)))
            else:
                assert torch.equal(got, exp)
                assert torch.equal(got[0], (gate_up if got is block.local_experts.gate_up else down)[pl.rank_slots(rank)[0]])

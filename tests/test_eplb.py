"""Expert-parallel load balancing without ranks: placements, replica choice, balancing policies
(hypothesis properties), the move plan, the load window, sharding and checkpoint slots."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeshard.config import MoEConfig, QuantConfig
from moeshard.eplb import (  # every POLICIES entry is tested
    POLICIES,
    Layout,
    Placement,
    balancedness,
    choose_replicas,
    greedy,
    hierarchical,
    rank_loads,
)
from moeshard.eplb.loads import LoadCounter
from moeshard.eplb.moves import SlotMove, move_slots, plan_moves
from moeshard.parallel.config import ParallelConfig
from moeshard.presets import PRESETS
from moeshard.quant import QuantizedWeight, quantize_weight, to_wire
from moeshard.sharding import ShardSpec, shard_experts, shard_spec

# ----------------------------------------------------------------------------- layout, placement

def test_layout_shape_and_refusals():
    lay = Layout(16, 4, 2)
    assert (lay.experts_per_rank, lay.slots_per_rank, lay.num_slots, lay.redundant) == (4, 6, 24, 8)
    with pytest.raises(ValueError, match="num_experts=10 is not divisible by num_ranks=4"):
        Layout(10, 4)
    with pytest.raises(ValueError, match="more than num_experts=4: a rank would hold two replicas"):
        Layout(4, 2, 3)
    with pytest.raises(ValueError, match=r"at most 0 redundant slots per rank"):  # one rank: no replicas
        Layout(8, 1, 1)
    with pytest.raises(ValueError, match="Layout.redundant_per_rank: must be an integer >= 0, got -1"):
        Layout(8, 2, -1)


def test_placement_refusals_name_the_rank_and_the_experts():
    with pytest.raises(ValueError, match=r"rank 1 holds experts \[2\] twice \(slots \[3, 6\) = \[2, 3, 2\]\)"):
        Placement(4, 2, (0, 1, 3, 2, 3, 2))
    with pytest.raises(ValueError, match=r"experts \[3\] have no active slot"):
        Placement(4, 2, (0, 1, 2, 2, 0, 1)[:3] + (2, 0, 1))
    with pytest.raises(ValueError, match=r"expert ids \[7\] are outside \[0, 4\)"):
        Placement(4, 2, (0, 1, 2, 7))
    with pytest.raises(ValueError, match=r"experts \[1\] have no active slot"):
        Placement(4, 2, (0, 1, 2, 3), (True, False, True, True))
    with pytest.raises(ValueError, match="do not spread evenly over 2 ranks"):
        Placement(4, 2, (0, 1, 2, 3, 0))


def test_identity_initial_and_alignment():
    assert Placement.identity(8, 2).is_identity and not Placement.identity(8, 2).has_replicas
    init = Placement.initial(Layout(8, 2, 1))
    assert init.slots == (0, 1, 2, 3, 4, 4, 5, 6, 7, 0) and init.has_replicas and not init.is_identity
    assert balancedness(rank_loads(init, [1.0] * 8)) == 1.0
    moved = Placement(8, 2, (4, 1, 0, 2, 3, 5, 6, 7, 0, 1))
    aligned = moved.aligned_to(init)
    assert aligned.rank_slots(0)[:3] == (0, 1, 2) and set(aligned.rank_slots(0)) == set(moved.rank_slots(0))
    assert rank_loads(aligned, list(range(8))) == rank_loads(moved, list(range(8)))


def test_backend_config_counts_slots():
    cfg = PRESETS["deepseek-v3"].config("small")
    pl = Placement.initial(Layout(cfg.num_experts, 4, 1))
    assert pl.backend_config(cfg).num_experts == 20 and pl.backend_config(cfg).n_group == 1
    assert Placement.identity(cfg.num_experts, 4).backend_config(cfg) is cfg


# ----------------------------------------------------------------------------- replica choice

def test_choice_is_a_function_of_the_token_and_spreads_round_robin():
    pl = Placement(4, 4, (0, 1, 2, 3, 0, 2, 0, 1), (True,) * 8)  # expert 0 on ranks 0, 2, 3
    table, count = pl.tables()
    assert count.tolist() == [3, 2, 2, 1] and table[0].tolist() == [0, 4, 6, 0]
    ids = torch.zeros(30, 1, dtype=torch.int64)  # every token to expert 0
    slots = choose_replicas(ids, table, count)
    assert sorted(torch.bincount(slots.flatten(), minlength=8).tolist()) == [0] * 5 + [10, 10, 10]
    # Any chunk of the batch chooses what the whole batch chooses for those rows (SP chunks).
    ids = torch.randint(0, 4, (23, 3), generator=torch.Generator().manual_seed(0))
    whole = choose_replicas(ids, table, count, dp_rank=1)
    for start, stop in ((0, 6), (6, 12), (12, 23)):
        part = choose_replicas(ids[start:stop], table, count, first_row=start, dp_rank=1)
        assert torch.equal(part, whole[start:stop])
    # Every chosen slot holds the logical expert and is active.
    slots_t = torch.tensor(pl.slots)
    assert torch.equal(slots_t[whole], ids)
    # One token per DP rank (decode): the DP ranks spread over the replicas.
    firsts = [int(choose_replicas(torch.zeros(1, 1, dtype=torch.int64), table, count, dp_rank=d)) for d in range(3)]
    assert sorted(firsts) == [0, 4, 6]


def test_standby_slots_take_no_tokens():
    pl = Placement(4, 2, (0, 1, 2, 2, 3, 0), (True, True, False, True, True, True))
    table, count = pl.tables()
    slots = choose_replicas(torch.arange(4).repeat(50).view(-1, 1), table, count)
    assert 2 not in slots.flatten().tolist()


# ----------------------------------------------------------------------------- policies (properties)

@st.composite
def problems(draw):
    P = draw(st.integers(1, 6))
    s = draw(st.integers(1, 5))
    E = P * s
    r = 0 if P == 1 else draw(st.integers(0, min(3, E - s)))
    shape = draw(st.sampled_from(["uniform", "zipf", "one", "random", "zeros"]))
    if shape == "random":
        loads = draw(st.lists(st.one_of(st.integers(0, 1000), st.floats(0, 1e6)), min_size=E, max_size=E))
    else:
        perm = draw(st.permutations(range(E)))
        scale = draw(st.integers(1, 5000))
        loads = [{"uniform": scale, "zipf": scale / (1 + perm[e]) ** 1.2, "one": scale * (perm[e] == 0),
                  "zeros": 0}[shape] for e in range(E)]
    return Layout(E, P, r), loads


def _check_invariants(pl: Placement, layout: Layout, loads) -> None:
    S = layout.slots_per_rank
    assert (pl.num_experts, pl.num_ranks, pl.num_slots, pl.slots_per_rank) == (
        layout.num_experts, layout.num_ranks, layout.num_slots, S)
    for p in range(layout.num_ranks):
        mine = pl.rank_slots(p)
        assert len(set(mine)) == len(mine) == S, f"rank {p} holds an expert twice: {mine}"
    for e in range(layout.num_experts):
        assert pl.replicas(e), f"expert {e} has no active replica"
    without = max(rank_loads(Placement.identity(layout.num_experts, layout.num_ranks), loads))
    assert max(rank_loads(pl, loads)) <= without * (1 + 1e-9) + 1e-12
    assert sum(rank_loads(pl, loads)) == pytest.approx(sum(loads), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems())
def test_policy_properties(policy, problem):
    layout, loads = problem
    pl = POLICIES[policy](loads, layout)
    _check_invariants(pl, layout, loads)
    assert POLICIES[policy](loads, layout) == pl  # a pure function
    assert POLICIES[policy](torch.tensor(loads, dtype=torch.float64), layout) == pl


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policies_relieve_a_hot_expert(policy):
    loads = [1000.0] + [10.0] * 15
    layout = Layout(16, 4, 1)
    before = balancedness(rank_loads(Placement.identity(16, 4), loads))
    pl = POLICIES[policy](loads, layout)
    assert len(pl.replicas(0)) == 4  # the hot expert on every rank
    assert balancedness(rank_loads(pl, loads)) > 2.5 * before


def test_even_split_cannot_always_match_a_balanced_layout():
    """Why ``greedy`` keeps standby slots and ``hierarchical`` falls back: loads [4, 1, 3, 2] on
    two ranks are balanced (5, 5) without replicas, but every all-active placement with one extra
    slot per rank has a maximum of at least 5.5."""
    loads, layout = [4, 1, 3, 2], Layout(4, 2, 1)
    pl = hierarchical(loads, layout)
    assert max(rank_loads(pl, loads)) == 5
    assert not all(greedy(loads, layout).active)


def test_policy_refuses_bad_loads():
    with pytest.raises(ValueError, match="loads has 3 entries, the layout has num_experts=4"):
        greedy([1, 2, 3], Layout(4, 2))
    with pytest.raises(ValueError, match=r"loads\[1\] = -1 must be a finite number >= 0"):
        hierarchical([1, -1, 3, 4], Layout(4, 2))


# ----------------------------------------------------------------------------- moves

@settings(max_examples=60, deadline=None)
@given(problem=problems(), seed=st.integers(0, 2**16))
def test_move_plan_rewrites_only_changed_slots_from_holders(problem, seed):
    layout, loads = problem
    old = greedy([float(v) for v in torch.rand(layout.num_experts, generator=torch.Generator().manual_seed(seed))],
                 layout)
    new = hierarchical(loads, layout).aligned_to(old)
    moves = plan_moves(old, new)
    changed = [s for s in range(old.num_slots) if old.slots[s] != new.slots[s]]
    assert [m.dst for m in moves] == changed
    S = old.slots_per_rank
    for m in moves:
        assert old.slots[m.src] == new.slots[m.dst]
        if new.slots[m.dst] in old.rank_slots(m.dst // S):
            assert m.src // S == m.dst // S  # a local copy whenever the rank holds it
    # Simulated ranks: each slot's row is its expert's id; after the moves every slot holds its new expert.
    world = [torch.tensor(old.rank_slots(p), dtype=torch.float32).view(S, 1).repeat(1, 3) for p in range(old.num_ranks)]
    after = [w.clone() for w in world]
    for m in moves:
        after[m.dst // S][m.dst % S] = world[m.src // S][m.src % S]
    assert all(torch.equal(after[p][:, 0], torch.tensor(new.rank_slots(p), dtype=torch.float32))
               for p in range(old.num_ranks))


def test_local_moves_run_without_a_group_and_keep_every_byte():
    old = Placement(4, 2, (0, 1, 2, 2, 3, 0))
    new = Placement(4, 2, (1, 0, 2, 3, 2, 0))  # rank 0 swaps its slots: local copies only
    moves = plan_moves(old, new)
    assert moves == (SlotMove(0, 1), SlotMove(1, 0), SlotMove(3, 4), SlotMove(4, 3))
    w = torch.randn(3, 5, 4)
    fp8 = quantize_weight(torch.randn(3, 8, 16), "fp8_token")
    snapshot = (w.clone(), fp8.data.view(torch.uint8).clone(), fp8.scale.clone())
    stats = move_slots([w, fp8.data, fp8.scale], moves, 3, ep_rank=0, group=None)
    assert (stats.copied, stats.received, stats.sent) == (2, 0, 0)
    assert torch.equal(w[0], snapshot[0][1]) and torch.equal(w[1], snapshot[0][0]) and torch.equal(w[2], snapshot[0][2])
    assert torch.equal(fp8.data.view(torch.uint8)[0], snapshot[1][1]) and torch.equal(fp8.scale[1], snapshot[2][0])
    with pytest.raises(ValueError, match="moves cross ranks but there is no EP group"):
        move_slots([w], plan_moves(old, Placement(4, 2, (0, 1, 3, 2, 3, 1))), 3, ep_rank=0, group=None)


# ----------------------------------------------------------------------------- loads

def test_load_window_counts_the_last_forwards_only():
    c = LoadCounter(4, window=2)
    for ids in ([[0, 1], [0, 2]], [[3, 0]], [[1, 1], [1, 1]]):
        c.record(torch.tensor(ids))
    assert c.read().tolist() == [1, 4, 0, 1]  # the first forward fell out of the window
    c.record(torch.empty(0, 2, dtype=torch.int64))
    assert c.read().tolist() == [0, 4, 0, 0]
    c.reset()
    assert c.read().tolist() == [0, 0, 0, 0]


# ----------------------------------------------------------------------------- sharding

@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "nvfp4"])
def test_a_slot_holds_its_logical_expert_bit_for_bit(scheme):
    cfg = MoEConfig(num_experts=16, top_k=2, hidden_size=32, intermediate_size=64)
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size, generator=gen)
    down = torch.randn(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, generator=gen)
    pl = hierarchical([50.0] + [1.0] * 15, Layout(16, 2, 3))
    quant = QuantConfig(scheme)
    full = shard_experts(gate_up, down, cfg, quant, ShardSpec(0, 16))
    for rank in range(2):
        spec = shard_spec(ParallelConfig(2, 1, True), rank, 16, pl)
        assert spec.logical_experts == pl.rank_slots(rank) and spec.expert_stop - spec.expert_start == 11
        mine = shard_experts(gate_up, down, cfg, quant, spec)
        for slot, e in enumerate(spec.logical_experts):
            for got, want in ((mine.gate_up, full.gate_up), (mine.down, full.down)):
                if isinstance(got, QuantizedWeight):
                    for a, b in ((got.data, want.data), (got.scale, want.scale), (got.global_scale, want.global_scale)):
                        assert (a is None) == (b is None)
                        if a is not None:
                            assert torch.equal(to_wire(a[slot]), to_wire(b[e]))
                else:
                    assert torch.equal(got[slot], want[e])
    with pytest.raises(ValueError, match="does not fit layout dp2-tp1-noep"):
        shard_spec(ParallelConfig(2, 1, False), 0, 16, pl)

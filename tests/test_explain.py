"""`moeshard check --explain` and the collective trace: each planted fault (tests/faults.py) is
explained by stage, rank and token or expert; a hang by who waits where and who never came.

One world per fault, one case in it (a spawn per fault: they need different layers)."""

import json

import faults
import pytest
import torch

from moeshard.cli import main
from moeshard.config import QuantConfig
from moeshard.harness.cases import MatrixOptions, generate
from moeshard.harness.runner import Runner
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.trace import ENTERED, RAISED, RETURNED, CollectiveTrace, explain_divergence, traced
from moeshard.presets import PRESETS
from moeshard.stages import STAGES, StageRecorder
from moeshard.weights import MoEWeights


def _case(layout, quant, backend, tokens, preset="deepseek-v3", dtype="bfloat16"):
    p = ParallelConfig.parse(layout)
    opts = MatrixOptions(world_sizes=(p.world_size,), layouts=(p,), quants=(quant,), dtypes=(dtype,),
                         tokens_per_rank=tokens, backends=(backend,), presets=(preset,), eplb="off")
    (case,) = [c for c in generate(opts) if not c.skipped]
    return case


def _explained(fault, case):
    (outcome,) = Runner(layer_factory=fault, case_timeout_s=30, explain="all").run([case])
    return outcome


def test_a_row_dropped_on_one_rank_under_sp_is_named_missing_with_its_token_and_expert():
    case = _case("dp1-tp2-ep", "none", "allgather_reducescatter", (7,))
    o = _explained(faults.DropsRowUnderSP, case)
    assert o.status == "fail"
    first = o.stages.first
    assert (first.stage, first.rank, first.kind) == ("dispatch", 1, "missing"), o.explanation
    assert o.stages.wrong["dispatch"] == {1: 1}
    assert first.expert in range(8, 16) and first.token is not None and first.slot is not None  # rank 1's experts
    assert o.explanation[0].startswith("stage dispatch, rank 1: rows for expert") and "never arrive (1 row)" in o.explanation[0]


def test_a_mis_scaled_tp_slice_is_named_by_expert_and_rank():
    case = _case("dp1-tp2-noep", "none", "local", (64,), dtype="float32")
    o = _explained(faults.MisScaledTPSlice, case)
    first = o.stages.first
    assert (first.stage, first.rank, first.expert) == ("experts", 1, 1), o.explanation
    assert set(o.stages.wrong["experts"]) == {1}  # TP rank 0's slice of expert 1 is right
    assert "expert 1 is off" in o.explanation[0]


def test_scales_sent_in_the_wrong_order_arrive_with_another_tokens_scales():
    case = _case("dp2-tp1-ep", "fp8_token", "all2all", (5, 7))
    o = _explained(faults.ScalesReversedInDispatch, case)
    first = o.stages.first
    assert (first.stage, first.kind, first.source_rank) == ("dispatch", "scales", 0), o.explanation
    assert "routing" not in o.stages.wrong and "payload" not in o.stages.wrong  # what rank 0 built was right
    assert "arrive with another token's scales" in o.explanation[0] and "(those of token" in o.explanation[1]


def test_shared_experts_applied_twice_under_sp_are_named_at_the_shared_stage():
    case = _case("dp1-tp2-ep", "none", "allgather_reducescatter", (7,))
    o = _explained(faults.SharedTwiceUnderSP, case)
    first = o.stages.first
    assert (first.stage, first.rank) == ("shared", 0) and first.token == 0, o.explanation
    assert set(o.stages.wrong) == {"shared", "output"}
    assert o.stages.wrong["shared"] == {0: 4, 1: 3}  # 7 tokens: SP chunks of 4 and 3, every row


def test_a_router_that_breaks_ties_differently_on_one_rank_is_named_at_routing():
    case = _case("dp2-tp1-ep", "none", "all2all", (64, 64), preset="mixtral-8x7b")
    o = _explained(faults.TiesBrokenHighOnRank1, case)
    first = o.stages.first
    assert (first.stage, first.rank, first.dp_rank) == ("routing", 1, 1), o.explanation
    assert set(o.stages.wrong["routing"]) == {1} and first.global_token == 64 + first.token
    assert first.expected.split(" weights")[0] != first.got.split(" weights")[0]


def test_a_rank_that_skips_the_combine_collective_is_named_by_the_collective_trace():
    case = _case("dp2-tp1-ep", "none", "all2all", (0, 5), preset="mixtral-8x7b", dtype="float32")
    (o,) = Runner(layer_factory=faults.SkipsCombineWhenEmpty, case_timeout_s=20).run([case])
    assert o.status == "error"
    head, *details = o.explanation
    assert head.startswith("ranks part at collective #4 of the case: rank 1 ") and "all_to_allv (ep)" in head, head
    assert "< combine" in head and "rank 0 never entered it (it finished the case)" in head, head
    assert any(d.startswith("rank 0 never entered collective #4: after all_to_allv #3") and "< dispatch" in d
               for d in details), details


@pytest.mark.parametrize("layout,quant,backend,tokens", [
    ("dp2-tp2-ep", "nvfp4", "all2all", (7, 1)),
    ("dp1-tp2-ep", "fp8_token", "low_latency", (5,)),  # padded expert blocks: the padding is not compared
    ("dp2-tp1-ep", "fp8_tensor", "low_latency", (0, 6)),
])
def test_clean_cases_are_within_every_stage_and_explaining_changes_no_number(layout, quant, backend, tokens):
    case = _case(layout, quant, backend, tokens)
    plain, explained = Runner().run([case])[0], Runner(explain="all").run([case])[0]
    assert plain.status == explained.status == "pass", (plain.reason, explained.reason)
    assert explained.explanation[0] == "every stage within its bound on every rank", explained.explanation
    assert [r.max_abs_err for r in plain.ranks] == [r.max_abs_err for r in explained.ranks]


def test_recording_is_off_by_default_and_exact_when_on():
    cfg = PRESETS["qwen2-57b-a14b"].config("small", torch.bfloat16)
    w = MoEWeights.random(cfg, torch.Generator().manual_seed(1))
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(cfg.dtype)
    for quant in (QuantConfig(), QuantConfig("nvfp4"), QuantConfig("fp8_block", True)):
        plain = MoELayer(cfg, quant=quant, weights=w)
        assert plain.recorder is None and plain.backend.recorder is None
        rec = StageRecorder()
        recorded = MoELayer(cfg, quant=quant, weights=w, recorder=rec)
        assert torch.equal(plain(x), recorded(x))
        assert set(rec.stages) == {"routing", "payload", "dispatch", "experts", "combine", "shared", "output"}
        assert rec.stages["experts"]["y"].shape == (9 * cfg.top_k, cfg.hidden_size)
    with pytest.raises(ValueError, match="is not one of"):
        StageRecorder().record("nope", x=x)
    assert STAGES[0] == "routing" and STAGES[-1] == "output"


def test_the_trace_ring_keeps_the_last_entries_and_their_state():
    trace = CollectiveTrace(capacity=4)
    trace.case = 3
    for i in range(6):
        with traced(trace, "all_to_allv", "ep", torch.zeros(i, 2), send=[i, 1], recv=[1, i]):
            pass
    with pytest.raises(RuntimeError):
        with traced(trace, "all_gatherv", "tp", torch.zeros(1), send=[1, 2]):
            raise RuntimeError("boom")
    token = trace.enter("exchange_counts", "ep", send=[2, 2])
    entries = trace.entries()
    assert [e.seq for e in entries] == [5, 6, 7, 8] and all(e.case == 3 for e in entries)
    assert [e.state for e in entries] == [RETURNED, RETURNED, RAISED, ENTERED]
    assert entries[0].send == (4, 1) and entries[0].recv == (1, 4) and entries[0].numel == 8
    assert entries[0].site.startswith("tests/test_explain.py:") or "test_explain.py:" in entries[0].site
    shared = CollectiveTrace.shared(4)
    writer, reader = CollectiveTrace(4, shared), CollectiveTrace(4, shared)
    writer.enter("all_reduce_max", "ep", dtype="float32")
    assert [e.op for e in reader.entries()] == ["all_reduce_max"]
    assert token[0] == 8


def test_the_divergence_diff_names_who_waits_where_and_who_never_came():
    def entries(*ops):
        t = CollectiveTrace(16)
        t.case = 2
        for op, state, send, recv in ops:
            record = t.enter(op, "ep", send=send, recv=recv, site="dispatch/all2all.py:84 combine")
            if state != ENTERED:
                t.leave(record, state)
        return t.entries()

    traces = {0: entries(("exchange_counts", RETURNED, [1, 2], ()), ("all_to_allv", RETURNED, [1, 2], [1, 3])),
              1: entries(("exchange_counts", RETURNED, [3, 0], ()), ("all_to_allv", RETURNED, [3, 0], [2, 0]),
                         ("all_to_allv", ENTERED, [2, 0], [3, 0]))}
    lines = explain_divergence(traces, 2, 2, {0: "it raised ValueError (bad) at x.py:1 f"}, ep_members=[0, 1])
    assert lines[0].startswith("ranks part at collective #3 of the case: rank 1 waits in all_to_allv (ep)")
    assert "rank 0 never entered it (it raised ValueError (bad) at x.py:1 f)" in lines[0]
    assert "all_to_allv #3 (ep, send [2, 0], recv [3, 0])" in lines[2]
    # sizes that do not fit each other, though every rank entered and left the collective
    traces[1] = entries(("exchange_counts", RETURNED, [3, 0], ()), ("all_to_allv", RETURNED, [3, 0], [1, 3]))
    traces[0] = entries(("exchange_counts", RETURNED, [1, 2], ()), ("all_to_allv", RETURNED, [1, 2], [1, 0]))
    lines = explain_divergence(traces, 2, 2, {}, ep_members=[0, 1])
    assert lines[0].startswith("the sizes of collective #2 of the case (all_to_allv) do not fit: "), lines
    assert "rank 0 sends 2 rows to rank 1, which expects 1 from it" in lines[0]
    assert "rank 1 sends 3 rows to rank 0, which expects 0 from it" in lines[0]


def test_cli_explain_json(tmp_path, capsys):
    path = tmp_path / "x.json"
    assert main(["check", "--explain", "--only", "dp1-tp1-noep/local/nvfp4/bfloat16/deepseek-v3/t5",
                 "--quants", "nvfp4", "--world-sizes", "1", "--presets", "deepseek-v3", "--tokens-per-rank", "5",
                 "--json", str(path)]) == 0
    (case,) = json.loads(path.read_text())["cases"]
    assert case["stages"]["first"] is None and case["explanation"][0] == "every stage within its bound on every rank"
    assert "explain: every stage within its bound" in capsys.readouterr().out


def test_a_size_mismatch_caught_by_the_size_checks_is_diffed_too():
    case = _case("dp2-tp1-ep", "none", "allgather_reducescatter", (3, 5), preset="mixtral-8x7b", dtype="float32")
    (o,) = Runner(layer_factory=faults.MiscountsOnRank1, case_timeout_s=20).run([case])
    assert o.status == "error" and "CollectiveSizeError" in o.reason
    head = o.explanation[0]
    assert head.startswith("ranks part at collective #3 of the case:"), o.explanation
    assert "rank 1 failed in all_gatherv (ep)" in head and "rank 0 " in head, head
    assert "the sizes do not fit: the ranks of all_gatherv disagree on the sizes: rank 0 [3, 5], rank 1 [3, 6]" \
        in o.explanation, o.explanation
    assert any("rank 1 was inside all_gatherv #3 (ep, sizes [3, 6]" in line and "CollectiveSizeError" in line
               for line in o.explanation), o.explanation


def _load_balancing_case():
    (case,) = [c for c in generate(MatrixOptions(world_sizes=(2,), eplb="default"))
               if c.eplb is not None and c.backend == "all2all" and not c.skipped]
    assert case.eplb.redundant_per_rank == 1  # replicas on both ranks
    return case


def test_a_load_balancing_case_is_explained_at_every_stage():
    """Under a placement which rank computes a (token, k) depends on the replicas: --explain
    matches each pair to whichever rank received it, compares every stage, and the numbers are
    the same with and without recording."""
    case = _load_balancing_case()
    plain, explained = Runner().run([case])[0], Runner(explain="all").run([case])[0]
    assert plain.status == explained.status == "pass", (plain.reason, explained.reason)
    assert explained.explanation == ["every stage within its bound on every rank",
                                     "stages compared: routing, payload, dispatch, experts, combine, output"], \
        explained.explanation
    assert [r.max_abs_err for r in plain.ranks] == [r.max_abs_err for r in explained.ranks]


def _unquantized_load_balancing_case():
    """A placement with a replica on each rank, float32, 16 tokens on each DP rank."""
    (case,) = [c for c in generate(MatrixOptions(world_sizes=(2,), eplb="full", quants=("none",), dtypes=("float32",),
                                                 tokens_per_rank=(16, 16), backends=("all2all",),
                                                 presets=("mixtral-8x7b",)))
               if c.eplb is not None and c.eplb.redundant_per_rank == 1 and c.eplb.skew == "zipf"]
    return case


def test_a_mis_scaled_replica_is_named_by_expert_and_rank():
    """Planted fault: one slot's copy of an expert 3% off on rank 1, under load balancing."""
    case = _unquantized_load_balancing_case()
    o = _explained(faults.MisScalesFirstSlotOnRank1, case)
    first = o.stages.first
    assert o.status == "fail" and (first.stage, first.rank) == ("experts", 1), o.explanation
    assert set(o.stages.wrong["experts"]) == {1}  # the other copies of that expert are right
    assert first.expert is not None and f"expert {first.expert} is off" in o.explanation[0], o.explanation


def test_a_row_no_replica_receives_is_named_missing_under_load_balancing():
    case = _unquantized_load_balancing_case()
    o = _explained(faults.UnroutesLastRowOnRank1, case)
    first = o.stages.first
    assert o.status == "fail" and first.stage == "dispatch" and first.kind == "missing", o.explanation
    assert first.token is not None and first.slot is not None

"""Load balancing in ``moeshard check`` (the matrix's EPLB cases, and the faults they catch) and
``moeshard eplb`` (the synthetic trace on any machine, the layer timing on CPU ranks)."""

import json

import eplb_faults
import pytest

from moeshard.cli import main
from moeshard.dispatch.registry import BACKENDS
from moeshard.eplb.trace import TraceOptions, run_trace
from moeshard.harness.cases import DEFAULT_EPLB, EPLB_REDUNDANT, EPLB_SKEWS, LAYOUTS, MatrixOptions, generate, select_ids
from moeshard.harness.runner import Runner
from moeshard.parallel.config import ParallelConfig

EP_BACKENDS = {b for b, s in BACKENDS.items() if s.layouts == "ep"}


def _eplb(opts: MatrixOptions):
    return [c for c in generate(opts) if c.eplb is not None]


def test_default_matrix_has_a_few_eplb_cases_and_the_flag_has_them_all():
    default = _eplb(MatrixOptions())
    assert len(default) == len(DEFAULT_EPLB) and not any(c.skipped for c in default)
    assert {c.backend for c in default} == EP_BACKENDS
    assert any(c.parallel.is_sequence_parallel for c in default)
    full = _eplb(MatrixOptions(eplb="full"))
    valid = [c for c in full if not c.skipped]
    ep_layouts = {ParallelConfig(*t) for w in (2, 4) for t in LAYOUTS[w] if t[2]}
    combos = {(c.parallel, c.backend, c.eplb.redundant_per_rank, c.eplb.skew) for c in valid}
    assert combos == {(p, b, r, s) for p in ep_layouts for b in EP_BACKENDS for r in EPLB_REDUNDANT for s in EPLB_SKEWS}
    assert {c.id for c in default} <= {c.id for c in full} and len({c.id for c in full}) == len(full)
    assert not _eplb(MatrixOptions(eplb="off"))
    assert {c.quant.name for c in valid} >= {"none", "fp8_tensor", "nvfp4", "fp8_block", "fp8_token+defer"}


def test_check_lists_and_selects_eplb_cases(capsys):
    assert main(["check", "--eplb", "--world-sizes", "2", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if "/eplb-" in line]
    assert len(listed) == len(_eplb(MatrixOptions(world_sizes=(2,), eplb="full")))
    # --only takes any listed id without --eplb
    assert main(["check", "--only", listed[-1], "--list"]) == 0
    assert listed[-1] in capsys.readouterr().out


def _cases(ids):
    return select_ids(generate(MatrixOptions(world_sizes=(2,), eplb="full")), ids)


PASSING = ["dp2-tp1-ep/all2all/fp8_tensor/float32/mixtral-8x7b/t0,5/eplb-r1-zipf-hierarchical",
           "dp2-tp1-ep/low_latency/nvfp4/bfloat16/qwen3-30b-a3b/t1,0/eplb-r2-one-greedy",
           "dp1-tp2-ep/all2all/fp8_tensor/bfloat16/qwen3-30b-a3b/t3/eplb-r2-one-hierarchical"]  # SP


def test_eplb_cases_pass_on_cpu_ranks():
    """Two ranks, one spawn (the matrix runs the 4-rank layouts: ``moeshard check``)."""
    outcomes = Runner().run(_cases(PASSING))
    assert [o.status for o in outcomes] == ["pass"] * len(PASSING), [(o.case.id, o.reason) for o in outcomes]


def _one_case(layout, backend, quant, tokens, r, skew, policy="hierarchical"):
    opts = MatrixOptions(world_sizes=(ParallelConfig.parse(layout).world_size,), layouts=(ParallelConfig.parse(layout),),
                         backends=(backend,), quants=(quant,), dtypes=("float32",), tokens_per_rank=tokens,
                         presets=("qwen3-30b-a3b",), eplb="full")
    return [c for c in _eplb(opts) if c.eplb.redundant_per_rank == r and c.eplb.skew == skew][:1]


@pytest.mark.parametrize("fault, layout, quant, expect", [
    ("ChoosesReplicaByTPRank", "dp1-tp2-ep", "none", "chose different replicas for the same tokens"),
    ("ForgetsTheChunkOffset", "dp1-tp2-ep", "none", "the replicas the TP ranks used differ"),
    ("RebalanceMovesNothing", "dp2-tp1-ep", "none", "after the rebalance: max error"),
    ("ReplicasKeepTheirOwnAmax", "dp2-tp1-ep", "fp8_tensor", "max error"),
])
def test_planted_eplb_faults_are_reported(fault, layout, quant, expect):
    dp = ParallelConfig.parse(layout).dp
    # 41 tokens: under SP the second chunk starts at row 21, an offset that changes the replica of
    # an expert with 2 replicas (an even one would not).
    cases = _one_case(layout, "all2all", quant, (41,) * dp, 2, "zipf")
    (o,) = Runner(layer_factory=getattr(eplb_faults, fault)).run(cases)
    assert o.status == "fail" and expect in o.reason, (o.status, o.reason)


# ----------------------------------------------------------------------------- moeshard eplb

def test_trace_balancing_improves_balancedness_and_the_hot_rank_bytes():
    result = run_trace(TraceOptions(num_experts=16, top_k=2, ranks=4, tokens_per_rank=512, steps=4, zipf=1.0,
                                    hidden_size=64, intermediate_size=32, redundant_per_rank=(0, 2)))
    before = result["before"]
    rows = {(r["policy"], r["redundant_per_rank"]): r for r in result["rows"]}
    assert rows["greedy", 0]["balancedness"] == before["balancedness"]  # greedy without slots: the layout itself
    for policy in ("greedy", "hierarchical"):
        after = rows[policy, 2]
        assert after["balancedness"] > before["balancedness"] + 0.05
        assert after["dispatch_recv_bytes_max"] < before["dispatch_recv_bytes_max"]
        assert after["mean_rank_copies"] == before["mean_rank_copies"] == 512 * 2  # every copy lands once


def test_eplb_command_writes_json_and_refuses_bad_options(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert main(["eplb", "--experts", "16", "--top-k", "2", "--ranks", "4", "--tokens", "256", "--steps", "4",
                 "--redundant-per-rank", "0,1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "balancedness" in out and "hierarchical" in out
    data = json.loads(path.read_text())
    assert {r["policy"] for r in data["rows"]} == {"greedy", "hierarchical"} and data["before"]["balancedness"] < 1
    assert main(["eplb", "--experts", "16", "--ranks", "4", "--redundant-per-rank", "13"]) == 2
    assert "a rank would hold two replicas" in capsys.readouterr().err
    assert main(["eplb", "--experts", "16", "--ranks", "4", "--policies", "best"]) == 2
    assert "policy: 'best' is not one of ['greedy', 'hierarchical']" in capsys.readouterr().err


def test_eplb_layer_timing_runs_on_cpu_ranks(tmp_path, capsys):
    path = tmp_path / "layer.json"
    assert main(["eplb", "--layer", "--device", "cpu", "--world-size", "2", "--preset", "mixtral-8x7b", "--tokens", "32",
                 "--redundant-per-rank", "0,1", "--reps", "1", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    runs = [r["run"] for r in data["records"]]
    assert runs == ["no replicas", "hierarchical R/rank 0", "hierarchical R/rank 1"]
    for r in data["records"]:
        assert sum(r["rank_copies"]) == 2 * 32 * 2 and r["layer_ms"] > 0
    assert "say nothing about GPUs" in capsys.readouterr().out

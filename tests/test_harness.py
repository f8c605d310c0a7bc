"""The harness itself: it reports planted faults, failing ranks and hung ranks, never hangs, and
its command line keeps its contract (signals, Ctrl-C and killed ranks: tests/test_signals.py)."""

import json
import time

import faults
import pytest

from moeshard.cli import main
from moeshard.harness.cases import MatrixOptions, generate, quant_configs, select_ids
from moeshard.harness.runner import Runner
from moeshard.parallel.config import ParallelConfig
from moeshard.presets import PRESETS

EP2 = ParallelConfig.parse("dp2-tp1-ep")
SP = ParallelConfig.parse("dp2-tp2-ep")


def _cases(layouts, quants=("none",), dtypes=("float32",), tokens=None, backends=None):
    opts = MatrixOptions(world_sizes=tuple(sorted({p.world_size for p in layouts})), layouts=tuple(layouts),
                         quants=quants, dtypes=dtypes, tokens_per_rank=tokens, backends=backends, eplb="off")
    return [c for c in generate(opts) if not c.skipped and c.parallel in layouts]


def test_clean_layer_passes_the_same_cases():
    outcomes = Runner().run(_cases([EP2], tokens=(5, 3)))
    assert outcomes and all(o.status == "pass" for o in outcomes), [(o.case.id, o.reason) for o in outcomes]


def test_dropped_rows_are_reported_as_failure():
    outcomes = Runner(layer_factory=faults.DropsLastDPRankRows).run(_cases([EP2], tokens=(5, 3)))
    assert outcomes and all(o.status == "fail" for o in outcomes)
    assert all("rank 1 returned shape (2, 128), expected (3, 128)" in o.reason for o in outcomes), outcomes[0].reason


def test_mis_scaled_expert_is_reported_as_failure():
    # Enough tokens that expert 1 receives rows in every case, whatever preset the case rotates to.
    cases = _cases([ParallelConfig.parse("dp1-tp1-noep")], tokens=(40,)) + _cases([EP2], tokens=(21, 19))
    outcomes = Runner(layer_factory=faults.MisScalesOneExpert).run(cases)
    assert outcomes and all(o.status == "fail" for o in outcomes), [(o.case.id, o.status) for o in outcomes]
    assert all("max error" in o.reason for o in outcomes)


def test_raising_rank_is_reported_and_the_run_goes_on():
    cases = _cases([EP2], tokens=(2, 2))
    start = time.monotonic()
    outcomes = Runner(layer_factory=faults.RaisesOnRank1, case_timeout_s=20).run(cases[:2])
    assert time.monotonic() - start < 60
    assert [o.status for o in outcomes] == ["error", "error"]  # respawned for the second case
    assert "rank 1 raised RuntimeError: planted failure on rank 1" in outcomes[0].reason


def test_hung_rank_is_reported_not_waited_for():
    cases = _cases([EP2], tokens=(2, 2))[:1]
    start = time.monotonic()
    outcomes = Runner(layer_factory=faults.SleepsOnRank1, case_timeout_s=4).run(cases)
    elapsed = time.monotonic() - start
    assert elapsed < 40, elapsed
    (o,) = outcomes
    assert o.status == "error"
    assert "[1] hung" in o.reason, o.reason          # the silent rank is named
    assert "rank 0 raised" in o.reason, o.reason     # its peer timed out in a collective and said so


def test_case_ids_are_stable_and_selectable():
    cases = generate(MatrixOptions(world_sizes=(1, 2)))
    again = generate(MatrixOptions(world_sizes=(1, 2)))
    assert [c.id for c in cases] == [c.id for c in again] and [c.seed for c in cases] == [c.seed for c in again]
    picked = select_ids(cases, [cases[5].id, cases[2].id])
    assert [c.id for c in picked] == [cases[5].id, cases[2].id] and picked[0].seed == cases[5].seed
    with pytest.raises(ValueError, match="no case with id 'nope'"):
        select_ids(cases, ["nope"])


def test_default_matrix_covers_every_layout_backend_and_quant():
    # (the load-balancing cases are checked in tests/test_eplb_check.py)
    cases = [c for c in generate(MatrixOptions()) if not c.skipped and c.eplb is None]
    combos = {(c.parallel, c.backend, c.quant) for c in cases}
    assert {c.world_size for c in cases} == {1, 2, 4}
    sp = [c for c in cases if c.parallel == SP]
    assert {c.backend for c in sp} == {"allgather_reducescatter", "all2all", "low_latency"}
    assert {c.quant for c in sp} == set(quant_configs())  # quantized shared experts included
    assert any(0 in c.tokens for c in cases) and any(c.parallel.is_sequence_parallel and min(c.tokens) < c.parallel.tp
                                                      for c in cases)
    assert len(combos) == len(cases) // 2  # one case per dtype for every (layout, backend, quant)


def test_cli_json_schema_and_exit_code(tmp_path, capsys):
    path = tmp_path / "out.json"
    code = main(["check", "--world-sizes", "1", "--quants", "none,fp8_block+defer", "--json", str(path)])
    assert code == 0
    doc = json.loads(path.read_text())
    keys = {"id", "layout", "backend", "quant", "dtype", "num_experts", "top_k", "hidden", "intermediate", "tokens",
            "max_abs_err", "atol", "rtol", "status", "reason"}
    assert doc["cases"] and all(keys <= set(c) for c in doc["cases"])
    assert set(doc["cases"][0]["layout"]) == {"dp", "tp", "ep", "sp"}
    assert doc["summary"]["fail"] == doc["summary"]["error"] == 0 and doc["summary"]["pass"] > 0
    out = capsys.readouterr().out
    assert "passed, 0 failed" in out and "wall time" in out


def test_cli_refuses_bad_options(capsys):
    assert main(["check", "--world-sizes", "3"]) == 2
    assert "--world-sizes: 3 is not one of [1, 2, 4, 8]" in capsys.readouterr().err
    assert main(["check", "--quants", "int4"]) == 2
    assert main(["check", "--layouts", "dp2-tpx-ep"]) == 2
    assert main(["check", "--layouts", "dp2-tp1-bogus", "--list"]) == 2  # not silently read as EP off
    assert "--layouts: 'dp2-tp1-bogus' is not a layout; write dp<D>-tp<T>-ep" in capsys.readouterr().err


def test_cli_list_and_tokens_per_rank(capsys):
    assert main(["check", "--list", "--layouts", "dp2-tp2-ep", "--tokens-per-rank", "0,1", "--quants", "nvfp4"]) == 0
    out = capsys.readouterr().out
    assert "dp2-tp2-ep/all2all/nvfp4/float32/" in out and "/t0,1" in out and "cases valid" in out
    assert "not applicable: local runs without expert parallelism only" in out


def test_full_uses_larger_shapes_and_world_size_8(capsys):
    assert main(["check", "--full", "--list", "--quants", "none", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "@medium/" in out and "dp8-tp1-ep/" in out and "dp2-tp4-ep/" in out
    ids = [line.split()[0] for line in out.splitlines() if line.startswith("dp4-tp1-ep/all2all/none/")]
    assert len({i.split("/")[4] for i in ids}) == len(PRESETS)  # every preset, not one in rotation


def test_cli_prints_a_compact_summary_and_the_full_table_on_request(tmp_path, capsys):
    """Default: one row per layout x backend that ran (not one per case); the combinations that
    are not applicable by construction get one counting line, not rows, and are not called
    skipped; --verbose: every case, with the reasons; --json: every case either way."""
    path = tmp_path / "out.json"
    args = ["check", "--world-sizes", "2", "--layouts", "dp2-tp1-ep,dp1-tp2-noep", "--quants", "none",
            "--dtypes", "float32", "--no-eplb", "--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 4, out  # the combinations that ran, of 2 layouts x 4 backends
    assert not any("not applicable" in r for r in rows) and "skipped" not in out
    assert ("not applicable by construction: 4 layout x backend combinations (4 cases); --list or --verbose shows "
            "each with its reason") in out and "err/bound" in out
    assert "4 passed, 0 failed, 0 errors; 4 of 8 cases not applicable by construction" in out
    doc = json.loads(path.read_text())
    assert {c["status"] for c in doc["cases"]} == {"pass", "not_applicable"} and len(doc["cases"]) == 8
    assert all(0 < c["err_to_bound"] <= 1 for c in doc["cases"] if c["status"] == "pass")
    assert doc["summary"]["not_applicable"] == 4 and doc["summary"]["valid"] == 4
    assert main(args + ["--verbose"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 8 and sum(" passed " not in r and "pass" in r for r in rows) == 4
    assert sum("not applicable" in r for r in rows) == 4


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
def test_shards_cut_from_cached_experts_equal_the_layers_own_bit_for_bit(scheme):
    """The harness quantizes every expert once per weights and scheme and cuts each rank's shard
    from that (CaseData.local_experts); it must be what MoELayer's shard_experts makes."""
    import torch

    from moeshard.config import QuantConfig
    from moeshard.harness.inputs import CaseData
    from moeshard.quant import QuantizedWeight
    from moeshard.sharding import shard_experts, shard_spec

    data = CaseData()
    for layout in ("dp1-tp4-noep", "dp2-tp2-ep"):
        p = ParallelConfig.parse(layout)
        case = _cases([p], quants=(scheme,), dtypes=("bfloat16",))[0]
        cfg, w = case.moe_config(), data.weights(case)
        for rank in (1, 3):
            spec = shard_spec(p, rank, cfg.num_experts)
            got, want = data.local_experts(case, spec), shard_experts(w.gate_up, w.down, cfg, QuantConfig(scheme), spec)
            for a, b in ((got.gate_up, want.gate_up), (got.down, want.down)):
                if isinstance(b, QuantizedWeight):
                    assert a.shape == b.shape and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
                    assert (a.global_scale is None) == (b.global_scale is None)
                    assert a.global_scale is None or torch.equal(a.global_scale, b.global_scale)
                else:
                    assert torch.equal(a, b)
            (got.down.data if isinstance(got.down, QuantizedWeight) else got.down).fill_(0)
            again = data.local_experts(case, spec).down  # a copy each time: the cache is untouched
            assert bool(((again.data if isinstance(again, QuantizedWeight) else again).view(torch.uint8) != 0).any())

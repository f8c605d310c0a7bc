"""Tests of moeshard.parallel: config, groups, uneven collectives, sequence chunks, spawn.

Multi-rank cases (tests/multirank.py) run in one gloo spawn per world size (2 and 4; 8 with
--world-size-8); each test below asserts one case's records from every rank.  The same cases run
over NCCL in one spawn per world size (2 and 4) where that many GPUs are visible, one test per
world size asserting every case.  The spawn-failure tests start their own small runs.
"""

from __future__ import annotations

import functools
import os
import time

import multirank
import pytest
import torch
import torch.distributed as dist

from moeshard.config import MoEConfig
from moeshard.parallel.collectives import all_gatherv
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.sequence import SequenceChunk, sequence_parallel_chunk
from moeshard.parallel.spawn import CLEAN_EXIT_WAIT_S, LocalWorld, RankFailure, spawn

SPAWN_TIMEOUT_S = 240.0
COLLECTIVE_TIMEOUT_S = 30.0  # a broken collective fails the run in 30 s instead of hanging it
GPUS = torch.cuda.device_count()


def _case_params():
    """(backend, world size, case id): gloo with 2 and 4 ranks (8 behind --world-size-8)."""
    params = []
    for backend, ws in [("gloo", 2), ("gloo", 4), ("gloo", 8)]:
        marks = [pytest.mark.world_size_8] if ws == 8 else []
        for case in multirank.build_cases(ws):
            params.append(pytest.param(backend, ws, case.id, marks=marks, id=f"{backend}{ws}-{case.id}"))
    return params


@pytest.fixture(scope="module")
def records():
    """(backend, world size) -> per-rank records of every case, from one spawn per pair."""
    cache: dict[tuple[str, int], object] = {}

    def get(backend: str, ws: int) -> list[dict]:
        key = (backend, ws)
        if key not in cache:
            try:
                cache[key] = spawn(multirank.run_cases, ws, args=(ws,), device="cuda" if backend == "nccl" else "cpu",
                                   timeout_s=SPAWN_TIMEOUT_S, pg_timeout_s=COLLECTIVE_TIMEOUT_S,
                                   preload=() if backend == "nccl" else ("moeshard.parallel.collectives",))
            except RankFailure as failure:
                cache[key] = failure
        if isinstance(cache[key], RankFailure):
            pytest.fail(f"the {backend} run with {ws} ranks failed:\n{cache[key]}")
        return cache[key]

    return get


@functools.cache
def _cases_by_id(ws: int) -> dict[str, multirank.Case]:
    return {case.id: case for case in multirank.build_cases(ws)}


@pytest.mark.parametrize("backend, ws, case_id", _case_params())
def test_multirank_case(records, backend, ws, case_id):
    per_rank = records(backend, ws)
    case = _cases_by_id(ws)[case_id]
    assert len(per_rank) == ws
    for rank, rank_records in enumerate(per_rank):
        multirank.check(case, rank, ws, rank_records[case_id])


@pytest.mark.parametrize("ws", [pytest.param(ws, marks=pytest.mark.skipif(
    GPUS < ws, reason=f"nccl cases need {ws} GPUs; {GPUS} visible")) for ws in (2, 4)])
def test_multirank_nccl(records, ws):
    """Every multi-rank case over NCCL, one rank per GPU, from one spawn: each rank's record is
    checked as in test_multirank_case, and every failing (case, rank) is reported."""
    per_rank = records("nccl", ws)
    assert len(per_rank) == ws
    cases = multirank.build_cases(ws)
    failures = []
    for case in cases:
        for rank, rank_records in enumerate(per_rank):
            try:
                multirank.check(case, rank, ws, rank_records[case.id])
            except AssertionError as exc:
                failures.append(f"{case.id}, rank {rank}: {exc}")
    shown = "\n".join(failures[:20]) + (f"\n... and {len(failures) - 20} more" if len(failures) > 20 else "")
    assert not failures, f"{len(failures)} of {len(cases) * ws} (case, rank) records over nccl are wrong:\n{shown}"


# ----------------------------------------------------------------------------- ParallelConfig

MOE = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=12)


def test_parallel_config_properties():
    cfg = ParallelConfig(dp=2, tp=2, enable_ep=True)
    assert (cfg.world_size, cfg.ep_size, cfg.is_sequence_parallel, cfg.name) == (4, 4, True, "dp2-tp2-ep")
    assert [(cfg.dp_rank(r), cfg.tp_rank(r), cfg.ep_rank(r)) for r in range(4)] == \
        [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    off = ParallelConfig(dp=2, tp=3)
    assert (off.world_size, off.ep_size, off.is_sequence_parallel, off.name) == (6, 1, False, "dp2-tp3-noep")
    assert [off.ep_rank(r) for r in range(6)] == [0] * 6
    assert ParallelConfig(dp=4, enable_ep=True).is_sequence_parallel is False
    assert ParallelConfig().name == "dp1-tp1-noep"


def test_parallel_config_local_experts():
    cfg = ParallelConfig(dp=2, tp=2, enable_ep=True)
    assert [list(cfg.local_experts(r, 8)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(ParallelConfig(dp=2, tp=2).local_experts(3, 8)) == list(range(8))
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the EP size 4"):
        cfg.local_experts(1, 6)


@pytest.mark.parametrize("kwargs, message", [
    ({"dp": 0}, "ParallelConfig.dp: must be a positive integer, got 0"),
    ({"tp": -2}, "ParallelConfig.tp: must be a positive integer, got -2"),
    ({"tp": 2.0}, "ParallelConfig.tp: must be a positive integer, got 2.0"),
    ({"dp": True}, "ParallelConfig.dp: must be a positive integer, got True"),
    ({"enable_ep": 1}, "ParallelConfig.enable_ep: must be a bool, got 1"),
])
def test_parallel_config_refuses_fields(kwargs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("text, want", [
    ("dp2-tp2-ep", (2, 2, True)), ("dp1-tp2-noep", (1, 2, False)), (" DP4-TP1-EP ", (4, 1, True)),
    ("2,2,on", (2, 2, True)), ("1,2,off", (1, 2, False)), ("2, 1, ON", (2, 1, True)),
])
def test_parallel_config_parse(text, want):
    p = ParallelConfig.parse(text)
    assert (p.dp, p.tp, p.enable_ep) == want
    assert ParallelConfig.parse(p.name) == p  # name and parse are one spelling


@pytest.mark.parametrize("text", ["dp2-tp1-bogus", "dp2-tp1", "dp2-tp1-ep-x", "dp2-tpx-ep", "2,2", "2,2,maybe",
                                  "dp-1-tp1-ep", ""])
def test_parallel_config_parse_is_strict(text):
    with pytest.raises(ValueError) as info:
        ParallelConfig.parse(text)
    message = str(info.value)
    assert message.startswith(f"{text!r} is not a layout; write dp<D>-tp<T>-ep, dp<D>-tp<T>-noep, "
                              f"<D>,<T>,on or <D>,<T>,off"), message


def test_parallel_config_parse_names_bad_values():
    with pytest.raises(ValueError, match=r"layout 'dp0-tp2-ep': ParallelConfig\.dp: must be a positive integer, got 0"):
        ParallelConfig.parse("dp0-tp2-ep")


def test_parallel_config_validate():
    ParallelConfig(dp=2, tp=2, enable_ep=True).validate(4, MOE, rank=0)
    ParallelConfig(dp=1, tp=4).validate(4, MOE)  # 12 % 4 == 0
    with pytest.raises(ValueError, match=r"ParallelConfig \(rank 3\): world size 4 does not match layout "
                                         r"dp2-tp1-noep: dp\*tp = 2\*1 = 2"):
        ParallelConfig(dp=2).validate(4, MOE, rank=3)
    with pytest.raises(ValueError, match=r"\(rank 1\): MoEConfig.num_experts=8 is not divisible by the EP size 3 "
                                         r"of layout dp3-tp1-ep; uneven expert placement is not supported"):
        ParallelConfig(dp=3, enable_ep=True).validate(3, MOE, rank=1)
    with pytest.raises(ValueError, match=r"ParallelConfig: MoEConfig.intermediate_size=12 is not divisible by "
                                         r"tp=8 of layout dp1-tp8-noep"):
        ParallelConfig(tp=8).validate(8, MOE)
    # EP on: experts are whole, so the intermediate size need not divide by tp.
    ParallelConfig(dp=1, tp=8, enable_ep=True).validate(8, MOE)
    ParallelConfig(dp=3).validate_world_size(3)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 4\), got 4"):
        ParallelConfig(dp=2, tp=2).tp_rank(4)


# ----------------------------------------------------------------------------- SequenceChunk (local)

@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_sequence_chunks_partition_rows(tp):
    for total in [0, 1, tp - 1, tp, tp + 1, 7, 64, 65]:
        x = torch.arange(max(total, 0) * 2, dtype=torch.float32).view(-1, 2)
        pieces = []
        for tp_rank in range(tp):
            chunk_x, chunk = sequence_parallel_chunk(x, tp_rank, tp)
            want = multirank.expected_chunk(total, tp_rank, tp)
            assert {k: getattr(chunk, k) for k in want} == want
            assert chunk_x.shape == (chunk.real, 2)
            pieces.append(chunk_x)
            assert chunk.rows_per_rank == [multirank.expected_chunk(total, t, tp)["real"] for t in range(tp)]
        assert torch.equal(torch.cat(pieces), x), f"T={total}, tp={tp}: chunks do not rebuild the input"


def test_sequence_chunk_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"SequenceChunk.tp_rank: must be an integer in \[0, 2\), got 2"):
        sequence_parallel_chunk(torch.zeros(3, 2), 2, 2)
    with pytest.raises(ValueError, match=r"SequenceChunk.tp: must be an integer >= 1, got 0"):
        SequenceChunk.of(3, 0, 0)


# ----------------------------------------------------------------------------- spawn

def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    time.sleep(600)  # rank 0 hangs (outside any collective, so nothing wakes it); spawn must stop it
    return "unreachable"


def _sleep_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(600)
    return f"rank {dist.get_rank()} done"


def _exit_on_rank_zero():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def _stuck_in_ep_group():
    groups = ParallelGroups.build(ParallelConfig(dp=2, enable_ep=True), side_channel=True)
    if dist.get_rank() == 1:
        time.sleep(600)
    start = time.monotonic()
    try:
        all_gatherv(torch.ones(1, 2), [1, 1], groups.ep_group, "ep")
    finally:
        print(f"rank 0 left all_gatherv after {time.monotonic() - start:.1f} s", flush=True)


def test_built_groups_inherit_the_process_group_timeout():
    # new_group alone would wait torch's 30-minute default; the EP group must give up after
    # the 3 s the run was started with.
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(_stuck_in_ep_group, 2, timeout_s=60, pg_timeout_s=3, grace_s=0.5)
    failure = info.value
    assert 0 in failure.errors and "all_gatherv" in failure.errors[0].traceback, str(failure)
    assert failure.missing == [1] and not failure.timed_out
    assert time.monotonic() - start < 30


def test_spawn_returns_per_rank_results_in_order():
    # Covered by every multirank test too; this pins the plain contract on a tiny run.
    assert spawn(_rank_and_tensor, 2, args=(5,), timeout_s=60) == [(0, 5), (1, 6)]


def _rank_and_tensor(offset):
    return dist.get_rank(), int(torch.tensor(offset + dist.get_rank()))


def test_spawn_reports_raising_rank_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(_raise_on_rank_one, 2, timeout_s=120, grace_s=1.0)
    elapsed = time.monotonic() - start
    failure = info.value
    assert list(failure.errors) == [1]
    assert failure.errors[1].type_name == "ValueError" and failure.errors[1].message == "boom on purpose"
    assert "_raise_on_rank_one" in failure.errors[1].traceback
    assert failure.missing == [0] and not failure.timed_out
    assert "rank 1 raised ValueError: boom on purpose" in str(failure)
    assert "ranks [0] were stopped after the failure above" in str(failure)
    assert elapsed < 60, f"spawn took {elapsed:.1f} s to report a failed rank"


def test_spawn_reports_rank_past_timeout_within_bound():
    timeout_s = 8.0
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(_sleep_on_rank_one, 2, timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    failure = info.value
    assert failure.timed_out and 1 in failure.missing and not failure.errors
    assert failure.results.get(0, "rank 0 done") == "rank 0 done"
    assert f"did not finish within {timeout_s:g} s" in str(failure) and "1]" in str(failure)
    assert elapsed < timeout_s + 8, f"spawn returned after {elapsed:.1f} s with timeout_s={timeout_s}"


def test_spawn_reports_rank_that_exits_without_result():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(_exit_on_rank_zero, 2, timeout_s=120, grace_s=1.0)
    failure = info.value
    assert 0 in failure.missing and failure.died == {0: 3} and failure.exitcodes[0] == 3
    assert not failure.timed_out
    assert "rank 0 exited with code 3 without reporting a result" in str(failure)
    assert time.monotonic() - start < 60


def _send_rank_tensors(n, channel):
    for i in range(n):
        channel.send((i, torch.full((2,), float(dist.get_rank()), dtype=torch.bfloat16)))
    return "done"


def test_local_world_streams_messages_in_order_then_how_each_rank_ended():
    seen, ends = {0: [], 1: []}, []
    with LocalWorld(2, timeout_s=60) as world:
        world.start(_send_rank_tensors, (3, world.channel))
        for event in world.events():
            if event.kind == "message":
                i, t = event.value
                assert torch.equal(t, torch.full((2,), float(event.rank), dtype=torch.bfloat16))
                seen[event.rank].append(i)
            else:
                assert seen[event.rank] == [0, 1, 2]  # every message before the rank's end
                ends.append((event.kind, event.rank, event.value))
        world.stop(CLEAN_EXIT_WAIT_S)
    assert sorted(ends) == [("finished", 0, "done"), ("finished", 1, "done")]
    assert world.all_finished and world.failure() is None and world.exitcodes == {0: 0, 1: 0}


def test_leaving_a_local_world_stops_every_rank():
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with LocalWorld(2, timeout_s=120) as world:
            world.start(_sleep_on_rank_one)
            for event in world.events():
                assert (event.kind, event.rank) == ("finished", 0)
                raise KeyboardInterrupt  # as Ctrl-C would, while rank 1 sleeps
    assert world.exitcodes[1] is not None and world.exitcodes[1] < 0  # rank 1 was terminated, not waited for
    assert world.exitcodes[0] is not None
    assert time.monotonic() - start < 30


def test_spawn_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"LocalWorld\.world_size: must be a positive integer, got 0"):
        spawn(_rank_and_tensor, 0)
    with pytest.raises(ValueError, match=r"LocalWorld\.device: must be 'cpu' or 'cuda', got 'tpu'"):
        spawn(_rank_and_tensor, 2, device="tpu")

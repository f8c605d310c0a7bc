"""Bounds of the local ranks' plumbing: a last report nobody reads does not keep a rank alive,
the rendezvous listens on loopback only, on a port of its own, torch's C++ log of a reported
rendezvous failure is held back, and a rendezvous that never completes is blamed on the ranks
that never came."""

from __future__ import annotations

import os
import time
from pathlib import Path

import faults
import pytest
import torch.multiprocessing as torch_mp

from moeshard.parallel.held_stderr import stderr_held
from moeshard.parallel.processes import rendezvous_store
from moeshard.parallel.rank_failure import RankFailure, SilentRanks, rendezvous_culprits
from moeshard.parallel.spawn import spawn
from moeshard.parallel.worker import EXIT_REPORT_STUCK, RankError


def test_a_report_nobody_reads_does_not_keep_the_rank_alive():
    ctx = torch_mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=faults.report_nobody_reads, args=(queue,), daemon=True)
    start = time.monotonic()
    process.start()
    process.join(60)
    try:
        assert process.exitcode == EXIT_REPORT_STUCK, process.exitcode
        assert time.monotonic() - start < 60
    finally:
        if process.is_alive():
            process.kill()
        queue.close()
        queue.cancel_join_thread()


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if int(hex_port, 16) == port and state == "0A":
                found.add(address)
    return found


def test_rendezvous_listens_on_loopback_only_and_two_runs_get_their_own_ports():
    (store_a, port_a), (store_b, port_b) = rendezvous_store(2, 10.0), rendezvous_store(2, 10.0)
    assert port_a != port_b
    for port in (port_a, port_b):
        assert _listening(port) == {"0100007F"}, _listening(port)  # 127.0.0.1, nothing else
    del store_a, store_b


def test_gloo_stays_on_loopback():
    assert spawn(faults.gloo_interface, 2, timeout_s=120) == ["lo", "lo"]


def test_stderr_held_is_written_out_unless_the_block_raises_what_the_caller_reports(capfd):
    with stderr_held(dropped_on=(KeyError,)):
        os.write(2, b"kept: a C++ line of a block that ends well\n")
    with pytest.raises(KeyError), stderr_held(dropped_on=(KeyError,)):
        os.write(2, b"dropped: the log of a wait that the caller reports in one line\n")
        raise KeyError("reported")
    with pytest.raises(ValueError), stderr_held(dropped_on=(KeyError,)):
        os.write(2, b"kept: the log of an unexpected failure\n")
        raise ValueError("not reported by the caller")
    err = capfd.readouterr().err
    assert err.count("kept:") == 2 and "dropped:" not in err, err


def _error(rank: int, rendezvous: bool) -> RankError:
    return RankError(rank, "DistStoreError" if rendezvous else "RuntimeError", "wait timeout after 2000ms", "", rendezvous)


@pytest.mark.parametrize("message, stuck", [
    ("[../gloo/transport/unbound_buffer.cc:129] Timed out waiting 15000ms for send operation to complete", True),
    ("boom on purpose", False),
])
def test_a_rank_stopped_after_joining_is_the_timeout_its_peers_waited_for(message, stuck):
    """Edge case from a review: eplb --layer with a rank stopped (SIGSTOP) mid-run ended as rank
    0's failure (exit 4, gloo's text first), while train and generate said the stopped rank did
    not finish (exit 5). A peer's own error (not a wait that ran out) stays the failure."""
    errors = {0: RankError(0, "RuntimeError", message, "")}
    silent = SilentRanks((), (), {1: "stopped by a signal (SIGSTOP or SIGTSTP)"})
    failure = RankFailure(2, errors, [1], {}, False, 30.0, {0: None, 1: None}, {}, silent, 15.0)
    assert failure.timed_out == stuck
    if stuck:
        assert failure.summary.startswith("rank 1 did not finish: its process is stopped by a signal (SIGSTOP or "
                                          "SIGTSTP); rank 0 gave up waiting for it: RuntimeError: [../gloo"), \
            failure.summary
    else:
        assert failure.summary.startswith("rank 0 raised RuntimeError: boom on purpose; ranks [1] were stopped after "
                                          "the failure above"), failure.summary


@pytest.mark.parametrize("errors, died, silent, timed_out, culprits", [
    # rank 0 gave up at the rendezvous, rank 1 is stopped and never joined: rank 1's timeout
    ({0: _error(0, True)}, {}, SilentRanks((1,), (1,), {1: "stopped by a signal"}), False, [1]),
    # ... rank 1 never reached the store (not known to be stopped): still rank 1
    ({0: _error(0, True)}, {}, SilentRanks((1,), (1,), {}), False, [1]),
    # the deadline came first: rank 0 waited at the rendezvous, rank 1 never reached it
    ({}, {}, SilentRanks((0, 1), (1,), {}), True, [1]),
    # ... nobody had reached the store, nobody is stopped: no one to blame
    ({}, {}, SilentRanks((0, 1), (0, 1), {}), True, []),
    # a rank that died, or a rank that raised something else, is the failure instead
    ({0: _error(0, True)}, {1: -9}, SilentRanks((), (), {}), False, []),
    ({0: _error(0, False)}, {}, SilentRanks((1,), (1,), {1: "stopped by a signal"}), False, []),
])
def test_a_rendezvous_that_never_completes_is_blamed_on_the_ranks_that_never_came(errors, died, silent, timed_out,
                                                                                   culprits):
    assert rendezvous_culprits(silent, errors, died, timed_out) == culprits
    missing = [r for r in range(2) if r not in errors]
    failure = RankFailure(2, errors, missing, died, timed_out, 8.0, {0: None, 1: None}, {}, silent, 4.0)
    assert failure.timed_out == (timed_out or bool(culprits))
    if culprits:
        within = "4 s (the process-group timeout)" if errors else "8 s"
        assert failure.summary.startswith(f"rank 1 did not join the process group within {within}"), failure.summary
        assert ("rank 0 gave up waiting for it: DistStoreError" in failure.summary) == bool(errors)
    else:
        assert "did not join" not in failure.summary, failure.summary


def _rank_1_raises(plans):
    """A rank's ``run_plans``: rank 1 records an unexpected error, as ``jobs.world.run_plans`` does."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        return [{"error": "RuntimeError", "message": "The size of tensor a (2) must match the size of tensor b (8)"}]
    return ["fine"]


def test_a_ranks_unexpected_error_in_generate_or_train_is_a_rank_failure():
    """``generate`` and ``train`` raised a rank's unexpected error as a plain RuntimeError: a
    traceback and exit 1 (which means a failed check, or for train a loss out of tolerance). It is
    that rank's failure, named, exit 4, as ``moeshard run`` reports it."""
    from types import SimpleNamespace

    from moeshard.errors import ExitCode, RankFailed
    from moeshard.jobs.world import execute_local
    from moeshard.parallel.config import ParallelConfig

    plan = SimpleNamespace(parallel=ParallelConfig(2, 1, False), spec=SimpleNamespace(device="cpu"))
    with pytest.raises(RankFailed) as info:
        execute_local(plan, lambda plan, groups: None, _rank_1_raises, timeout_s=60)
    assert str(info.value) == "rank 1 raised RuntimeError: The size of tensor a (2) must match the size of tensor b (8)"
    assert info.value.exit_code == ExitCode.RANK_FAILED == 4

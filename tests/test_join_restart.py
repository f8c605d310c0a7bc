"""A world whose ranks fail to set up gloo's connections is started again, once.

Seen on CPU ranks: about one two-rank world in a hundred, while another world was starting on the
same machine, failed in ``init_process_group`` with "Gloo connectFullMesh failed ... Connection
closed by peer" before any rank ran its function. A new world of the same ranks joins. The fault
is planted with a process-group backend that is gloo except that rank 0 raises that error the
first n times it sets the group up (``faults.FLAKY_GLOO``); anything else that fails while joining,
and a second failure of the new world, still fail the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import faults
import pytest

from moeshard.harness.cases import MatrixOptions, generate
from moeshard.harness.runner import Runner
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.rank_failure import RankFailure, transient_join_failure
from moeshard.parallel.spawn import JOIN_ATTEMPTS, spawn
from moeshard.parallel.worker import RankError

GLOO_FAILURE = ("Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                "[127.0.0.1]:20170.")


@pytest.fixture
def flaky_join(tmp_path):
    """plan(failures, message) -> the marker file that counts rank 0's tries to set up the group."""
    plan_file = Path(os.environ[faults.FLAKY_JOIN_ENV])

    def plan(failures: int, message: str = GLOO_FAILURE):
        marker = tmp_path / "tries"
        plan_file.write_text(json.dumps({"marker": str(marker), "failures": failures, "message": message}))
        return marker
    yield plan
    plan_file.unlink(missing_ok=True)


def _tries(marker) -> int:
    return len(marker.read_text().splitlines())


def test_only_a_gloo_connection_failure_while_joining_counts_as_transient():
    def err(message, joining=True):
        return RankError(0, "RuntimeError", message, "", joining=joining)
    assert transient_join_failure(err(GLOO_FAILURE))
    assert not transient_join_failure(err(GLOO_FAILURE, joining=False))  # raised by the rank's own work
    assert not transient_join_failure(err("DistStoreError: timed out waiting for rank 1"))


def test_spawn_starts_a_new_world_when_gloo_fails_to_connect(flaky_join):
    marker = flaky_join(1)
    with pytest.warns(RuntimeWarning, match=r"rank 0: RuntimeError: Gloo connectFullMesh failed.*attempt 2 of 2"):
        assert spawn(faults.world_sum, 2, timeout_s=120, backend=faults.FLAKY_GLOO) == [3.0, 3.0]
    assert _tries(marker) == 2


def test_spawn_gives_up_after_the_last_attempt(flaky_join):
    marker = flaky_join(JOIN_ATTEMPTS)
    with pytest.warns(RuntimeWarning), pytest.raises(RankFailure, match="Gloo connectFullMesh failed") as info:
        spawn(faults.world_sum, 2, timeout_s=120, backend=faults.FLAKY_GLOO)
    assert _tries(marker) == JOIN_ATTEMPTS
    assert info.value.errors[0].joining and not info.value.results


def test_spawn_does_not_restart_a_world_for_any_other_join_failure(flaky_join, recwarn):
    marker = flaky_join(1, "the backend refused this rank")
    with pytest.raises(RankFailure, match="the backend refused this rank"):
        spawn(faults.world_sum, 2, timeout_s=120, backend=faults.FLAKY_GLOO)
    assert _tries(marker) == 1
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def _two_rank_case():
    p = ParallelConfig.parse("dp2-tp1-ep")
    opts = MatrixOptions(world_sizes=(2,), layouts=(p,), quants=("none",), dtypes=("float32",), backends=("all2all",),
                         presets=("mixtral-8x7b",), eplb="off")
    return [c for c in generate(opts) if not c.skipped][:1]


def test_check_runs_its_cases_in_a_new_world_when_gloo_fails_to_connect(flaky_join):
    marker = flaky_join(1)
    runner = Runner(layer_factory=faults.MoELayerOfThisModule, case_timeout_s=60, backend=faults.FLAKY_GLOO)
    with pytest.warns(RuntimeWarning, match="failed to join its process group"):
        (outcome,) = runner.run(_two_rank_case())
    assert outcome.status == "pass", outcome.reason
    assert _tries(marker) == 2


def test_check_reports_a_world_that_fails_to_connect_twice(flaky_join):
    marker = flaky_join(JOIN_ATTEMPTS)
    runner = Runner(layer_factory=faults.MoELayerOfThisModule, case_timeout_s=60, backend=faults.FLAKY_GLOO)
    with pytest.warns(RuntimeWarning):
        (outcome,) = runner.run(_two_rank_case())
    assert outcome.status == "error", outcome.reason
    assert outcome.reason.startswith("rank 0 raised RuntimeError: Gloo connectFullMesh failed"), outcome.reason
    assert outcome.reason.endswith("ranks [1] were stopped: the world could not form"), outcome.reason
    assert _tries(marker) == JOIN_ATTEMPTS


def test_the_command_prints_moeshards_own_warnings_as_one_line(capsys):
    """The restart's warning, as `moeshard check` prints it; other libraries' keep their form."""
    import warnings

    import moeshard.harness.runner as runner_module
    from moeshard.cli import _warning_shower

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        passed_on = []
        warnings.showwarning = _warning_shower("check", lambda message, *rest: passed_on.append(str(message)))
        warnings.warn_explicit("the world of 2 ranks failed to join its process group (rank 0: RuntimeError: Gloo "
                               "connectFullMesh failed)\nstarting a new one", RuntimeWarning, runner_module.__file__, 258)
        warnings.warn_explicit("a library's own warning", UserWarning, "/elsewhere/lib.py", 7)
    assert capsys.readouterr().err.splitlines() == [
        "moeshard check: warning: the world of 2 ranks failed to join its process group (rank 0: RuntimeError: Gloo "
        "connectFullMesh failed) | starting a new one"]
    assert passed_on == ["a library's own warning"]  # to the usual showwarning

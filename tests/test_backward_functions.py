"""Gradients through the collectives, proved on CPU ranks (one world of 2 for everything):

* ``torch.autograd.gradcheck`` (fp64, central differences) of every custom Function: the SP
  row shard and gather (uneven, empty ranks), the TP copy and reduce, every backend's dispatch
  and combine (uneven ranks; SP's chunks of one token: an empty rank), the local backend under TP;
* whole-model training steps (a replicated linear, the MoE layer, a replicated linear) under
  EP, SP, TP and DP: after ``reduce_gradients`` every gradient, each rank's shard of the
  experts included, and ``grad_norm`` equal one device's on all tokens, for the sum and the
  mean loss conventions; ``clip_grad_norm_`` leaves the norm it was asked for.
"""

import pytest

from moeshard.harness.runner import RANK_MODULES
from moeshard.parallel.spawn import CLEAN_EXIT_WAIT_S, LocalWorld


@pytest.fixture(scope="module")
def world():
    """Every rank's results: ``spawn``'s loop, with the ranks forked from the fork server that the
    harness uses (torch and moeshard imported once per test session, not once per rank)."""
    import backward_ranks

    world = LocalWorld(2, timeout_s=300, preload=RANK_MODULES)
    with world:
        world.start(backward_ranks.all_checks, ())
        for _ in world.events():
            pass
        world.stop(CLEAN_EXIT_WAIT_S if world.all_finished else 0.0)
    failure = world.failure()
    if failure is not None:
        raise failure
    return [world.results[rank] for rank in range(2)]


def test_gradcheck_of_every_custom_function(world):
    for rank, (checks, _) in enumerate(world):
        assert len(checks) == 3 + 2 + 3 * 2
        failed = {name: why for name, why in checks.items() if why is not True}
        assert not failed, f"rank {rank}: {failed}"


def test_a_whole_model_trains_as_on_one_device_under_every_layout(world):
    for rank, (_, errors) in enumerate(world):
        assert any("dp1-tp2-ep" in k and "embed.weight" in k for k in errors)  # SP: a replicated weight
        assert any("moe.experts.gate_up_proj" in k for k in errors)
        bad = {k: v for k, v in errors.items() if not v < 2e-5}
        assert not bad, f"rank {rank}: {bad}"

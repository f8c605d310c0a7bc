"""Gradients through the collectives, proved on CPU ranks (one world of 2):
``torch.autograd.gradcheck`` (fp64, central differences) of every custom Function: the SP row
shard and gather (uneven, empty ranks), the TP copy and reduce, every backend's dispatch and
combine (uneven ranks; SP's chunks of one token: an empty rank), the local backend under TP.
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
        world.start(backward_ranks.gradchecks, ())
        for _ in world.events():
            pass
        world.stop(CLEAN_EXIT_WAIT_S if world.all_finished else 0.0)
    failure = world.failure()
    if failure is not None:
        raise failure
    return [world.results[rank] for rank in range(2)]


def test_gradcheck_of_every_custom_function(world):
    for rank, checks in enumerate(world):
        assert len(checks) == 3 + 2 + 3 * 2
        failed = {name: why for name, why in checks.items() if why is not True}
        assert not failed, f"rank {rank}: {failed}"

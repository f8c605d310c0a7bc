"""Every parallel layout gives each rank the single-device result for its tokens.

The harness's default matrix (world sizes 1, 2, 4: every layout x backend x quant x dtype, token
counts that include empty ranks and fewer tokens than TP ranks, presets with and without shared
experts) runs in one spawn per world size; world size 8 runs with --world-size-8.
"""

import pytest

from moeshard.harness.cases import MatrixOptions, generate
from moeshard.harness.runner import Runner


def _run(world_sizes):
    cases = generate(MatrixOptions(world_sizes=world_sizes))
    outcomes = Runner(case_timeout_s=120).run(cases)
    bad = [(o.case.id, o.status, o.reason) for o in outcomes if o.status in ("fail", "error")]
    assert not bad, bad
    assert sum(o.status == "pass" for o in outcomes) == sum(not c.skipped for c in cases)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_layouts(world_size):
    _run((world_size,))


@pytest.mark.world_size_8
def test_layouts_world_size_8():
    _run((8,))

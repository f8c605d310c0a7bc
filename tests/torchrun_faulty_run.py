"""`moeshard run` as one rank of torchrun's world, with a fault planted in the rank: on rank 1,
all2all's combine raises before its all-to-all (tests/test_torchrun.py)."""

import os
import sys

from moeshard.cli import main
from moeshard.dispatch.all2all import All2AllBackend

original = All2AllBackend.combine


def combine(self, y, dispatched):
    if os.environ["RANK"] == "1":
        raise RuntimeError("planted: combine refuses on rank 1")
    return original(self, y, dispatched)


All2AllBackend.combine = combine
sys.exit(main(["run", *sys.argv[1:]]))

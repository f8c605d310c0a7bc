"""Test doubles with planted faults, for proving that the harness catches them.

They are real layers with one deliberate defect each; the harness pickles the class by
reference, so this module must be importable in spawned ranks (tests/ is on sys.path).
"""

import time

import torch
import torch.distributed as dist

from moeshard.layer import MoELayer


def _dp_rank(layer: MoELayer) -> int:
    return layer.parallel.dp_rank(layer.groups.rank) if layer.groups else 0


class DropsLastDPRankRows(MoELayer):
    """Loses the last output row on the last DP rank (a 'lost rows' bug)."""

    def forward(self, x):
        out = super().forward(x)
        return out[:-1] if _dp_rank(self) == self.parallel.dp - 1 and out.shape[0] else out


class MisScalesOneExpert(MoELayer):
    """Expert 1's down projection is 3% too large on whichever rank holds it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.shard.expert_start <= 1 < self.shard.expert_stop and self.quant.scheme == "none":
            with torch.no_grad():
                self.experts.down_proj[1 - self.shard.expert_start] *= 1.03


class RaisesOnRank1(MoELayer):
    """Rank 1 raises in the middle of its forward, after the other ranks entered collectives."""

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("planted failure on rank 1")
        return super().forward(x)


class SleepsOnRank1(MoELayer):
    """Rank 1 stalls far past any case timeout."""

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(600)
        return super().forward(x)


class KilledOnRank1Once(MoELayer):
    """Rank 1 is killed with SIGKILL in the middle of the forward of its second case, once per
    run: the first kill leaves the file named by $MOESHARD_TEST_KILL_MARKER, and later worlds
    (the respawn) find it and run normally. What a rank killed from outside looks like."""

    cases_built = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).cases_built += 1

    def forward(self, x):
        import os
        import signal
        marker = os.environ["MOESHARD_TEST_KILL_MARKER"]
        if dist.is_initialized() and dist.get_rank() == 1 and type(self).cases_built == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def sleep_forever() -> None:
    """A rank function that never returns (for the parent's timeout)."""
    time.sleep(3600)


def report_nobody_reads(queue) -> None:
    """A rank's last report (64 MB, far more than a pipe holds) put into a queue the parent never
    reads: ``_report`` must give up within its bound and exit the process."""
    from moeshard.parallel.worker import _report
    _report(queue, ("ok", 0, b"x" * (64 << 20)), 2.0)


def gloo_interface() -> str | None:
    import os
    return os.environ.get("GLOO_SOCKET_IFNAME")

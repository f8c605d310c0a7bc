"""Test doubles with planted faults, for proving that the harness catches them.

They are real layers with one deliberate defect each; the harness pickles the class by
reference, so this module must be importable in spawned ranks (tests/ is on sys.path).
"""

import time

import torch
import torch.distributed as dist

from moeshard.dispatch.all2all import All2AllBackend
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


class _SkipsCombineWhenEmpty(All2AllBackend):
    def combine(self, y, dispatched):
        if dispatched.state.num_tokens == 0:  # nothing of mine to get back: skip the exchange (the bug)
            return torch.zeros(0, y.shape[1], dtype=torch.float32, device=y.device)
        return super().combine(y, dispatched)


class SkipsCombineWhenEmpty(MoELayer):
    """all2all whose combine returns at once on a rank with no tokens, without entering the
    all-to-all that sends its experts' rows back: its peers wait for them (a hang)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.backend, All2AllBackend):
            self.backend = _SkipsCombineWhenEmpty(self.cfg, self.quant, self.groups)

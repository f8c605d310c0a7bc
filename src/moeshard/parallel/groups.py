"""The process groups of one layout, built once from the default process group.

For ``ParallelConfig(dp, tp, enable_ep)`` and global rank ``r = dp_rank * tp + tp_rank``:

    tp group of r : [d*tp + t for t in range(tp)]   with d = dp_rank(r)   (its DP rank's TP ranks)
    dp group of r : [d*tp + t for d in range(dp)]   with t = tp_rank(r)   (same TP slice, all DP ranks)
    ep group      : all ranks in global order, only with EP on
    side group    : a gloo group over the EP ranks, only when asked for (CPU side channel)

``torch.distributed.new_group`` is collective over the default group: every rank must create
every group, in the same order, even those it is not in.  ``ParallelGroups.build`` does exactly
that (all TP groups, then all DP groups, then EP, then the side group), so all ranks must call it
together and in the same order relative to their other ``new_group`` calls.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.trace import CollectiveTrace

GROUP_NAMES = ("tp", "dp", "ep")


def _new_group(ranks: list[int], timeout: datetime.timedelta | None, backend: str | None = None) -> Any:
    # Every group is created with new_group, including one that spans the whole world, so a
    # layout never aliases the default group (destroying or re-configuring one cannot touch
    # the other) and group creation stays in lock-step on all ranks.
    return dist.new_group(ranks=ranks, timeout=timeout, backend=backend)


def default_group_timeout() -> datetime.timedelta | None:
    """The timeout the default process group was initialised with, or ``None`` if unreadable.

    ``new_group`` does not inherit it: without an explicit timeout a new group waits torch's
    default (30 min for gloo, 10 for NCCL), so a stuck collective on a TP/DP/EP group would
    outlive the bound the caller chose.  torch has no public getter; the backend's options
    hold it (checked by the tests, which time a stuck collective on a built group).
    """
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    world = dist.group.WORLD
    if world is None:  # no default group: nothing to read
        return None
    try:
        return world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


# eq=False: groups compare (and hash) by identity; comparing process-group handles field by
# field would say nothing useful, and the rank lists would make the generated hash fail.
@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """Process groups and rank lists of one rank under one ``ParallelConfig``.

    Fields:
      * ``config``: the layout.
      * ``rank``, ``world_size``: this rank in the default group, and its size (= dp * tp).
      * ``tp_group``, ``dp_group``: this rank's TP and DP groups (always present; size 1 when the
        dimension is 1).
      * ``ep_group``: all ranks when EP is on, ``None`` when off.
      * ``tp_ranks``, ``dp_ranks``, ``ep_ranks``: the global ranks of those groups in group-rank
        order (``ep_ranks == [rank]`` when EP is off: every rank is its own, single EP rank).
      * ``side_group``: a gloo group over ``ep_ranks``, for exchanging counts on the CPU while the
        payload goes over NCCL; present only with ``side_channel=True`` and EP on, else ``None``.
      * ``device``: where this rank computes: ``cuda:<current device>`` when the default backend is
        nccl (``spawn`` and ``init_from_env`` set the current device), else ``cpu``.
      * ``timeout``: the bound on every collective of these groups (``None``: torch's default).
      * ``trace``: this rank's ``CollectiveTrace``, which every collective of the layer and its
        backends records into (``None``: nothing is recorded).
    """

    config: ParallelConfig
    rank: int
    world_size: int
    tp_group: Any
    dp_group: Any
    ep_group: Any
    tp_ranks: list[int]
    dp_ranks: list[int]
    ep_ranks: list[int]
    side_group: Any
    device: torch.device
    timeout: datetime.timedelta | None = None
    trace: CollectiveTrace | None = None

    @classmethod
    def build(cls, config: ParallelConfig, side_channel: bool = False, *,
              timeout: datetime.timedelta | None = None, trace: CollectiveTrace | None = None) -> ParallelGroups:
        """Creates the groups of ``config`` on every rank; call on all ranks together.

        Needs an initialised default process group of exactly ``config.world_size`` ranks;
        refuses (``ValueError`` naming the rank) before creating any group otherwise.
        ``timeout`` bounds every collective on the new groups; ``None`` = the default group's own
        timeout (the one given to ``spawn`` / ``init_from_env``). ``trace``: see the class.
        """
        if not isinstance(config, ParallelConfig):
            raise TypeError(f"ParallelGroups.build: config must be a ParallelConfig, got {type(config).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelGroups.build: the default process group is not initialised "
                               "(use moeshard.parallel.spawn.spawn or init_from_env first)")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        config.validate_world_size(world_size, rank=rank)
        dp, tp = config.dp, config.tp
        backend = str(dist.get_backend())
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        timeout = timeout if timeout is not None else default_group_timeout()

        tp_layout = [[d * tp + t for t in range(tp)] for d in range(dp)]
        dp_layout = [[d * tp + t for d in range(dp)] for t in range(tp)]
        dp_index, tp_index = config.dp_rank(rank), config.tp_rank(rank)

        # Same creation order on every rank; keep only the groups this rank belongs to.
        tp_groups = [_new_group(ranks, timeout) for ranks in tp_layout]
        dp_groups = [_new_group(ranks, timeout) for ranks in dp_layout]
        ep_ranks = list(range(world_size)) if config.enable_ep else [rank]
        ep_group = _new_group(ep_ranks, timeout) if config.enable_ep else None
        # The side channel carries small host-side metadata next to NCCL payloads; without EP
        # there is no cross-rank dispatch, so there is nothing for it to carry.
        side_group = _new_group(ep_ranks, timeout, backend="gloo") if side_channel and config.enable_ep else None

        return cls(config=config, rank=rank, world_size=world_size,
                   tp_group=tp_groups[dp_index], dp_group=dp_groups[tp_index], ep_group=ep_group,
                   tp_ranks=tp_layout[dp_index], dp_ranks=dp_layout[tp_index], ep_ranks=ep_ranks,
                   side_group=side_group, device=device, timeout=timeout, trace=trace)

    def group(self, group_name: str) -> Any:
        """The group called ``"tp"``, ``"dp"`` or ``"ep"`` (``None`` for ``"ep"`` with EP off)."""
        self._check_name(group_name)
        return getattr(self, f"{group_name}_group")

    def ranks(self, group_name: str) -> list[int]:
        """Global ranks of the group called ``"tp"``, ``"dp"`` or ``"ep"``, in group-rank order."""
        self._check_name(group_name)
        return list(getattr(self, f"{group_name}_ranks"))

    def index_in(self, group_name: str) -> int:
        """This rank's position in ``"tp"``, ``"dp"`` or ``"ep"`` (0 in ``"ep"`` with EP off)."""
        return self.ranks(group_name).index(self.rank)

    def _check_name(self, group_name: str) -> None:
        if group_name not in GROUP_NAMES:
            raise ValueError(f"ParallelGroups (rank {self.rank}): unknown group {group_name!r}; "
                             f"expected one of {list(GROUP_NAMES)}")

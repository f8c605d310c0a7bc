"""Whether any rank failed a step, exchanged before the next collective, so that every rank
raises together (naming the first rank that failed) instead of leaving its peers waiting."""

from __future__ import annotations

import torch.distributed as dist

from moeshard.parallel.groups import ParallelGroups


def first_failure(groups: ParallelGroups | None, error: BaseException | None,
                  rank: int) -> tuple[str, str, list[int]] | None:
    """Every rank's ``error`` (None: it did not fail), exchanged in one all_gather_object of our
    own (kind, text) strings -> None when no rank failed, else (kind, text) of the first rank
    that failed, and every rank that failed. The shared step of every "did any rank fail?"
    exchange (the transformers integration's ``agree``, ``moeshard.jobs.run``)."""
    mine = None if error is None else (type(error).__name__, f"rank {rank}: {error}")
    reasons: list[tuple[str, str] | None]
    if groups is None:
        reasons = [mine]
    else:
        reasons = [None] * groups.world_size
        dist.all_gather_object(reasons, mine)
    failed = [r for r, reason in enumerate(reasons) if reason is not None]
    if not failed:
        return None
    first = reasons[failed[0]]
    assert first is not None  # failed lists the ranks with a reason
    kind, text = first
    return kind, text, failed

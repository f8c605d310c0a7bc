"""Runs a function on every rank of one local world forked from the harness's fork server (torch,
transformers and moeshard imported once per test session, not once per rank), and returns each
rank's result, or raises the world's failure (a rank that raised, died or ran past the timeout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moeshard.harness.runner import RANK_MODULES
from moeshard.parallel.spawn import CLEAN_EXIT_WAIT_S, LocalWorld


def run_forked(world_size: int, fn: Callable, args: tuple = (), timeout_s: float = 300.0) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``, fn running under ``spawn``'s loop
    (a process group of ``world_size`` gloo ranks)."""
    world = LocalWorld(world_size, timeout_s=timeout_s, preload=RANK_MODULES)
    with world:
        world.start(fn, args)
        for _ in world.events():
            pass
        world.stop(CLEAN_EXIT_WAIT_S if world.all_finished else 0.0)
    failure = world.failure()
    if failure is not None:
        raise failure
    return [world.results[rank] for rank in range(world_size)]

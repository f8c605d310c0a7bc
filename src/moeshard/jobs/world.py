"""Plans over one world of ranks: the loop ``moeshard run`` and ``moeshard generate`` share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from moeshard.dispatch.registry import build_groups
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.trace import CollectiveTrace

R = TypeVar("R")


class Plan(Protocol):
    """What the loop reads of a plan (a frozen dataclass): its layout, its backend and its spec,
    whose ``device`` is "cpu" or "cuda"."""

    @property
    def parallel(self) -> ParallelConfig: ...

    @property
    def backend(self) -> str: ...

    @property
    def spec(self) -> Any: ...


def _layout(p: ParallelConfig) -> tuple[int, int, bool]:
    return (p.dp, p.tp, p.enable_ep)


def each_plan(plans: Sequence[Plan], run_one: Callable[[Any, ParallelGroups], R],
              trace: CollectiveTrace | None = None) -> list[R | dict]:
    """Runs ``run_one(plan, groups)`` for every plan in order on this rank (every rank of the
    world calls this with the same plans). Groups are built once per layout, with what every
    backend run on that layout needs (``build_groups``); a plan that raises is recorded as
    ``{"error": type name, "message": ...}`` and the next plan runs, so that the parent hears
    every rank's outcome of every plan. ``trace``: the rank's ``CollectiveTrace``, plan i
    recorded as case i."""
    groups_of: dict[tuple[int, int, bool], ParallelGroups] = {}
    results: list[R | dict] = []
    for i, plan in enumerate(plans):
        key = _layout(plan.parallel)
        if trace is not None:
            trace.case = i
        if key not in groups_of:
            backends = [q.backend for q in plans if _layout(q.parallel) == key]
            groups_of[key] = build_groups(plan.parallel, plan.spec.device, backends, trace=trace)
        try:
            results.append(run_one(plan, groups_of[key]))
        except Exception as exc:  # noqa: BLE001 - recorded for the caller, which reports it
            results.append({"error": type(exc).__name__, "message": str(exc)})
    return results

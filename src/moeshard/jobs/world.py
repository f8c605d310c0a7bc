"""Plans over one world of ranks: the loop ``moeshard run``, ``generate`` and ``train`` share,
and what each of their ranks needs first (where it runs, its model loaded and timed)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar, cast

import torch

from moeshard.dispatch.registry import build_groups
from moeshard.errors import RankFailed
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


def execute(plan: Any, run_one: Callable[[Any, ParallelGroups | None], R], run_plans: Callable[[list[Any]], list],
            timeout_s: float, light: Callable[[R], R] | None = None) -> list[R] | None:
    """Every rank's result of one plan, wherever this process runs: under torchrun
    (``execute_torchrun``) on rank 0, None on the other ranks; else ``execute_local``."""
    from moeshard.parallel.torchrun import torchrun_environment

    if torchrun_environment():
        return execute_torchrun(plan, run_one, timeout_s, light)
    return execute_local(plan, run_one, run_plans, timeout_s)


def execute_torchrun(plan: Any, run_one: Callable[[Any, ParallelGroups | None], R], timeout_s: float,
                     light: Callable[[R], R] | None = None) -> list[R] | None:
    """Runs ``run_one(plan, groups)`` as this process's rank of torchrun's world (env://, NCCL on
    cuda, gloo on cpu; ``timeout_s`` bounds the rendezvous and every collective) and gathers every
    rank's result (``light(result)`` where given: what rank 0 needs of it) on rank 0; returns them
    there, None on the other ranks. A layout that does not fit the world is refused on every rank
    before any collective."""
    import torch.distributed as dist

    from moeshard.parallel.torchrun import destroy, init_from_env

    init_from_env(backend="nccl" if plan.spec.device == "cuda" else "gloo", timeout_s=timeout_s)
    try:
        check_same_spec(plan.spec)
        plan.parallel.validate_world_size(dist.get_world_size(), rank=dist.get_rank())
        result = run_one(plan, build_groups(plan.parallel, plan.spec.device, [plan.backend]))
        reports: list[R | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, light(result) if light is not None else result)  # our own small dataclasses
        # all_gather_object filled every entry with a rank's report
        return cast("list[R]", reports) if dist.get_rank() == 0 else None
    finally:
        destroy()


PATH_FIELDS = ("model_dir", "input_path")  # where a node finds its files: its own mount may differ


def check_same_spec(spec: Any) -> None:
    """Under torchrun each rank parsed its own command line (nodes may be started one by one):
    every field of ``spec`` (a frozen dataclass of what the user asked for) but the paths
    (``PATH_FIELDS``) must be the same on every rank, or a rank with another ``--seed`` would
    compute on other inputs without an error. One ``all_gather_object`` of the fields' reprs,
    before any other collective; every rank sees the same table, so all raise together: a
    ValueError naming each field that differs and every rank's value."""
    import torch.distributed as dist

    mine = {f.name: repr(getattr(spec, f.name)) for f in fields(spec) if f.name not in PATH_FIELDS}
    table: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)  # small dicts of strings, between our own ranks
    rows = [row or {} for row in table]
    differ = [name for name in mine if len({row.get(name) for row in rows}) > 1]
    if differ:
        parts = "; ".join(f"{name}: " + ", ".join(f"rank {r}={row.get(name)}" for r, row in enumerate(rows))
                          for name in differ)
        raise ValueError(f"rank {dist.get_rank()}: the ranks were started with different options: {parts}")


def execute_local(plan: Any, run_one: Callable[[Any, ParallelGroups | None], R],
                  run_plans: Callable[[list[Any]], list], timeout_s: float) -> list[R]:
    """Every rank's result of one plan (``plan.parallel``, ``plan.spec.device``): ``run_one(plan,
    None)`` in this process for one rank (under ``timeout_s``), else ``run_plans([plan])`` on
    ``dp * tp`` spawned ranks. A refusal raised on a rank comes back as one ValueError, another
    exception as ``RankFailed`` naming the rank (exit 4), a failed or late rank as
    ``as_value_error``'s error."""
    import torch

    from moeshard.jobs.failures import as_value_error
    from moeshard.parallel.signals import in_process_deadline
    from moeshard.parallel.spawn import RankFailure, spawn

    world = plan.parallel.world_size
    if plan.spec.device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"--device cuda: layout {plan.parallel.name} needs {world} GPU(s), one per rank, but "
                         f"{torch.cuda.device_count()} are visible")
    if world == 1:
        with in_process_deadline(timeout_s, "rank 0 (in this process)"):
            return [run_one(plan, None)]
    try:
        per_rank = spawn(run_plans, world, args=([plan],), device=plan.spec.device, timeout_s=timeout_s)
    except RankFailure as failure:
        raise as_value_error(failure) from None
    results = [r[0] for r in per_rank]
    errors = [(rank, r) for rank, r in enumerate(results) if isinstance(r, dict)]
    if errors:
        rank, first = errors[0]
        if first["error"] == "ValueError":
            raise ValueError(first["message"])
        # Not a refusal: that rank's failure (exit 4, one line), as ``moeshard run`` reports it.
        raise RankFailed(f"rank {rank} raised {first['error']}: {first['message']}")
    return results


@dataclass(frozen=True)
class RankPlace:
    """Where one rank of a job runs: ``rank`` in the world (0 in the single-rank layout, which
    has no process group), its DP and TP ranks under the plan's layout, and its device (the
    groups' device, or the plan's spec's for the single-rank layout)."""

    rank: int
    dp_rank: int
    tp_rank: int
    device: torch.device

    @staticmethod
    def of(plan: Plan, groups: ParallelGroups | None) -> RankPlace:
        rank = groups.rank if groups is not None else 0
        device = groups.device if groups is not None else torch.device(plan.spec.device)
        return RankPlace(rank, plan.parallel.dp_rank(rank), plan.parallel.tp_rank(rank), device)


def synchronize(device: torch.device) -> None:
    """Waits for the work queued on ``device``, so that a host timing includes it (CPU work is
    done when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_timed(plan: Any, groups: ParallelGroups | None, device: torch.device) -> tuple[torch.nn.Module, float]:
    """The plan's whole transformers model with its MoE blocks as this rank's moeshard layers
    (``integrations.transformers.load_sharded_model``: the plan's spec's ``model_dir``, its
    quant, backend, dtype and max_tokens_per_rank), and the seconds the load took, to the
    device's last write (transformers is imported before the clock starts)."""
    import transformers

    from moeshard.integrations.transformers import load_sharded_model

    transformers.AutoModelForCausalLM  # noqa: B018 - imported before the load is timed
    start = time.perf_counter()
    model = load_sharded_model(plan.spec.model_dir, groups, quant=plan.quant, backend=plan.backend, dtype=plan.dtype,
                               device=device, max_tokens_per_rank=plan.max_tokens_per_rank)
    synchronize(device)
    return model, time.perf_counter() - start

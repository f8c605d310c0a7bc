"""The load-balancing part of a case, on one rank: what ``run_case`` adds for ``case.eplb``.

    build:   the layer gets ``Placement.initial`` (E / P experts and ``redundant_per_rank``
             replicas per rank); a spy on its backend records the slot ids each forward routes
    forward: (run_case) the output against the reference, which knows nothing of replicas
    then:    every routed slot holds the routed logical expert and is active; under SP the TP
             ranks of a DP rank chose identical replicas for the whole batch, and each used
             exactly its chunk of that choice; the all-reduced loads count every routed copy of
             the domain once
    rebalance in the middle of the run: the case's policy on the loads the layer counted (a
             rotation of the slots by one rank when the policy keeps the placement, so that
             weights always move), ``layer.rebalance``; this rank rewrote exactly its changed
             slots
    forward again on the same tokens: the same checks, and (run_case) the output against the
             same reference
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from moeshard.dispatch.base import PayloadFirstBackend
from moeshard.dispatch.registry import BACKENDS
from moeshard.eplb.placement import Layout, Placement
from moeshard.eplb.policies import get_policy
from moeshard.harness.cases import Case
from moeshard.layer import MoELayer
from moeshard.parallel.collectives import all_gatherv
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.sequence import SequenceChunk


def layer_kwargs(case: Case) -> dict:
    """Extra ``MoELayer`` arguments of the case: its initial placement (none without EPLB)."""
    if case.eplb is None:
        return {}
    cfg = case.moe_config()
    return {"placement": Placement.initial(Layout(cfg.num_experts, case.parallel.ep_size, case.eplb.redundant_per_rank))}


@dataclass(frozen=True)
class EPLBResult:
    """out: this rank's [T, H] output after the rebalance (CPU); problems: what went wrong."""

    out: torch.Tensor
    problems: list[str]


class EPLBCheck:
    """Watches one layer through a case (see the module docstring). Build it before the first
    forward; call ``rebalance_and_rerun`` after it, on every rank."""

    def __init__(self, case: Case, layer: MoELayer, groups: ParallelGroups | None) -> None:
        self.case, self.layer, self.groups = case, layer, groups
        self.routed: list[torch.Tensor] = []
        dispatch = layer.backend.dispatch

        def spy(x, routing):
            self.routed.append(routing.topk_ids.detach().cpu())
            return dispatch(x, routing)

        # An instance attribute, on purpose: it shadows the method for this layer's backend only.
        layer.backend.dispatch = spy  # type: ignore[method-assign]
        if BACKENDS[layer.backend.name].payload_first:  # the layer's forward on CUDA dispatches a payload made earlier
            backend = cast(PayloadFirstBackend, layer.backend)
            dispatch_payload = backend.dispatch_payload

            def spy_payload(x, payload, routing):
                self.routed.append(routing.topk_ids.detach().cpu())
                return dispatch_payload(x, payload, routing)

            backend.dispatch_payload = spy_payload  # type: ignore[method-assign]

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, SequenceChunk | None]:
        p = self.case.parallel
        if not p.is_sequence_parallel:
            return x, None
        assert self.groups is not None  # sequence parallel: tp > 1 ranks, which run with groups
        chunk = SequenceChunk.of(x.shape[0], p.tp_rank(self.groups.rank), p.tp)
        return x[chunk.start:chunk.start + chunk.real], chunk

    def _check_forward(self, x: torch.Tensor, when: str) -> list[str]:
        """x: this DP rank's tokens [T, H] (on the layer's device) of the forward just run."""
        layer, problems = self.layer, []
        if len(self.routed) != 1:
            return [f"{when}: the backend dispatched {len(self.routed)} times in one forward"]
        used = self.routed.pop()
        mine, chunk = self._rows(x)
        logical = layer.route(mine).topk_ids.cpu()
        slots = torch.tensor(layer.placement.slots)
        active = torch.tensor(layer.placement.active)
        if used.shape != logical.shape or not torch.equal(slots[used], logical):
            problems.append(f"{when}: routed slots do not hold the routed logical experts")
        elif not bool(active[used].all()):
            problems.append(f"{when}: a standby slot was routed")
        if chunk is not None:
            assert self.groups is not None  # a chunk only under sequence parallelism (see _rows)
            # Every TP rank computes the choice for its DP rank's whole batch; they must agree, and
            # the chunks they used must be that choice's rows.
            whole = layer.physical_ids(layer.route(x).topk_ids, 0)
            tp = dist.get_world_size(self.groups.tp_group)
            gathered = [torch.empty_like(whole) for _ in range(tp)]
            dist.all_gather(gathered, whole.contiguous(), group=self.groups.tp_group)
            if any(not torch.equal(g, whole) for g in gathered):
                problems.append(f"{when}: TP ranks of DP rank {self.case.parallel.dp_rank(self.groups.rank)} chose "
                                f"different replicas for the same tokens")
            used_all = all_gatherv(used.to(whole.device), chunk.rows_per_rank, self.groups.tp_group, "tp")
            if not torch.equal(used_all, whole):
                problems.append(f"{when}: the replicas the TP ranks used differ from the choice for their rows")
        return problems

    def rebalance_and_rerun(self, x: torch.Tensor) -> EPLBResult:
        """x: this DP rank's tokens [T, H] on the layer's device (the first forward's input)."""
        layer, case = self.layer, self.case
        rank = self.groups.rank if self.groups is not None else 0
        problems = self._check_forward(x, "before the rebalance")
        loads = layer.expert_loads()
        routed = sum(case.tokens) * case.moe_config().top_k
        if int(loads.sum()) != routed:
            problems.append(f"expert_loads counts {int(loads.sum())} routed copies, the domain routed {routed}")
        assert case.eplb is not None  # an EPLBCheck watches load-balancing cases only
        old = layer.placement
        new = get_policy(case.eplb.policy)(loads, old.layout).aligned_to(old)
        if new.slots == old.slots:  # move weights anyway: every slot one rank further
            S = old.slots_per_rank
            active = new.active
            assert active is not None  # Placement.__post_init__ replaces None by one bool per slot
            new = Placement(old.num_experts, old.num_ranks, old.slots[S:] + old.slots[:S], active[S:] + active[:S])
        stats = layer.rebalance(new)
        S, p = old.slots_per_rank, case.parallel.ep_rank(rank)
        changed = sum(1 for s in range(p * S, (p + 1) * S) if old.slots[s] != new.slots[s])
        if stats.rewritten != changed:
            problems.append(f"rebalance rewrote {stats.rewritten} slots of rank {rank}, {changed} changed")
        layer.reset_expert_loads()
        out = layer(x).cpu()
        problems += self._check_forward(x, "after the rebalance")
        return EPLBResult(out, problems)

"""Test doubles with planted faults, for proving that the harness catches them.

They are real layers with one deliberate defect each; the harness pickles the class by
reference, so this module must be importable in spawned ranks (tests/ is on sys.path).
"""

import os
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import moeshard.dispatch.all2all as all2all_module
import moeshard.layer as layer_module
from moeshard.dispatch.all2all import All2AllBackend
from moeshard.dispatch.allgather_reducescatter import AllGatherReduceScatterBackend
from moeshard.dispatch.base import Dispatched
from moeshard.experts.base import ExpertInput
from moeshard.layer import MoELayer
from moeshard.parallel.collectives import all_gatherv
from moeshard.quant import QuantizedActivations
from moeshard.router import Routing, route, router_logits


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


def rank_main_stopped_on_rank1(rank, *args):
    """``worker.rank_main`` whose rank 1 stops itself with SIGSTOP before it joins the process
    group: what ``kill -STOP`` of a rank that is still starting looks like, without the race of
    stopping a forked rank from outside before it joins."""
    import os
    import signal

    from moeshard.parallel.worker import rank_main
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return rank_main(rank, *args)


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


class _SkipsCombineWhenEmpty(All2AllBackend):
    def combine(self, y, dispatched):
        if dispatched.state.row_of_pair.shape[0] == 0:  # nothing of mine to get back: skip the exchange (the bug)
            return torch.zeros(0, y.shape[1], dtype=torch.float32, device=y.device)
        return super().combine(y, dispatched)


class SkipsCombineWhenEmpty(MoELayer):
    """all2all whose combine returns at once on a rank with no tokens, without entering the
    all-to-all that sends its experts' rows back: its peers wait for them (a hang)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.backend, All2AllBackend):
            _with_backend(self, _SkipsCombineWhenEmpty(self.backend.ctx))


# -- planted faults that `moeshard check --explain` must explain (tests/test_explain.py) --------

def _with_backend(layer: MoELayer, backend) -> None:
    """Replaces the layer's backend by a faulty one (built from the same context: the layer's
    stage recorder included)."""
    layer.backend = backend


class _DropsLastRowOnRank1(AllGatherReduceScatterBackend):
    def dispatch(self, x, routing):
        d = super().dispatch(x, routing)
        inp, state = d.input, d.state
        if self.groups.rank != 1 or inp.num_rows == 0:
            return d
        keep = torch.arange(inp.num_rows - 1)
        rows = inp.x.index_rows(keep) if isinstance(inp.x, QuantizedActivations) else inp.x[keep]
        return Dispatched(ExpertInput(rows, inp.expert_ids[keep], inp.input_amax),
                          replace(state, token_of_row=state.token_of_row[keep], weights=state.weights[keep]))


class DropsRowUnderSP(MoELayer):
    """allgather_reducescatter that loses the last row it dispatches, on rank 1, under SP only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.parallel.is_sequence_parallel and isinstance(self.backend, AllGatherReduceScatterBackend):
            _with_backend(self, _DropsLastRowOnRank1(self.backend.ctx))


class MisScaledTPSlice(MoELayer):
    """Expert 1's slice of the intermediate dimension on TP rank 1 is 3% too large (EP off)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.shard.tp_size > 1 and self.shard.tp_rank == 1 and self.quant.scheme == "none":
            with torch.no_grad():
                self.experts.down_proj[1] *= 1.03


class _ScalesReversedOnRank0(All2AllBackend):
    def dispatch(self, x, routing):
        # all2all packs each routed copy's row, scales and expert id into one slot: rank 0 packs
        # its rows with their scales in reverse token order (the rows themselves right)
        original = all2all_module.pack

        def pack(slots, index, payload, token_rows, expert_ids, layout):
            if self.groups.rank == 0 and payload.row_scale is not None:
                payload = replace(payload, row_scale=payload.row_scale.flip(0))
            return original(slots, index, payload, token_rows, expert_ids, layout)

        all2all_module.pack = pack
        try:
            return super().dispatch(x, routing)
        finally:
            all2all_module.pack = original


class ScalesReversedInDispatch(MoELayer):
    """all2all whose rank 0 sends the rows' scales in reverse order (the rows themselves right)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.backend, All2AllBackend):
            _with_backend(self, _ScalesReversedOnRank0(self.backend.ctx))


class MisScalesFirstSlotOnRank1(MoELayer):
    """Rank 1's first expert slot (under load balancing, one copy of an expert that may have
    others) computes a down projection 3% too large."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if dist.get_rank() == 1 and self.quant.scheme == "none":
            with torch.no_grad():
                self.experts.down_proj[0] *= 1.03


class _UnroutesLastRowOnRank1(All2AllBackend):
    def dispatch(self, x, routing):
        d = super().dispatch(x, routing)
        ids = d.input.expert_ids
        if self.groups.rank != 1 or ids.shape[0] == 0:
            return d
        ids = ids.clone()
        ids[-1] = -1  # a padding row: no expert computes it, and its pair reaches no expert
        return replace(d, input=replace(d.input, expert_ids=ids))


class UnroutesLastRowOnRank1(MoELayer):
    """all2all whose rank 1 turns the last row it receives into padding: that (token, top-k
    slot) reaches no rank's experts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.backend, All2AllBackend):
            _with_backend(self, _UnroutesLastRowOnRank1(self.backend.ctx))


class SharedTwiceUnderSP(MoELayer):
    """Under SP, the shared experts' contribution is added twice."""

    def _shared(self, x):
        shared = super()._shared(x)
        return 2 * shared if self.parallel.is_sequence_parallel else shared


class TiesBrokenHighOnRank1(MoELayer):
    """Rank 1 breaks near-ties (logits within 5e-2 of each other, by a per-index nudge) in
    favour of the higher expert index; weights stay the scores of the chosen experts."""

    def route(self, x):
        if not (dist.is_initialized() and dist.get_rank() == 1):
            return super().route(x)
        logits = router_logits(x, self.gate.weight, self.cfg.router_dtype)
        nudge = 5e-2 * torch.arange(self.cfg.num_experts, dtype=logits.dtype) / self.cfg.num_experts
        ids = route(logits + nudge, self.cfg, self.gate.e_score_correction_bias).topk_ids
        scores = logits.softmax(dim=-1) if self.cfg.scoring == "softmax" else logits.sigmoid()
        weights = scores.gather(1, ids)
        if self.cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return Routing(ids, weights * self.cfg.routed_scaling_factor)


class _MiscountsOnRank1(AllGatherReduceScatterBackend):
    def _gather(self, t, sizes):
        if self.groups.rank == 1:
            sizes = [s + 1 if i == 1 else s for i, s in enumerate(sizes)]  # its own count off by one
        return super()._gather(t, sizes)


class MiscountsOnRank1(MoELayer):
    """allgather_reducescatter whose rank 1 believes it holds one row more than it does: the
    size check of all_gatherv refuses on rank 1 while rank 0 waits in the all-gather."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.backend, AllGatherReduceScatterBackend):
            _with_backend(self, _MiscountsOnRank1(self.backend.ctx))


def run_plans_raising_in_combine_on_rank1(plans, traces):
    """``moeshard run``'s rank entry (``runjob.run_plans``) with a fault planted in the rank: on
    rank 1, all2all's combine raises before its all-to-all, so rank 0 waits in it until the
    process group's timeout."""
    from moeshard.jobs.run import run_plans

    original = All2AllBackend.combine

    def combine(self, y, dispatched):
        if self.groups.rank == 1:
            raise RuntimeError("planted: combine refuses on rank 1")
        return original(self, y, dispatched)

    All2AllBackend.combine = combine
    try:
        return run_plans(plans, traces)
    finally:
        All2AllBackend.combine = original


# -- planted wrong backwards that `moeshard check --backward --explain` must name ------------------
# (tests/test_backward_matrix.py)

class _SummedGatherRows(torch.autograd.Function):
    """``gather_rows`` whose backward sums the ranks' upstream gradients before keeping this
    rank's rows: the textbook adjoint of an all-gather (a reduce-scatter), wrong under the
    replicated loss, where every TP rank's upstream gradient already is the whole one."""

    @staticmethod
    def forward(ctx, y, sizes, index, group, group_name, trace):
        ctx.start, ctx.rows, ctx.group = sum(sizes[:index]), sizes[index], group
        return all_gatherv(y.contiguous(), sizes, group, group_name, trace=trace)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed[ctx.start:ctx.start + ctx.rows], None, None, None, None, None


def _summed_gather_rows(y, sizes, index, group, group_name, *, trace=None):
    return _SummedGatherRows.apply(y, sizes, index, group, group_name, trace)


class SummedSPGatherBackward(MoELayer):
    """Under SP, the output all-gather's backward sums the TP ranks' gradients: every gradient
    behind it comes out tp times too large (the bug other libraries shipped at tp = 2)."""

    def forward(self, x):
        original = layer_module.gather_rows
        layer_module.gather_rows = _summed_gather_rows
        try:
            return super().forward(x)
        finally:
            layer_module.gather_rows = original


class MissingDPReduction(MoELayer):
    """Says that no parameter needs the DP group's sum (its gradient roles): reduce_gradients then
    leaves each DP rank with its own tokens' share of the router and shared experts (and, EP
    off, of the experts)."""

    def gradient_roles(self):
        return {name: replace(role, reduce="") if role.reduce == "dp" else role
                for name, role in super().gradient_roles().items()}


class DoubledExpertGradient(MoELayer):
    """With EP on, the routed experts' weight gradients come out doubled (the 'gradients doubled
    at EP=2' bug): a hook on each expert parameter, set at the first forward that trains."""

    def forward(self, x):
        if self.parallel.enable_ep and not getattr(self, "_doubled", False) and torch.is_grad_enabled():
            for p in self.experts.parameters():
                if p.requires_grad:
                    p.register_hook(lambda g: 2 * g)
                    self._doubled = True
        return super().forward(x)


class ThreeWrongBackwards(SummedSPGatherBackward, MissingDPReduction, DoubledExpertGradient):
    """All three at once, each acting where its layout has the collective it breaks: the summed
    SP gather under SP, the missing DP reduction wherever a gradient is summed over 'dp' (EP off,
    or the router under EP with dp > 1), the doubled expert gradient under EP. One world then
    runs one case per fault; each case's report names the first wrong stage of its backward."""


class UnsquaredRelu(MoELayer):
    """Ungated experts that compute relu(up) where the kind says relu(up)^2 (an activation
    mistaken for its neighbour)."""

    def __init__(self, *args, **kwargs):
        from moeshard.activations import ActivationKind, activation_names, register_activation

        super().__init__(*args, **kwargs)
        if "relu_unsquared" not in activation_names():
            register_activation(ActivationKind("relu_unsquared", torch.relu, None, "relu(up), a planted fault",
                                               gated=False))
        self.kernel.activation = "relu_unsquared"


# A process-group backend that is gloo, except that rank 0 fails to set up its default group
# with the error the plan names ({"marker": path, "failures": n, "message": text}), the first n
# times it tries (counted in the marker file, across worlds). The plan is a JSON file at the path
# FLAKY_JOIN_ENV holds, set when this module is first imported (collecting the tests, before any
# fork server is started: its ranks inherit the environment it started with); no file, plain
# gloo. Registered when this module is imported, so in every rank that unpickles something of it.
FLAKY_JOIN_ENV = "MOESHARD_TEST_FLAKY_JOIN_PLAN"
FLAKY_GLOO = "flakygloo"
os.environ.setdefault(FLAKY_JOIN_ENV, os.path.join(tempfile.gettempdir(), f"moeshard-flaky-join-{os.getpid()}.json"))
_groups_set_up = [0]  # in this process; the first is the default group, later ones its subgroups


def _flaky_gloo(store, rank, size, timeout):
    import json

    _groups_set_up[0] += 1
    if rank == 0 and _groups_set_up[0] == 1 and os.path.exists(os.environ[FLAKY_JOIN_ENV]):
        with open(os.environ[FLAKY_JOIN_ENV]) as f:
            plan = json.load(f)
        with open(plan["marker"], "a+") as marker:
            marker.seek(0)
            tries = len(marker.read().splitlines())
            marker.write("try\n")
        if tries < plan["failures"]:
            raise RuntimeError(plan["message"])
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if FLAKY_GLOO not in dist.Backend.backend_list:
    dist.Backend.register_backend(FLAKY_GLOO, _flaky_gloo, devices=["cpu"])


def world_sum() -> float:
    """The sum of every rank's rank + 1, by all_reduce: proof that the group formed."""
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    return float(value.item())


class MoELayerOfThisModule(MoELayer):
    """MoELayer itself; passing it makes the ranks import this module (and its backend)."""

"""The gradient cases of the matrix (``moeshard check --backward``, case ids ending ``/grad``).

    rank:   x (this DP rank's tokens) and every parameter require grad -> forward -> backward of
            <upstream, out> with this DP rank's upstream gradient -> reduce_gradients ->
            grad_norm -> RankGrads (x's gradient, every parameter's, the norm)
    parent: the fp64 single-device reference of L = sum over DP ranks of <upstream_d, out_d>
            (``moeshard.training.reference``) -> every rank's rows of dL/dx, its shard of each
            parameter's dL/dθ, the norm

Upstream gradients differ per DP rank (and are the same on a DP rank's TP ranks: the replicated
loss, ``moeshard.autograd``), token counts include 0 and fewer than tp, and every row of every
gradient is compared. The forward output of a gradient case is compared as in a forward case.

A gradient is compared row by row (tokens of x, experts of the expert weights, rows of the other
weights): ``err = max |got - ref| / max(max |ref| of the row, ROW_FLOOR * max |ref| of the
tensor)``, which must stay within ``tolerances.grad_tolerance`` of the model dtype; the norm's
relative error within the same bound. ``err_to_bound`` is the worst ``err / tolerance``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.harness.inputs import CaseData, case_tokens_of
from moeshard.layer import MoELayer
from moeshard.parallel.groups import ParallelGroups
from moeshard.sharding import ShardSpec
from moeshard.tolerances import grad_tolerance
from moeshard.training import grad_norm, reduce_gradients
from moeshard.training.reference import GradReference, reference_grads, shard_of_grad

# A row's error is judged against at least 10% of its tensor's largest gradient: a row far below
# that (an activation's derivative near its zero, a bf16 dot product that cancels) carries the
# model dtype's rounding relative to its terms, not to itself. A doubled row still fails from
# 0.4% of the largest on (bf16: 4e-2 / 10%).
ROW_FLOOR = 0.1


@dataclass(frozen=True)
class RankGrads:
    """What a rank's backward gave. x: [T_d, H] the gradient of its DP rank's tokens; params:
    every parameter's gradient after ``reduce_gradients`` (the layer's names and local shapes);
    local: the same before the reduction (``--explain`` only, else None); norm: ``grad_norm``;
    shard: the layer's ``ShardSpec`` (which experts and slice of I the rank holds); stages: the
    backward's recorded values (``StageRecorder.grads``; ``--explain`` only, else None)."""

    x: torch.Tensor
    params: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor] | None
    norm: float
    shard: ShardSpec
    stages: dict[str, torch.Tensor] | None


def case_upstream(case) -> list[torch.Tensor]:
    """dL/d(output) of each DP rank's rows: [T_d, H] in the model dtype, from the case's seed
    and the DP rank (so ranks differ), the same in the ranks and in the parent."""
    cfg = case.moe_config()
    out = []
    for d, count in enumerate(case.tokens):
        g = torch.Generator().manual_seed(case.seed * 7057 + 31 * d + 5)
        out.append(torch.randn(count, cfg.hidden_size, generator=g).to(cfg.dtype))
    return out


def run_backward(case, layer: MoELayer, x: torch.Tensor, groups: ParallelGroups | None,
                 record: bool) -> tuple[torch.Tensor, RankGrads]:
    """On one rank: the forward of ``x`` (this DP rank's tokens) with every parameter and x
    requiring grad, the backward of this DP rank's upstream gradient, the reduction and the
    norm. Returns (the output, detached on the CPU; the ``RankGrads``)."""
    layer.requires_grad_(True)
    x = x.detach().requires_grad_(True)
    out = layer(x)
    dp_rank = case.parallel.dp_rank(groups.rank) if groups is not None else 0
    out.backward(case_upstream(case)[dp_rank].to(out.device))
    named = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    local = {n: _grad(p).cpu() for n, p in named} if record else None
    reduce_gradients(layer, groups)
    norm = float(grad_norm(layer, groups))
    assert x.grad is not None  # x is a leaf that requires grad, and out depends on it
    stages = layer.recorder.grads if record and layer.recorder is not None else None
    return out.detach().cpu(), RankGrads(x.grad.cpu(), {n: _grad(p).cpu() for n, p in named}, local, norm,
                                         layer.shard, None if stages is None else dict(stages))


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()


def grad_reference(case, data: CaseData | None = None, rows: torch.Tensor | None = None) -> GradReference:
    """The case's fp64 reference over every DP rank's tokens (DP rank 0's first); rows: bool
    [N], only these rows' loss (None: all)."""
    data = data or CaseData()
    cfg, p = case.moe_config(), case.parallel
    return reference_grads(torch.cat(case_tokens_of(case)), torch.cat(case_upstream(case)), data.weights(case), cfg,
                           rows, intermediate_shards=1 if p.enable_ep else p.tp)


@dataclass(frozen=True)
class GradComparison:
    """err: the worst row's error (see the module docstring); row: that row (-1 when empty or
    none); ratio: least-squares scale of got against ref over the worst row (2.0: doubled;
    nan when the row's reference is zero); ok: err within tolerance and every value finite;
    bad: rows out of bound."""

    err: float
    row: int
    ratio: float
    ok: bool
    tolerance: float
    bad: int = 0

    @property
    def err_to_bound(self) -> float:
        return self.err / self.tolerance


def compare_grad(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | str) -> GradComparison:
    """got: a gradient as a rank holds it; ref: the fp64 reference of the same shape."""
    tol = grad_tolerance(dtype)
    if tuple(got.shape) != tuple(ref.shape):
        return GradComparison(float("inf"), -1, float("nan"), False, tol, max(got.shape[0] if got.dim() else 1, 1))
    if got.numel() == 0:
        return GradComparison(0.0, -1, float("nan"), True, tol)
    if not bool(torch.isfinite(got).all()):
        return GradComparison(float("inf"), -1, float("nan"), False, tol, got.shape[0])
    g, r = got.double().reshape(got.shape[0], -1), ref.double().reshape(ref.shape[0], -1)
    floor = ROW_FLOOR * float(r.abs().max())
    scale = r.abs().amax(dim=1).clamp_min(floor if floor > 0 else 1e-30)
    per_row = (g - r).abs().amax(dim=1) / scale
    row = int(per_row.argmax())
    err = float(per_row[row])
    dot = float((r[row] * r[row]).sum())
    ratio = float((g[row] * r[row]).sum()) / dot if dot > 0 else float("nan")
    return GradComparison(err, row, ratio, err <= tol, tol, int((per_row > tol).sum()))


def norm_error(got: float, ref: float) -> float:
    """Relative error of a gradient norm (absolute when the reference norm is 0)."""
    return abs(got - ref) / ref if ref > 0 else abs(got)


def check_grads(case, ref: GradReference, grads: RankGrads, rank: int) -> tuple[bool, str, float]:
    """(ok, detail naming the worst gradient out of bound, worst err / tolerance) for one rank."""
    cfg = case.moe_config()
    d = case.parallel.dp_rank(rank)
    start = sum(case.tokens[:d])
    checks = {"x": compare_grad(grads.x, ref.x[start:start + case.tokens[d]], cfg.dtype)}
    for name, got in grads.params.items():
        if name not in ref.params:
            return False, f"rank {rank}: parameter {name!r} has a gradient the reference does not know", float("inf")
        checks[name] = compare_grad(got, shard_of_grad(name, ref.params[name], grads.shard, cfg), cfg.dtype)
    tol = grad_tolerance(cfg.dtype)
    nerr = norm_error(grads.norm, ref.norm)
    worst = max(max(c.err_to_bound for c in checks.values()), nerr / tol)
    bad = [(n, c) for n, c in checks.items() if not c.ok]
    if bad:
        name, c = max(bad, key=lambda nc: nc[1].err_to_bound)
        what = "token" if name == "x" else "row"
        return False, (f"rank {rank}: gradient of {name} off by {c.err:.3g} (bound {c.tolerance:g}) at {what} {c.row}, "
                       f"{c.ratio:.3g}x the reference"), worst
    if nerr > tol:
        return False, f"rank {rank}: gradient norm {grads.norm:.6g}, the reference's {ref.norm:.6g}", worst
    return True, "", worst

"""One case: the layer on a rank (``run_layer``), the reference once per case (``case_reference``),
and the comparison of every row a rank returned (``check_rank``).

The reference of a case depends on the case alone, not on the rank, so the harness computes it
once, in the parent process, while the ranks run the layer; the ranks send their output rows
back and the parent compares them. ``run_case`` does all three on one rank (for callers with no
parent, such as a torchrun job).

    rank:   inputs -> MoELayer -> ("built": its kernel's accumulation) -> forward -> RankOutput
    parent: CaseReference (per DP rank's rows, quantization error) -> check_rank per RankOutput
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeshard.config import QuantConfig
from moeshard.dispatch.registry import build_groups
from moeshard.harness import eplb
from moeshard.harness.cases import Case
from moeshard.harness.eplb import EPLBResult
from moeshard.harness.grads import RankGrads, check_grads, grad_reference, run_backward
from moeshard.harness.inputs import CaseData, case_tokens_of
from moeshard.layer import MoELayer
from moeshard.numerics import Reference
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.trace import CollectiveTrace
from moeshard.quant import scheme_names
from moeshard.reference import reference_forward
from moeshard.sharding import shard_spec
from moeshard.stages import StageRecorder
from moeshard.tolerances import compare_rows
from moeshard.training.reference import GradReference


@dataclass(frozen=True)
class RankResult:
    """What one rank's rows showed. rows/expected_rows: output rows it returned / should have;
    worst_row: global token index (within its DP rank) of the largest error, -1 if none;
    quant_error: relative RMS error of the quantized against the unquantized reference over
    the case's tokens (on rank 0's result only, None elsewhere); err_to_bound: the largest error
    relative to its element's bound (``tolerances.Comparison``; inf when rows are missing)."""

    rank: int
    rows: int
    expected_rows: int
    max_abs_err: float
    atol: float
    rtol: float
    ok: bool
    worst_row: int
    quant_error: float | None
    detail: str = ""
    err_to_bound: float = float("inf")


@dataclass(frozen=True)
class RankOutput:
    """What a rank's layer returned for a case. out: [rows, H] in the model dtype (CPU), which
    should be [tokens of its DP rank, H]; accumulation: its expert kernel's declared accumulation
    error (``MoELayer.accumulation``), which the reference's slack must use; stages: what each
    stage produced (``StageRecorder.stages``) when the case ran with ``record``, else None;
    after: for a load-balancing case, the output after the mid-run rebalance and what the
    rank's own EPLB checks found (``harness.eplb.EPLBResult``), else None; grads: for a
    gradient case, what its backward gave (``harness.grads.RankGrads``), else None."""

    rank: int
    out: torch.Tensor
    accumulation: float
    stages: dict | None = None
    after: EPLBResult | None = None
    grads: RankGrads | None = None


@dataclass(frozen=True)
class CaseReference:
    """The reference of one case. rows[d]: ``Reference`` of DP rank d's tokens ([T_d, H] fp64);
    accumulation: the one it was computed for; quant_error: relative RMS error of the quantized
    against the unquantized reference over all tokens (None unquantized or without tokens);
    grads: a gradient case's fp64 reference gradients (``training.reference``), else None."""

    rows: list[Reference]
    accumulation: float
    quant_error: float | None
    grads: GradReference | None = None


class GroupsCache:
    """Process groups per layout, built once per spawn (creating groups is collective and slow);
    ``trace``: the rank's ``CollectiveTrace``, which every layout's groups record into."""

    def __init__(self, device: str, trace: CollectiveTrace | None = None) -> None:
        self.device, self.trace = device, trace
        self._groups: dict[ParallelConfig, ParallelGroups] = {}

    def get(self, parallel: ParallelConfig) -> ParallelGroups | None:
        if not torch.distributed.is_initialized():
            return None
        if parallel not in self._groups:
            # any registered backend may run on this layout in the matrix: the groups serve them all
            self._groups[parallel] = build_groups(parallel, self.device, trace=self.trace)
        return self._groups[parallel]


def relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def run_layer(case: Case, rank: int, device: torch.device, groups: ParallelGroups | None,
              layer_factory: Callable[..., MoELayer] = MoELayer, data: CaseData | None = None,
              on_built: Callable[[float], None] = lambda accumulation: None, record: bool = False) -> RankOutput:
    """Builds the case's layer on ``rank`` and runs its DP rank's tokens; ``on_built`` gets the
    layer's accumulation before the forward (so the reference can start); ``record``: keep every
    stage's values (``moeshard.stages``) in the output, for ``--explain``."""
    data = data or CaseData()
    cfg = case.moe_config()
    weights = data.weights(case)
    xs = case_tokens_of(case)
    dp_rank = case.parallel.dp_rank(rank)
    local = None
    # A layer factory may register the case's scheme itself (an extension, in a fresh rank): until
    # it has, the layer shards its own experts. Under EPLB it shards them per physical slot.
    if case.quant.scheme in scheme_names() and case.eplb is None:
        local = data.local_experts(case, shard_spec(case.parallel, rank, cfg.num_experts))
    recorder = StageRecorder() if record else None
    extra = {"recorder": recorder} if record else {}
    # The most tokens any DP rank holds: a fixed-capacity backend sizes its buffers from it.
    layer = layer_factory(cfg, quant=case.quant, groups=groups, backend=case.backend, weights=weights,
                          local_experts=local, device=device, max_tokens_per_rank=max(max(case.tokens), 1),
                          **eplb.layer_kwargs(case), **extra)
    balance = eplb.EPLBCheck(case, layer, groups) if case.eplb is not None else None
    on_built(layer.accumulation)
    x = xs[dp_rank].to(device)
    if case.grad:
        out, grads = run_backward(case, layer, x, groups, record)
        return RankOutput(rank, out, layer.accumulation, None if recorder is None else recorder.stages, grads=grads)
    out = layer(x).cpu()
    after = balance.rebalance_and_rerun(x) if balance is not None else None
    return RankOutput(rank, out, layer.accumulation, None if recorder is None else recorder.stages, after)


def case_reference(case: Case, accumulation: float, data: CaseData | None = None) -> CaseReference:
    """The reference rows of every DP rank's tokens, each within its quantization domain (all
    tokens with EP on, the DP rank's own with EP off), and the quantization error."""
    data = data or CaseData()
    p, cfg, weights = case.parallel, case.moe_config(), data.weights(case)
    xs = case_tokens_of(case)
    domains = [torch.cat(xs)] if p.enable_ep else xs
    shards = 1 if p.enable_ep else p.tp
    experts = data.dequantized(case, case.quant.scheme)
    refs = [reference_forward(d, weights, cfg, case.quant, intermediate_shards=shards, accumulation=accumulation,
                              experts=experts) for d in domains]
    quant_error = None
    if case.quant.quantized and sum(case.tokens) != 0:
        plain_experts = data.dequantized(case, "none")
        plain = [reference_forward(d, weights, cfg, QuantConfig(), intermediate_shards=shards, experts=plain_experts,
                                   with_slack=False).out for d in domains]
        quant_error = relative_rms(torch.cat([r.out for r in refs]), torch.cat(plain))
    rows = refs if not p.enable_ep else [refs[0].rows(sum(case.tokens[:d]), sum(case.tokens[:d + 1]))
                                         for d in range(p.dp)]
    return CaseReference(rows, accumulation, quant_error, grad_reference(case, data) if case.grad else None)


def check_rank(case: Case, ref: CaseReference, output: RankOutput) -> RankResult:
    """Compares every row ``output`` holds with its DP rank's reference rows."""
    cfg, rank = case.moe_config(), output.rank
    dp_rank = case.parallel.dp_rank(rank)
    T, out = case.tokens[dp_rank], output.out
    expected = ref.rows[dp_rank]
    quant_error = ref.quant_error if rank == 0 else None
    if tuple(out.shape) != (T, cfg.hidden_size):
        return RankResult(rank, out.shape[0] if out.dim() else 0, T, float("inf"), 0.0, 0.0, False, -1, quant_error,
                          f"rank {rank} returned shape {tuple(out.shape)}, expected {(T, cfg.hidden_size)}")
    if output.accumulation != ref.accumulation:
        return RankResult(rank, T, T, float("inf"), 0.0, 0.0, False, -1, quant_error,
                          f"rank {rank}'s expert kernel declares accumulation {output.accumulation:g}, the "
                          f"reference was computed for {ref.accumulation:g} (another rank's kernel)")
    c = compare_rows(out, expected, cfg.dtype, case.quant.scheme)
    worst = int((out.double() - expected.out).abs().amax(dim=1).argmax()) if T else -1
    ok, detail = c.ok, ""
    bound = case.quant.spec.quant_error
    if quant_error is not None and quant_error > bound:
        ok = False
        detail = f"quantization error {quant_error:.3g} exceeds the {case.quant.scheme} bound {bound}"
    elif not ok:
        detail = f"rank {rank}: max error {c.max_abs_err:.3g} at token {worst} of DP rank {dp_rank}"
    err = c.max_abs_err
    after = output.after
    if after is not None:  # load balancing: the same reference after a rebalance, and its checks
        c2 = compare_rows(after.out, expected, cfg.dtype, case.quant.scheme)
        problems = list(after.problems)
        if not c2.ok:
            moved = float((after.out.double() - out.double()).abs().amax()) if T else 0.0
            problems.append(f"after the rebalance: max error {c2.max_abs_err:.3g} (before {err:.3g}, "
                            f"outputs differ by {moved:.3g})")
        if problems:
            ok = False
            detail = "; ".join(([detail] if detail else []) + [f"rank {rank}: {q}" for q in problems])
        err = max(err, c2.max_abs_err)
        c = c if c.err_to_bound >= c2.err_to_bound else c2
    err_to_bound = c.err_to_bound
    if case.grad:  # the gradients, after the forward rows
        if output.grads is None or ref.grads is None:
            return RankResult(rank, T, T, err, c.atol, c.rtol, False, worst, quant_error,
                              f"rank {rank}: a gradient case without gradients", float("inf"))
        grads_ok, grads_detail, grads_err = check_grads(case, ref.grads, output.grads, rank)
        ok = ok and grads_ok
        detail = "; ".join(d for d in (detail, grads_detail) if d)
        err_to_bound = max(err_to_bound, grads_err)
    return RankResult(rank, T, T, err, c.atol, c.rtol, ok, worst, quant_error, detail, err_to_bound)


def run_case(case: Case, rank: int, device: torch.device, groups: ParallelGroups | None,
             layer_factory: Callable[..., MoELayer] = MoELayer, data: CaseData | None = None) -> RankResult:
    """The whole case on one rank: its layer, the reference, the comparison of its rows."""
    data = data or CaseData()
    output = run_layer(case, rank, device, groups, layer_factory, data)
    return check_rank(case, case_reference(case, output.accumulation, data), output)

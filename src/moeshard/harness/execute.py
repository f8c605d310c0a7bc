"""One case on one rank: build the layer for the case's layout, run this rank's tokens, compare
every output row with the single-device reference of the rank's quantization domain."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moeshard.config import QuantConfig
from moeshard.harness import eplb
from moeshard.harness.cases import Case
from moeshard.harness.inputs import case_tokens, case_weights
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.reference import reference_forward
from moeshard.tolerances import compare


@dataclass(frozen=True)
class RankResult:
    """What one rank found. rows/expected_rows: output rows it returned / should have;
    worst_row: global token index (within its DP rank) of the largest error, -1 if none;
    quant_error: relative RMS error of the quantized against the unquantized reference over
    the domain (reported by rank 0 only, None elsewhere)."""

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


class GroupsCache:
    """Process groups per layout, built once per spawn (creating groups is collective and slow)."""

    def __init__(self, side_channel: bool) -> None:
        self.side_channel = side_channel
        self._groups: dict[ParallelConfig, ParallelGroups] = {}

    def get(self, parallel: ParallelConfig) -> ParallelGroups | None:
        if not torch.distributed.is_initialized():
            return None
        if parallel not in self._groups:
            self._groups[parallel] = ParallelGroups.build(parallel, side_channel=self.side_channel)
        return self._groups[parallel]


def relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def run_case(case: Case, rank: int, device: torch.device, groups: ParallelGroups | None,
             layer_factory: Callable[..., MoELayer] = MoELayer) -> RankResult:
    p = case.parallel
    cfg = case.moe_config()
    weights = case_weights(cfg, case.seed, skew=case.skew)
    xs = case_tokens(cfg, case.seed, case.tokens, skew=case.skew)
    dp_rank = p.dp_rank(rank)
    # The most tokens any DP rank holds: a fixed-capacity backend sizes its buffers from it.
    layer = layer_factory(cfg, quant=case.quant, groups=groups, backend=case.backend, weights=weights, device=device,
                          max_tokens_per_rank=max(max(case.tokens), 1), **eplb.layer_kwargs(case))
    balance = eplb.EPLBCheck(case, layer, groups) if case.eplb is not None else None
    out = layer(xs[dp_rank].to(device)).cpu()
    after = balance.rebalance_and_rerun(xs[dp_rank].to(device)) if balance is not None else None

    if p.enable_ep:  # one quantization domain: every DP rank's tokens, in DP order
        domain, offset = torch.cat(xs), sum(case.tokens[:dp_rank])
    else:
        domain, offset = xs[dp_rank], 0
    shards = 1 if p.enable_ep else p.tp
    full_ref = reference_forward(domain, weights, cfg, case.quant, intermediate_shards=shards,
                                 accumulation=layer.accumulation)
    T = case.tokens[dp_rank]
    ref = full_ref.rows(offset, offset + T)
    quant_error = None
    if rank == 0 and case.quant.quantized and domain.shape[0]:
        plain = reference_forward(domain, weights, cfg, QuantConfig(), intermediate_shards=shards)
        quant_error = relative_rms(full_ref.out, plain.out)
    if tuple(out.shape) != (T, cfg.hidden_size):
        return RankResult(rank, out.shape[0] if out.dim() else 0, T, float("inf"), 0.0, 0.0, False, -1, quant_error,
                          f"rank {rank} returned shape {tuple(out.shape)}, expected {(T, cfg.hidden_size)}")
    err, atol, rtol, ok = compare(out, ref, cfg.dtype, case.quant.scheme)
    worst = int((out.double() - ref.out).abs().amax(dim=1).argmax()) if T else -1
    detail = ""
    bound = case.quant.spec.quant_error
    if quant_error is not None and quant_error > bound:
        ok = False
        detail = f"quantization error {quant_error:.3g} exceeds the {case.quant.scheme} bound {bound}"
    elif not ok:
        detail = f"rank {rank}: max error {err:.3g} at token {worst} of DP rank {dp_rank}"
    if after is not None:  # load balancing: the same reference after a rebalance, and its checks
        err2, _, _, ok2 = compare(after.out, ref, cfg.dtype, case.quant.scheme)
        problems = list(after.problems)
        if not ok2:
            problems.append(f"after the rebalance: max error {err2:.3g} (before {err:.3g}, "
                            f"outputs differ by {float((after.out.double() - out.double()).abs().amax()) if T else 0.0:.3g})")
        if problems:
            ok = False
            detail = "; ".join(([detail] if detail else []) + [f"rank {rank}: {q}" for q in problems])
        err = max(err, err2)
    return RankResult(rank, T, T, err, atol, rtol, ok, worst, quant_error, detail)

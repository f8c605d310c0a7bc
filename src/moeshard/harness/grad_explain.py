"""``moeshard check --backward --explain``: the first point of a gradient case that leaves its
bound, and where. Stages, in the order the values are made:

    forward       every forward stage (``moeshard.harness.explain``): a wrong forward comes first
    sp_gather     (SP) the gradient of this rank's rows of the output after the all-gather's
                  backward: its chunk of the upstream gradient
    topk_weights  the gradient of the top-k weights of the tokens the rank routes (after the TP
                  copy's all-reduce under TP)
    x             the gradient of the rank's tokens
    params        each parameter's gradient as the rank's own backward left it, before
                  ``reduce_gradients``: the reference of the loss of the rows that backward
                  carries (the DP rank's tokens; its SP chunk of them for the router and the
                  shared experts; every token for an expert the rank owns under EP)
    reduced       each parameter's gradient after ``reduce_gradients``: the whole gradient
    norm          ``grad_norm``

Each names the worst row of the first tensor out of bound: rank, token or expert, parameter,
and got against the reference as a ratio (2.00x: a doubled gradient; tp x at sp_gather: the TP
ranks' gradients summed), or, after the reduction, that the gradient is still the rank's own.
"""

from __future__ import annotations

import collections
import math

import torch

from moeshard.autograd.roles import layer_role
from moeshard.harness.cases import Case
from moeshard.harness.explain import Finding, StageReport, explain_case
from moeshard.harness.grads import GradComparison, RankGrads, case_upstream, compare_grad, grad_reference, norm_error
from moeshard.harness.inputs import CaseData
from moeshard.parallel.sequence import SequenceChunk
from moeshard.tolerances import grad_tolerance
from moeshard.training.reference import GradReference, shard_of_grad

__all__ = ["GRAD_STAGES", "explain_grads"]

GRAD_STAGES = ("sp_gather", "topk_weights", "x", "params", "reduced", "norm")


def _ratio(c: GradComparison) -> str:
    return "against a zero reference" if math.isnan(c.ratio) else f"{c.ratio:.2f}x the reference"


def _row(t: torch.Tensor, row: int) -> str:
    return "" if row < 0 else "[" + ", ".join(f"{v:.4g}" for v in t[row].flatten()[:4].tolist()) + ", ...]"


class _Explainer:
    def __init__(self, case: Case, data: CaseData) -> None:
        self.case, self.data = case, data
        self.cfg = case.moe_config()
        self.full = grad_reference(case, data)
        self.upstream = case_upstream(case)
        self._partial: dict[tuple[int, int], GradReference] = {}
        # stage -> (finding, its comparison; None for the reduction's and the norm's own findings)
        self.found: dict[str, list[tuple[Finding, GradComparison | None]]] = {s: [] for s in GRAD_STAGES}
        self.bad_rows: dict[str, collections.Counter] = {s: collections.Counter() for s in GRAD_STAGES}
        self.compared: set[str] = set()

    def partial(self, start: int, stop: int) -> GradReference:
        """The reference of the loss of global rows [start, stop) alone."""
        if (start, stop) not in self._partial:
            rows = torch.zeros(sum(self.case.tokens), dtype=torch.bool)
            rows[start:stop] = True
            self._partial[(start, stop)] = grad_reference(self.case, self.data, rows)
        return self._partial[(start, stop)]

    def compare(self, stage: str, rank: int, what: str, got: torch.Tensor, ref: torch.Tensor,
                token_of_row=None, expert_of_row=None) -> GradComparison:
        """Compares one tensor (rows as ``compare_grad``); a finding for its worst row if out of
        bound. token_of_row / expert_of_row: row -> token of the DP rank / global expert."""
        self.compared.add(stage)
        c = compare_grad(got, ref, self.cfg.dtype)
        if not c.ok:
            self.bad_rows[stage][rank] += c.bad
            d = self.case.parallel.dp_rank(rank)
            token = None if token_of_row is None or c.row < 0 else token_of_row(c.row)
            expert = None if expert_of_row is None or c.row < 0 else expert_of_row(c.row)
            self.found[stage].append((Finding(
                stage, rank, what, token=token, dp_rank=None if token is None else d,
                global_token=None if token is None else sum(self.case.tokens[:d]) + token, expert=expert,
                expected=_row(ref.double(), c.row), got=_row(got.double(), c.row), err_to_bound=c.err_to_bound), c))
        return c

    def rank(self, rank: int, g: RankGrads) -> None:
        case, p, cfg = self.case, self.case.parallel, self.cfg
        d = p.dp_rank(rank)
        off, T = sum(case.tokens[:d]), case.tokens[d]
        start, count = 0, T
        if p.is_sequence_parallel:
            chunk = SequenceChunk.of(T, p.tp_rank(rank), p.tp)
            start, count = chunk.start, chunk.real
        stages = g.stages or {}
        if "sp_gather" in stages:
            self.compare("sp_gather", rank, "output rows", stages["sp_gather"], self.upstream[d][start:start + count].double(),
                         token_of_row=lambda i: start + i)
        if "topk_weights" in stages:
            self.compare("topk_weights", rank, "top-k weights", stages["topk_weights"],
                         self.full.topk_weights[off + start:off + start + count], token_of_row=lambda i: start + i)
        self.compare("x", rank, "x", g.x, self.full.x[off:off + T], token_of_row=lambda i: i)
        for name, got in g.params.items():
            # which expert a row is: a rank's experts in order; the router's rows are the experts
            experts = list(g.shard.logical_experts) if name.startswith("experts.") else \
                list(range(cfg.num_experts)) if name.startswith("gate.") else None
            expert_of_row = None if experts is None else experts.__getitem__
            full = shard_of_grad(name, self.full.params[name], g.shard, cfg)
            role = layer_role(name, p, rank)
            if g.local is not None:
                if role.kind == "expert":
                    rows = (0, sum(case.tokens))
                elif role.reduce == "ep":
                    rows = (off + start, off + start + count)
                else:
                    rows = (off, off + T)
                own = shard_of_grad(name, self.partial(*rows).params[name], g.shard, cfg)
                if not self.compare("params", rank, name, g.local[name], own, expert_of_row=expert_of_row).ok:
                    continue
                group_size = {"dp": p.dp, "ep": p.world_size}.get(role.reduce, 1)
                reduced = compare_grad(got, full, cfg.dtype)
                if not reduced.ok and group_size > 1 and torch.equal(got, g.local[name]):
                    self.compared.add("reduced")
                    self.bad_rows["reduced"][rank] += reduced.bad
                    self.found["reduced"].append((Finding(
                        "reduced", rank, "not_reduced", expert=None if expert_of_row is None else expert_of_row(reduced.row),
                        expected=f"the sum over '{role.reduce}' ({group_size} ranks)",
                        got=f"this rank's own gradient of {name}, unchanged", err_to_bound=reduced.err_to_bound), None))
                    continue
            self.compare("reduced", rank, name, got, full, expert_of_row=expert_of_row)
        self.compared.add("norm")
        err = norm_error(g.norm, self.full.norm)
        tol = grad_tolerance(cfg.dtype)
        if err > tol:
            self.bad_rows["norm"][rank] += 1
            ratio = f" ({g.norm / self.full.norm:.2f}x)" if self.full.norm else ""
            self.found["norm"].append((Finding("norm", rank, "norm", expected=f"{self.full.norm:.6g}",
                                               got=f"{g.norm:.6g}{ratio}", err_to_bound=err / tol), None))


def _headline(case: Case, stage: str, first: Finding, c: GradComparison | None, n: int) -> str:
    p = case.parallel
    where = f"backward stage {stage}, rank {first.rank}"
    more = f" ({n} rows of this stage out of bound on rank {first.rank})" if n > 1 else ""
    if c is None:  # the reduction left a gradient as it was, or the norm
        if first.kind == "not_reduced":
            return f"{where}: {first.got} after reduce_gradients: it was not summed, expected {first.expected}"
        return f"{where}: grad_norm {first.got} against the reference's {first.expected}"
    ratio = _ratio(c)
    if stage == "sp_gather":
        text = f"{where}: the gradient of its rows of the output (token {first.token} first) is {ratio}"
        if p.tp > 1 and abs(c.ratio - p.tp) < 0.01 * p.tp:
            text += (f": the {p.tp} TP ranks' gradients were summed; the SP all-gather's backward must keep this "
                     f"rank's rows of the one upstream gradient")
        return text + more
    at = (f"token {first.token}" if first.token is not None else
          f"expert {first.expert}" if first.expert is not None else f"row {c.row}")
    when = {"params": " from this rank's own backward (before reduce_gradients)",
            "reduced": " after reduce_gradients"}.get(stage, "")
    return f"{where}: the gradient of {first.kind}{when} at {at} is {ratio}{more}"


def explain_grads(case: Case, outputs: list, accumulation: float, data: CaseData | None = None) -> StageReport:
    """outputs: every rank's ``RankOutput`` of a gradient case run with stages recorded."""
    data = data or CaseData()
    forward = explain_case(case, outputs, accumulation, data)
    if forward.first is not None:
        return StageReport(forward.first, forward.wrong, f"the forward already leaves its bound: {forward.headline}",
                           forward.lines)
    ex = _Explainer(case, data)
    for o in sorted(outputs, key=lambda o: o.rank):
        if o.grads is None:
            return StageReport(Finding("x", o.rank, "missing"), {"x": {o.rank: 1}},
                               f"rank {o.rank} returned no gradients", [])
        ex.rank(o.rank, o.grads)
    wrong = {s: dict(ex.bad_rows[s]) for s in GRAD_STAGES if ex.found[s]}
    stage = next((s for s in GRAD_STAGES if ex.found[s]), None)
    compared = [s for s in GRAD_STAGES if s in ex.compared]
    if stage is None:
        return StageReport(None, {}, "every stage of the forward and the backward within its bound on every rank",
                           [f"backward stages compared: {', '.join(compared)}"])
    first_rank = min(f.rank for f, _ in ex.found[stage])
    first, c = max(((f, c) for f, c in ex.found[stage] if f.rank == first_rank),
                   key=lambda fc: fc[0].err_to_bound or 0.0)
    lines = [f"first: {first.kind}{'' if c is None else f' row {c.row}'}: expected {first.expected}, got {first.got}"
             + (f" (error {first.err_to_bound:.3g} x its bound)" if first.err_to_bound is not None else ""),
             f"rows out of bound at stage {stage}: " + ", ".join(f"rank {r} {n}" for r, n in sorted(wrong[stage].items()))]
    earlier = ["forward", *compared[:compared.index(stage)]]
    lines.append(f"within bounds before it: {', '.join(earlier)}")
    later = [f"{s} ({sum(wrong[s].values())} rows)" for s in GRAD_STAGES[GRAD_STAGES.index(stage) + 1:] if s in wrong]
    if later:
        lines.append(f"out of bound after it (following from it or not): {', '.join(later)}")
    return StageReport(first, wrong, _headline(case, stage, first, c, wrong[stage][first_rank]), lines)

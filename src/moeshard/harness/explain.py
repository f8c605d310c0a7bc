"""``moeshard check --explain``: the first stage of a case whose values leave their bound, and where.

The ranks run the case with a ``moeshard.stages.StageRecorder`` and send what each stage
produced; here, in the parent, the reference computes the same stages on the same tokens and
each rank's values are compared, stage by stage in pipeline order (``STAGES``):

    routing    ids equal, weights within the fp32 entry of the tolerance table
    payload    the quantized rows and scales byte for byte (quantization is deterministic)
    dispatch   every row a rank receives is some token's payload, with that token's scales, for
               an expert the token chose, each (token, top-k slot) exactly once; which token a
               row carries is found from its bytes, so no backend has to say. Under load
               balancing the placement decides which replica of an expert gets a row: each
               (token, top-k slot) must reach exactly one rank holding its expert, checked over
               all ranks of the domain
    experts    each received row through its expert (a TP rank: its slice of the intermediate
               dimension, with its slice of the expert biases and, TP rank 0, the down bias),
               within the table's bound plus the reference's slack for that row
    combine    the weighted sums over top-k (a TP slice's part), same bound with the slack
    tp_reduce  the sums after the TP all-reduce (TP without EP)
    shared     the shared experts' contribution (gate and scale included), same bound with its slack
    output     the returned rows, as the check compares them

A routing kind with the weight on the expert's input (``weights_on_input``) is explained for
top-1, where each token is one routed row x * w: payload, dispatch and experts are then those
rows', combined with weight 1 (every such preset is top-1).

The report names the first stage with a value out of bound: its rank, token (index within the
DP rank and over all tokens of the case), expert and top-k slot, expected against got, and how
many rows of that stage are wrong on each rank.
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field

import torch

from moeshard.harness.cases import Case
from moeshard.harness.inputs import CaseData, case_tokens_of
from moeshard.parallel.sequence import SequenceChunk
from moeshard.quant import quantize_activations, to_wire
from moeshard.reference import _fake_quant, expert_rows_batched, shared_reference
from moeshard.router import route_tokens, weighted_rows
from moeshard.sharding import shard_spec
from moeshard.stages import STAGES
from moeshard.tolerances import tolerance

__all__ = ["Finding", "StageReport", "explain_case"]


@dataclass(frozen=True)
class Finding:
    """One value out of its bound. token: index within its DP rank (``dp_rank``); global_token:
    index over the case's tokens (DP rank 0's first); expert: global id; slot: top-k slot."""

    stage: str
    rank: int
    kind: str
    token: int | None = None
    dp_rank: int | None = None
    global_token: int | None = None
    expert: int | None = None
    slot: int | None = None
    source_rank: int | None = None
    expected: str = ""
    got: str = ""
    err_to_bound: float | None = None


@dataclass(frozen=True)
class StageReport:
    """first: the first finding of the first stage out of bound (None: every stage within);
    wrong: stage -> rank -> rows out of bound; headline and lines: the report in words."""

    first: Finding | None
    wrong: dict[str, dict[int, int]]
    headline: str
    lines: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"first": None if self.first is None else asdict(self.first),
                "wrong_rows": {s: {str(r): n for r, n in ranks.items()} for s, ranks in self.wrong.items()},
                "headline": self.headline, "lines": self.lines}


def _fmt(values: torch.Tensor) -> str:
    flat = values.flatten().tolist()
    shown = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in flat[:6])
    return f"[{shown}{', ...' if len(flat) > 6 else ''}]"


class _Domain:
    """One quantization domain (all tokens with EP on, one DP rank's without) and its reference
    stages. Domain row n is token ``local[n]`` of DP rank ``dp[n]``."""

    def __init__(self, case: Case, data: CaseData, xs: list[torch.Tensor], dps: list[int], accumulation: float):
        p, cfg = case.parallel, case.moe_config()
        scheme = case.quant.spec
        weights = data.weights(case)
        self.x = torch.cat([xs[d] for d in dps]) if dps else xs[0][:0]
        self.dp = [d for d in dps for _ in range(case.tokens[d])]
        self.local = [t for d in dps for t in range(case.tokens[d])]
        self.offset = {d: sum(case.tokens[e] for e in dps[:i]) for i, d in enumerate(dps)}
        bias = None if weights.correction_bias is None else weights.correction_bias
        r = route_tokens(self.x, weights.router_weight, cfg, bias, weights.gate_bias)
        self.ids, self.weights = r.topk_ids, r.topk_weights
        combine_weights = r.topk_weights
        # The rows the experts see: the tokens, or with weights on the input x * w (top-1: one row
        # per token, so every stage's rows are still the tokens' rows), combined with weight 1.
        routed = self.x
        if cfg.routing_kind.weights_on_input:
            routed, r = weighted_rows(self.x, r, cfg.dtype)
            combine_weights = r.topk_weights.view(-1, cfg.top_k)
        amax: torch.Tensor | None = routed.abs().amax().float() if routed.numel() else torch.zeros(())
        amax = amax if scheme.per_tensor_activation else None
        self.scales = None
        if scheme.quantized and not case.quant.defer_input_quant:
            q = quantize_activations(routed, scheme.name, amax=amax)
            self.rows = to_wire(q.data)
            self.scales = None if q.row_scale is None else to_wire(q.row_scale)
        else:
            self.rows = routed
        xq = _fake_quant(routed, scheme.name, amax)
        experts = data.dequantized(case, scheme.name)
        slices = 1 if p.enable_ep else p.tp
        I, N, K = cfg.intermediate_size, self.x.shape[0], cfg.top_k
        w = I // slices
        self.y, self.slack = [], []
        for s in range(slices):
            y = torch.zeros(N, K, cfg.hidden_size, dtype=torch.float64)
            slack = torch.zeros_like(y)
            hits = [(e, (self.ids == e).nonzero(as_tuple=True)) for e in range(cfg.num_experts)]
            chosen = [(e, n, k) for e, (n, k) in hits if n.numel()]
            gate_up = [torch.cat([experts.gate_up[e][s * w:(s + 1) * w], experts.gate_up[e][I + s * w:I + (s + 1) * w]])
                       for e, _, _ in chosen]
            down = [experts.down[e][:, s * w:(s + 1) * w] for e, _, _ in chosen]
            biases = None
            if experts.gate_up_bias is not None and experts.down_bias is not None:
                b13, b2 = experts.gate_up_bias, experts.down_bias
                # a TP slice's gate_up bias; the down bias on slice 0 only (TP rank 0 adds it)
                biases = ([torch.cat([b13[e][s * w:(s + 1) * w], b13[e][I + s * w:I + (s + 1) * w]])
                           for e, _, _ in chosen], [b2[e] if s == 0 else None for e, _, _ in chosen])
            results = expert_rows_batched([xq[n] for _, n, _ in chosen], gate_up, down, cfg.activation, cfg.dtype,
                                          scheme.name, 1, accumulation, biases=biases)
            for (_, n, k), (ye, se) in zip(chosen, results, strict=True):
                assert se is not None  # expert_rows_batched computes the slack (with_slack=True)
                y[n, k], slack[n, k] = ye, se
            self.y.append(y)
            self.slack.append(slack)
        wk = combine_weights.double().unsqueeze(-1)
        self.combine = [(y * wk).sum(dim=1) for y in self.y]
        self.combine_slack = [(s * wk.abs()).sum(dim=1) for s in self.slack]
        self.shared = None
        if cfg.has_shared_experts:
            self.shared = shared_reference(self.x, weights, cfg, case.quant.shared, accumulation)


class _Rank:
    """Where one rank sits: its domain, the domain rows it routes, its experts and TP slice."""

    def __init__(self, case: Case, rank: int, domain: _Domain, domain_index: int):
        p, cfg = case.parallel, case.moe_config()
        self.rank, self.dp = rank, p.dp_rank(rank)
        T, off = case.tokens[self.dp], domain.offset[self.dp]
        first, count = 0, T
        if p.is_sequence_parallel:
            chunk = SequenceChunk.of(T, p.tp_rank(rank), p.tp)
            first, count = chunk.start, chunk.real
        self.rows = list(range(off + first, off + first + count))
        spec = shard_spec(p, rank, cfg.num_experts)
        self.experts = range(spec.expert_start, spec.expert_stop)
        self.slice = spec.tp_rank if spec.tp_size > 1 else 0
        self.domain, self.domain_index = domain, domain_index


def _source_rank(case: Case, domain: _Domain, n: int) -> int:
    """The global rank that routes domain row n."""
    p = case.parallel
    d, t = domain.dp[n], domain.local[n]
    if p.is_sequence_parallel:
        chunk = SequenceChunk.of(case.tokens[d], 0, p.tp).chunk
        return d * p.tp + (t // chunk if chunk else 0)
    return d * p.tp


def _finding(case: Case, stage: str, rank: int, kind: str, domain: _Domain, n: int | None, **kw) -> Finding:
    if n is None:
        return Finding(stage, rank, kind, **kw)
    d, t = domain.dp[n], domain.local[n]
    return Finding(stage, rank, kind, token=t, dp_rank=d, global_token=sum(case.tokens[:d]) + t, **kw)


def _numeric(case: Case, stage: str, r: _Rank, got: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor | None,
             rows: list[int], experts: list[int | None] | None = None, slots: list[int | None] | None = None,
             dtype=None, near: dict | None = None) -> list[Finding]:
    """Row-wise bound check: |got - ref| <= atol + rtol |ref| + slack. ``near[stage]`` keeps the
    element closest to its bound (within it or not)."""
    atol, rtol = tolerance(dtype or case.moe_config().dtype, case.quant.scheme)
    if got.shape[0] != len(rows):
        return [Finding(stage, r.rank, "rows", expected=f"{len(rows)} rows", got=f"{got.shape[0]} rows")]
    if not rows:
        return []
    diff = (got.double() - ref).abs()
    bound = atol + rtol * ref.abs() + (slack if slack is not None else 0)
    ratio = torch.where(torch.isfinite(got.double()), diff / bound, torch.full_like(diff, float("inf")))
    worst = ratio.amax(dim=1)
    if near is not None:
        i = int(worst.argmax())
        if stage not in near or float(worst[i]) > (near[stage].err_to_bound or 0):
            near[stage] = _finding(case, stage, r.rank, "near", r.domain, rows[i],
                                   expert=None if experts is None else experts[i], err_to_bound=float(worst[i]))
    out = []
    for i in (worst > 1).nonzero().flatten().tolist():
        j = int(ratio[i].argmax())
        out.append(_finding(case, stage, r.rank, "value", r.domain, rows[i],
                            expert=None if experts is None else experts[i], slot=None if slots is None else slots[i],
                            expected=f"{float(ref[i, j]):.6g} (column {j})", got=f"{float(got[i, j]):.6g}",
                            err_to_bound=float(worst[i])))
    return out


def _routing(case: Case, r: _Rank, rec: dict) -> list[Finding]:
    dom = r.domain
    ids, weights = rec["topk_ids"], rec["topk_weights"]
    if ids.shape[0] != len(r.rows):
        return [Finding("routing", r.rank, "rows", expected=f"{len(r.rows)} rows", got=f"{ids.shape[0]} rows")]
    out = []
    atol, rtol = tolerance("float32", "none")
    for i, n in enumerate(r.rows):
        want_ids, want_w = dom.ids[n], dom.weights[n]
        if not torch.equal(ids[i], want_ids) or bool(((weights[i] - want_w).abs() > atol + rtol * want_w.abs()).any()):
            out.append(_finding(case, "routing", r.rank, "choice", dom, n,
                                expected=f"experts {want_ids.tolist()} weights {_fmt(want_w)}",
                                got=f"experts {ids[i].tolist()} weights {_fmt(weights[i])}"))
    return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bytes (the tensors are wire views or model-dtype rows)."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and _key(a) == _key(b)


def _payload(case: Case, r: _Rank, rec: dict) -> list[Finding]:
    dom = r.domain
    rows, scales = rec["rows"], rec["row_scale"]
    if rows.shape[0] != len(r.rows):
        return [Finding("payload", r.rank, "rows", expected=f"{len(r.rows)} rows", got=f"{rows.shape[0]} rows")]
    out = []
    for i, n in enumerate(r.rows):
        data_ok = _same(rows[i:i + 1], dom.rows[n:n + 1])
        scale_ok = (scales is None and dom.scales is None) or (
            scales is not None and dom.scales is not None and _same(scales[i:i + 1], dom.scales[n:n + 1]))
        if not (data_ok and scale_ok):
            what = "data" if not data_ok else "scales"
            if not data_ok:
                exp, got = _fmt(dom.rows[n]), _fmt(rows[i])
            else:  # the scales differ, or only one side has them
                exp = _fmt(dom.scales[n]) if dom.scales is not None else "none"
                got = _fmt(scales[i]) if scales is not None else "none"
            out.append(_finding(case, "payload", r.rank, what, dom, n, expected=f"{what} {exp}", got=f"{what} {got}"))
    return out


def _key(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` (small rows: a list of ints is fast enough, and needs no numpy)."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def _dispatch(case: Case, r: _Rank, rec: dict, matched: dict, claimed: dict | None = None) -> list[Finding]:
    """Which (token, slot) each received row carries, from its bytes; records the match of
    every row in ``matched`` (row -> (n, slot) or None) for the experts stage. claimed: under
    load balancing, the domain's (n, slot) -> the rank that received it, filled across ranks
    (which rank gets a pair is the placement's choice, so a pair no rank received is reported
    once all ranks are matched: ``_unclaimed``); None otherwise (each rank's pairs are those
    of its own experts)."""
    dom, K = r.domain, case.moe_config().top_k
    repeat = rec["repeat"]
    rows = rec["rows"].repeat_interleave(repeat, dim=0) if repeat > 1 else rec["rows"]
    scales = rec["row_scale"]
    if scales is not None and repeat > 1:
        scales = scales.repeat_interleave(repeat, dim=0)
    ids = rec["expert_ids"]
    by_data: dict[bytes, list[int]] = collections.defaultdict(list)
    for n in range(dom.rows.shape[0]):
        by_data[_key(dom.rows[n])].append(n)
    by_scale: dict[bytes, list[int]] = collections.defaultdict(list)
    if dom.scales is not None:
        for n in range(dom.scales.shape[0]):
            by_scale[_key(dom.scales[n])].append(n)
    mine = set(r.rows)
    experts = range(case.moe_config().num_experts) if claimed is not None else r.experts
    expected = {(n, k) for n in range(dom.ids.shape[0]) for k in range(K)
                if int(dom.ids[n, k]) in experts and (case.parallel.enable_ep or n in mine)}
    taken = claimed if claimed is not None else {}
    out = []
    for m in range(ids.shape[0]):
        local = int(ids[m])
        if local < 0:
            continue  # padding: no expert computes it
        e = local + rec["first_expert"]
        candidates = by_data.get(_key(rows[m]), [])
        slot_of = [(n, k) for n in candidates for k in range(K) if int(dom.ids[n, k]) == e and (n, k) in expected]
        free = [nk for nk in slot_of if nk not in matched.values() and nk not in taken]
        if not candidates:
            matched[m] = None
            out.append(Finding("dispatch", r.rank, "data", expert=e, expected="a token's payload",
                               got=f"data {_fmt(rows[m])} that is no token's"))
            continue
        if not free:
            matched[m] = None
            n = candidates[0]
            kind = "twice" if slot_of else "expert"
            other = next((taken[nk] for nk in slot_of if nk in taken), None)
            out.append(_finding(case, "dispatch", r.rank, kind, dom, n, expert=e, source_rank=_source_rank(case, dom, n),
                                expected=f"experts {dom.ids[n].tolist()}" if kind == "expert" else "once",
                                got=f"a row for expert {e}" if kind == "expert" else
                                "a second row" if other is None else f"a second row (rank {other} received it too)"))
            continue
        n, k = free[0]
        matched[m] = (n, k)
        if claimed is not None:
            claimed[(n, k)] = r.rank
        if dom.scales is not None and scales is not None and not _same(scales[m:m + 1], dom.scales[n:n + 1]):
            owner = [o for o in by_scale.get(_key(scales[m]), []) if o != n]
            got = f"scales {_fmt(scales[m])}" + (f" (those of token {dom.local[owner[0]]} of DP rank {dom.dp[owner[0]]})"
                                                 if owner else "")
            out.append(_finding(case, "dispatch", r.rank, "scales", dom, n, expert=e, slot=k,
                                source_rank=_source_rank(case, dom, n), expected=f"scales {_fmt(dom.scales[n])}",
                                got=got))
    if claimed is None:
        for n, k in sorted(expected - {v for v in matched.values() if v is not None}):
            e = int(dom.ids[n, k])
            out.append(_finding(case, "dispatch", r.rank, "missing", dom, n, expert=e, slot=k,
                                source_rank=_source_rank(case, dom, n), expected="a row", got="none"))
    return out


def _unclaimed(case: Case, dom: _Domain, claimed: dict) -> list[Finding]:
    """Load balancing: the domain's (token, slot) pairs that no rank received, each reported on
    the rank that routed the token (no one rank was due to receive it)."""
    K = case.moe_config().top_k
    out = []
    for n in range(dom.ids.shape[0]):
        for k in range(K):
            if (n, k) not in claimed:
                source = _source_rank(case, dom, n)
                out.append(_finding(case, "dispatch", source, "missing", dom, n, expert=int(dom.ids[n, k]), slot=k,
                                    source_rank=source, expected="a row on a rank holding its expert", got="none"))
    return out


def _experts(case: Case, r: _Rank, rec: dict, matched: dict, near: dict) -> list[Finding]:
    dom = r.domain
    y = rec["y"]
    rows = [m for m in range(y.shape[0]) if matched.get(m) is not None]
    if not rows:
        return []
    got = y[rows]
    ref = torch.stack([dom.y[r.slice][matched[m][0], matched[m][1]] for m in rows])
    slack = torch.stack([dom.slack[r.slice][matched[m][0], matched[m][1]] for m in rows])
    found = _numeric(case, "experts", r, got, ref, slack, [matched[m][0] for m in rows],
                     experts=[int(dom.ids[matched[m][0], matched[m][1]]) for m in rows],
                     slots=[matched[m][1] for m in rows], near=near)
    return found


def _total(parts: list[torch.Tensor]) -> torch.Tensor:
    """``sum(parts)``, one part per TP slice, typed as the tensor it is."""
    total = sum(parts)
    assert isinstance(total, torch.Tensor)  # a domain has at least one slice (sum of none would be 0)
    return total


def explain_case(case: Case, outputs: list, accumulation: float, data: CaseData | None = None) -> StageReport:
    """outputs: every rank's ``RankOutput`` with its ``stages`` (``StageRecorder.stages``)."""
    data = data or CaseData()
    p = case.parallel
    xs = case_tokens_of(case)
    domains = [_Domain(case, data, xs, list(range(p.dp)), accumulation)] if p.enable_ep else \
        [_Domain(case, data, xs, [d], accumulation) for d in range(p.dp)]
    found: dict[str, list[Finding]] = {s: [] for s in STAGES}
    near: dict[str, Finding] = {}
    # Under load balancing, the pairs each domain's ranks received (``_dispatch``'s claimed).
    claimed: list[dict] | None = [{} for _ in domains] if case.eplb is not None else None
    for o in sorted(outputs, key=lambda o: o.rank):
        rec = o.stages or {}
        dom_index = 0 if p.enable_ep else p.dp_rank(o.rank)
        r = _Rank(case, o.rank, domains[dom_index], dom_index)
        dom = r.domain
        if "routing" in rec:
            found["routing"] += _routing(case, r, rec["routing"])
        if "payload" in rec:
            found["payload"] += _payload(case, r, rec["payload"])
        matched: dict = {}
        if "dispatch" in rec:
            found["dispatch"] += _dispatch(case, r, rec["dispatch"], matched,
                                           None if claimed is None else claimed[dom_index])
        if "experts" in rec:
            found["experts"] += _experts(case, r, rec["experts"], matched, near)
        if "combine" in rec:
            found["combine"] += _numeric(case, "combine", r, rec["combine"]["out"],
                                         dom.combine[r.slice][r.rows], dom.combine_slack[r.slice][r.rows], r.rows,
                                         near=near)
        if "tp_reduce" in rec:
            full = _total(dom.combine)[r.rows]
            found["tp_reduce"] += _numeric(case, "tp_reduce", r, rec["tp_reduce"]["out"], full,
                                           _total(dom.combine_slack)[r.rows], r.rows, near=near)
        if "shared" in rec and dom.shared is not None:
            found["shared"] += _numeric(case, "shared", r, rec["shared"]["out"], dom.shared.out[r.rows],
                                        dom.shared.slack[r.rows], r.rows, near=near)
        if "output" in rec:
            d = p.dp_rank(o.rank)
            rows = list(range(dom.offset[d], dom.offset[d] + case.tokens[d]))
            ref, slack = _total(dom.combine)[rows], _total(dom.combine_slack)[rows]
            if dom.shared is not None:
                ref, slack = ref + dom.shared.out[rows], slack + dom.shared.slack[rows]
            found["output"] += _numeric(case, "output", r, rec["output"]["out"], ref, slack, rows)
    if claimed is not None and all("dispatch" in (o.stages or {}) for o in outputs):
        for dom, pairs in zip(domains, claimed, strict=True):
            found["dispatch"] += _unclaimed(case, dom, pairs)
    wrong = {s: dict(collections.Counter(f.rank for f in fs)) for s, fs in found.items() if fs}
    stage = next((s for s in STAGES if found[s]), None)
    if stage is None:
        recorded = sorted({s for o in outputs for s in (o.stages or {})}, key=STAGES.index)
        return StageReport(None, {}, "every stage within its bound on every rank",
                           [f"stages compared: {', '.join(recorded)}"])
    first_rank = min(f.rank for f in found[stage])
    on_rank = [f for f in found[stage] if f.rank == first_rank]
    headline, first = _headline(stage, first_rank, on_rank)
    lines = [_detail(first)]
    lines.append(f"rows out of bound at stage {stage}: "
                 + ", ".join(f"rank {r} {n}" for r, n in sorted(wrong[stage].items())))
    earlier = [s + _near(near.get(s)) for s in STAGES[:STAGES.index(stage)] if any(s in (o.stages or {}) for o in outputs)]
    if earlier:
        lines.append(f"within bounds before it: {', '.join(earlier)}")
    later = [f"{s} ({sum(wrong[s].values())} rows)" for s in STAGES[STAGES.index(stage) + 1:] if s in wrong]
    if later:
        lines.append(f"out of bound after it (following from it or not): {', '.join(later)}")
    return StageReport(first, wrong, headline, lines)


_KIND_WORDS = {
    "scales": "arrive with another token's scales",
    "missing": "never arrive",
    "expert": "arrive for an expert their token did not choose",
    "twice": "arrive twice",
    "data": "arrive with data that is no token's payload",
}


def _headline(stage: str, rank: int, on_rank: list[Finding]) -> tuple[str, Finding]:
    n = len(on_rank)
    if stage == "dispatch":
        groups = collections.Counter((f.kind, f.source_rank) for f in on_rank)
        (kind, source), count = groups.most_common(1)[0]
        group = [f for f in on_rank if (f.kind, f.source_rank) == (kind, source)]
        experts = sorted({f.expert for f in group if f.expert is not None})
        origin = f" from rank {source}" if source is not None else ""
        which = f" for expert{'s' if len(experts) != 1 else ''} {', '.join(map(str, experts))}" if experts else ""
        more = f"; {n} rows of this stage wrong on rank {rank} in all" if n > count else ""
        return (f"stage dispatch, rank {rank}: rows{which}{origin} {_KIND_WORDS[kind]} "
                f"({count} row{'s' if count != 1 else ''}){more}", group[0])
    first = on_rank[0]
    if stage == "experts":
        per_expert = collections.Counter(f.expert for f in on_rank)
        expert, count = per_expert.most_common(1)[0]
        first = next(f for f in on_rank if f.expert == expert)
        return (f"stage experts, rank {rank}: expert {expert} is off on {count} of its rows "
                f"({n} row{'s' if n != 1 else ''} of this stage wrong on rank {rank})", first)
    if stage == "routing":
        return (f"stage routing, rank {rank}: {n} token{'s' if n != 1 else ''} routed unlike the reference "
                f"(first: token {first.global_token}, {first.got} against {first.expected})", first)
    what = {"combine": "the weighted sums over top-k", "tp_reduce": "the sums after the TP all-reduce",
            "shared": "the shared experts' output", "output": "the rows it returns"}.get(stage, "its values")
    return f"stage {stage}, rank {rank}: {what} leave the bound on {n} row{'s' if n != 1 else ''}", first


def _near(f: Finding | None) -> str:
    """`` (worst 0.93 x its bound: expert 1 on rank 1)`` for a stage that came close."""
    if f is None or f.err_to_bound is None or f.err_to_bound < 0.5:
        return ""
    where = f"expert {f.expert} on rank {f.rank}" if f.expert is not None else f"rank {f.rank}"
    return f" (worst {f.err_to_bound:.2f} x its bound: {where})"


def _detail(f: Finding) -> str:
    where = []
    if f.token is not None:
        where.append(f"token {f.global_token} (row {f.token} of DP rank {f.dp_rank})")
    if f.expert is not None:
        where.append(f"expert {f.expert}")
    if f.slot is not None:
        where.append(f"top-k slot {f.slot}")
    if f.source_rank is not None:
        where.append(f"routed by rank {f.source_rank}")
    ratio = f" (error {f.err_to_bound:.3g} x its bound)" if f.err_to_bound is not None else ""
    return f"first: {', '.join(where) or f.kind}: expected {f.expected}, got {f.got}{ratio}"

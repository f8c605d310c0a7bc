"""A synthetic skewed routing trace, and what balancing does to it (``moeshard eplb``).

Legend: P EP ranks (one DP rank each: the EP layout dp=P, tp=1), T tokens per rank and step,
K top-k, E logical experts, H hidden size.

    trace: ``steps`` steps of T tokens on each of the P ranks; every token picks K distinct
        experts from a Zipf law (expert of popularity rank j: weight (1 + j)^-zipf, popularity
        order random), int64 [steps, P, T, K]
    observe: the first half of the steps (the load window): tokens per logical expert
    balance: each policy, for each number of redundant slots per rank, on the observed loads
    evaluate on the second half, each placement through the layer's own replica choice
        (``choose_replicas``): routed copies each rank receives (its load); balancedness =
        mean / max rank load per step; dispatch bytes each rank receives from the others
        (the ``all2all`` backend's slot per routed copy: a bf16 row of H plus its expert id,
        16-byte aligned; combine sends the same count of H-wide rows back)

Before balancing is the layout without redundancy (rank p holds experts [p E/P, (p+1) E/P)).
Everything here is pure torch on the CPU: it runs anywhere, no GPU and no ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moeshard.eplb.moves import plan_moves
from moeshard.eplb.placement import Layout, Placement, choose_replicas
from moeshard.eplb.policies import POLICIES, balancedness, get_policy, rank_loads
from moeshard.validate import nonneg_int, positive_int


@dataclass(frozen=True)
class TraceOptions:
    """The trace and what to balance it with (defaults: DeepSeek-V3's routed experts on EP8)."""

    num_experts: int = 256
    top_k: int = 8
    ranks: int = 8
    tokens_per_rank: int = 4096
    steps: int = 8
    zipf: float = 0.8
    hidden_size: int = 7168
    intermediate_size: int = 2048
    redundant_per_rank: tuple[int, ...] = (0, 1, 2, 4)
    policies: tuple[str, ...] = ("greedy", "hierarchical")
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "ranks", "tokens_per_rank", "hidden_size", "intermediate_size"):
            positive_int("TraceOptions", name, getattr(self, name))
        if not isinstance(self.steps, int) or self.steps < 2:
            raise ValueError(f"TraceOptions.steps: must be an integer >= 2 (half observed, half evaluated), "
                             f"got {self.steps!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"TraceOptions.top_k: {self.top_k} is larger than num_experts={self.num_experts}")
        if not isinstance(self.zipf, (int, float)) or not 0 <= self.zipf <= 10:
            raise ValueError(f"TraceOptions.zipf: must be a number in [0, 10], got {self.zipf!r}")
        for r in self.redundant_per_rank:
            nonneg_int("TraceOptions", "redundant_per_rank", r)
            Layout(self.num_experts, self.ranks, r)
        for p in self.policies:
            get_policy(p)

    @property
    def memory_bytes(self) -> int:
        """Bytes the trace holds at its peak (an estimate from the shapes): the sampler's
        probabilities per routed token (fp32 [n, E]) and the expert ids (int64 [n, K]) with
        their replica choices, for ``n`` tokens over every step and rank."""
        n = self.steps * self.ranks * self.tokens_per_rank
        return n * (4 * self.num_experts + 3 * 8 * self.top_k)

    @property
    def dispatch_row_bytes(self) -> int:
        """Bytes of one routed copy in the all2all backend's slot: bf16 row, int32 id, aligned."""
        data = -(-2 * self.hidden_size // 16) * 16
        return -(-(data + 4) // 16) * 16

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's bf16 weights (gate, up, down): what moving one slot costs."""
        return 3 * self.hidden_size * self.intermediate_size * 2


def popularity(opts: TraceOptions) -> torch.Tensor:
    """fp64 [E]: the probability weights of the experts (a Zipf law over a random order)."""
    g = torch.Generator().manual_seed(opts.seed)
    order = torch.randperm(opts.num_experts, generator=g)
    weights = torch.empty(opts.num_experts, dtype=torch.float64)
    weights[order] = (1.0 + torch.arange(opts.num_experts, dtype=torch.float64)) ** -opts.zipf
    return weights / weights.sum()


def synthetic_trace(opts: TraceOptions) -> torch.Tensor:
    """int64 [steps, P, T, K]: logical experts of every routed copy (K distinct per token)."""
    g = torch.Generator().manual_seed(opts.seed + 1)
    probs = popularity(opts).float()
    n = opts.steps * opts.ranks * opts.tokens_per_rank
    ids = torch.multinomial(probs.expand(n, -1), opts.top_k, replacement=False, generator=g)
    return ids.view(opts.steps, opts.ranks, opts.tokens_per_rank, opts.top_k)


def traffic(placement: Placement, ids: torch.Tensor) -> torch.Tensor:
    """int64 [steps, P, P]: routed copies rank d sends rank j in each step (``[s, d, j]``), with
    the layer's replica choice (token row t of rank d's batch, DP rank d)."""
    table, count = placement.tables()
    S, P = placement.slots_per_rank, placement.num_ranks
    steps = ids.shape[0]
    out = torch.zeros(steps, P, P, dtype=torch.int64)
    for s in range(steps):
        for d in range(P):
            dest = torch.div(choose_replicas(ids[s, d], table, count, 0, d), S, rounding_mode="floor")
            out[s, d] = torch.bincount(dest.flatten(), minlength=P)
    return out


def evaluate(placement: Placement, ids: torch.Tensor, opts: TraceOptions) -> dict:
    """Figures of ``placement`` on the steps ``ids`` [steps, P, T, K] (means over the steps)."""
    copies = traffic(placement, ids).double()
    load = copies.sum(dim=1)  # [steps, P] routed copies each rank computes
    remote = copies * (1 - torch.eye(placement.num_ranks, dtype=torch.float64))
    recv = remote.sum(dim=1) * opts.dispatch_row_bytes  # [steps, P] dispatch bytes received
    return {
        "balancedness": float((load.mean(dim=1) / load.amax(dim=1).clamp_min(1)).mean()),
        "max_rank_copies": float(load.amax(dim=1).mean()),
        "mean_rank_copies": float(load.mean()),
        "dispatch_recv_bytes_max": float(recv.amax(dim=1).mean()),
        "dispatch_recv_bytes_mean": float(recv.mean()),
        "combine_send_bytes_max": float((remote.sum(dim=1) * 2 * opts.hidden_size).amax(dim=1).mean()),
    }


def run_trace(opts: TraceOptions) -> dict:
    """The whole measurement: the trace, the observed loads, and one row per (policy, redundant
    slots per rank) with the figures of ``evaluate`` before and after balancing."""
    ids = synthetic_trace(opts)
    half = opts.steps // 2
    observed = torch.bincount(ids[:half].flatten(), minlength=opts.num_experts)
    held_out = ids[half:]
    E, P = opts.num_experts, opts.ranks
    base = Placement.identity(E, P)
    before = evaluate(base, held_out, opts)
    rows = []
    for policy in opts.policies:
        for r in opts.redundant_per_rank:
            layout = Layout(E, P, r)
            start = base if r == 0 else Placement.initial(layout)
            placement = get_policy(policy)(observed, layout).aligned_to(start)
            moves = plan_moves(start, placement)
            S = layout.slots_per_rank
            moved = [sum(1 for m in moves if m.dst // S == p and m.src // S != p) for p in range(P)]
            rows.append({"policy": policy, "redundant_per_rank": r, "slots": layout.num_slots,
                         "replicated_experts": sum(1 for e in range(E) if len(placement.replicas(e)) > 1),
                         "model_balancedness": balancedness(rank_loads(placement, observed)),
                         "moved_slots_max": max(moved), "moved_bytes_max": max(moved) * opts.expert_bytes,
                         **evaluate(placement, held_out, opts)})
    return {"options": asdict(opts), "observed_tokens": int(observed.sum()) // opts.top_k,
            "dispatch_row_bytes": opts.dispatch_row_bytes, "expert_bytes": opts.expert_bytes,
            "hottest_share": float(observed.max() / observed.sum() * opts.top_k),
            "before": before, "rows": rows}


def format_report(result: dict) -> str:
    """The result of ``run_trace`` as a text table."""
    o, b = result["options"], result["before"]
    mb = 1e6
    lines = [(f"synthetic trace: E={o['num_experts']} top-{o['top_k']} on EP{o['ranks']}, {o['tokens_per_rank']} "
              f"tokens per rank and step, Zipf {o['zipf']}, {o['steps']} steps (loads observed on the first "
              f"{o['steps'] // 2}, figures on the last {o['steps'] - o['steps'] // 2}); hottest expert in "
              f"{100 * result['hottest_share']:.1f}% of tokens"),
             (f"dispatch row {result['dispatch_row_bytes']} B (bf16 H={o['hidden_size']} + id), expert "
              f"{result['expert_bytes'] / mb:.1f} MB bf16"),
             "",
             (f"{'policy':<13}{'R/rank':>7}{'balancedness':>14}{'max rank copies':>17}{'a2a recv MB/rank max':>22}"
              f"{'mean':>8}{'replicated':>12}{'moved slots':>13}"),
             (f"{'none':<13}{0:>7}{b['balancedness']:>14.3f}{b['max_rank_copies']:>17.0f}"
              f"{b['dispatch_recv_bytes_max'] / mb:>22.1f}{b['dispatch_recv_bytes_mean'] / mb:>8.1f}{0:>12}{0:>13}")]
    for r in result["rows"]:
        lines.append(f"{r['policy']:<13}{r['redundant_per_rank']:>7}{r['balancedness']:>14.3f}"
                     f"{r['max_rank_copies']:>17.0f}{r['dispatch_recv_bytes_max'] / mb:>22.1f}"
                     f"{r['dispatch_recv_bytes_mean'] / mb:>8.1f}{r['replicated_experts']:>12}{r['moved_slots_max']:>13}")
    lines.append("")
    lines.append("balancedness: mean / max routed copies per rank and step (1 = even); a2a recv: all2all dispatch bytes "
                 "a rank receives from the others per step (combine sends the same rows back); moved slots: the most "
                 "expert weights one rank receives to go from the layout without balancing (R/rank 0) or "
                 "Placement.initial to the policy's placement.")
    return "\n".join(lines)


__all__ = ["POLICIES", "TraceOptions", "evaluate", "format_report", "popularity", "run_trace", "synthetic_trace",
           "traffic"]

"""Balancing policies: pure functions ``(loads, layout) -> Placement``.

loads: E non-negative numbers, the tokens (routed copies) each logical expert received over a
window (``MoELayer.expert_loads``), a list or a tensor (read to the host here); layout: a
``Layout``. No randomness, no state: equal inputs give equal placements on every rank.

The load model: a logical expert's load splits evenly over its active replicas (the replica
choice goes round robin, ``moeshard.eplb.placement``), and a rank's load is the sum over its
active slots. ``rank_loads`` computes it, ``balancedness`` = mean / max rank load (1 is perfect).

* ``greedy``: keeps every expert in its slot of the layout without redundancy (rank p holds
  experts [p E/P, (p+1) E/P)) and fills the R redundant slots one at a time with the replica that
  lowers (max rank load, sum of squared rank loads) the most, on the least loaded rank that can
  take it. A slot no replica would improve becomes a standby replica of the hottest expert that
  rank lacks. A rebalance between two greedy placements moves at most the R redundant slots.
* ``hierarchical``: two stages. Replicate: give the R extra replicas one by one to the expert with
  the largest load per replica (at most P replicas each). Pack: place the replicas, heaviest
  first, on the least loaded rank with a free slot that does not hold that expert yet (when every
  rank with a free slot holds it, one earlier replica is swapped out to make room, the swap that
  keeps the maximum lowest). Every slot is active. It may move every slot.

Both guarantee the property the tests check: the maximum rank load is no worse than the layout
without redundancy on the same loads (``hierarchical`` returns ``greedy``'s placement when its
packing is worse; with even splitting over replicas, redundancy alone cannot always match a
balanced layout, e.g. loads [4, 1, 3, 2] on two ranks with one extra slot each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moeshard.eplb.placement import Layout, Placement

# Relative slack of float comparisons between equal-looking loads (sums in different orders).
_EPS = 1e-12


def _loads(loads: Sequence[float] | torch.Tensor, num_experts: int, where: str) -> list[float]:
    values = loads.detach().double().cpu().flatten().tolist() if isinstance(loads, torch.Tensor) else list(loads)
    if len(values) != num_experts:
        raise ValueError(f"{where}: loads has {len(values)} entries, the layout has num_experts={num_experts}")
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: loads[{i}] = {v!r} is not a number") from None
        if not f >= 0 or f == float("inf"):
            raise ValueError(f"{where}: loads[{i}] = {v!r} must be a finite number >= 0")
        out.append(f)
    return out


def rank_loads(placement: Placement, loads: Sequence[float] | torch.Tensor) -> list[float]:
    """The P rank loads of ``placement``: each expert's load split evenly over its active slots."""
    L = _loads(loads, placement.num_experts, "rank_loads")
    active = placement.active
    assert active is not None  # Placement.__post_init__ replaces None with all True
    n = [0] * placement.num_experts
    for e, a in zip(placement.slots, active, strict=True):
        n[e] += a
    S = placement.slots_per_rank
    out = [0.0] * placement.num_ranks
    for s, (e, a) in enumerate(zip(placement.slots, active, strict=True)):
        if a:
            out[s // S] += L[e] / n[e]
    return out


def balancedness(rank_load: Sequence[float]) -> float:
    """mean / max of the rank loads: 1.0 when even (or all zero), 1 / P when one rank has all."""
    top = max(rank_load)
    return 1.0 if top <= 0 else sum(rank_load) / len(rank_load) / top


def _score(rank_load: list[float]) -> tuple[float, float]:
    return max(rank_load), sum(v * v for v in rank_load)


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """a strictly better than b: a lower maximum, or the same maximum and a lower sum of squares."""
    if a[0] < b[0] * (1 - _EPS):
        return True
    return a[0] <= b[0] * (1 + _EPS) and a[1] < b[1] * (1 - _EPS)


def greedy(loads: Sequence[float] | torch.Tensor, layout: Layout) -> Placement:
    """The layout without redundancy plus the R redundant slots filled greedily (module docstring)."""
    E, P, s, r = layout.num_experts, layout.num_ranks, layout.experts_per_rank, layout.redundant_per_rank
    L = _loads(loads, E, "greedy")
    holders: list[list[int]] = [[e // s] for e in range(E)]  # ranks with an active replica
    present: list[set[int]] = [set(range(p * s, (p + 1) * s)) for p in range(P)]
    load = [sum(L[p * s:(p + 1) * s]) for p in range(P)]
    extra: list[list[tuple[int, bool]]] = [[] for _ in range(P)]
    for _ in range(layout.redundant):
        current = _score(load)
        best: tuple[tuple[float, float], int, int] | None = None
        for e in range(E):
            free = [p for p in range(P) if len(extra[p]) < r and e not in present[p]]
            if not free:
                continue
            p = min(free, key=lambda q: (load[q], q))
            n = len(holders[e])
            trial = list(load)
            for h in holders[e]:
                trial[h] -= L[e] / n - L[e] / (n + 1)
            trial[p] += L[e] / (n + 1)
            score = _score(trial)
            if _better(score, current) and (best is None or _better(score, best[0])):
                best = (score, e, p)
        if best is None:
            break
        _, e, p = best
        n = len(holders[e])
        for h in holders[e]:
            load[h] -= L[e] / n - L[e] / (n + 1)
        load[p] += L[e] / (n + 1)
        holders[e].append(p)
        present[p].add(e)
        extra[p].append((e, True))
    # Slots that no replica improves: standby replicas of the hottest experts the rank lacks.
    for p in range(P):
        while len(extra[p]) < r:
            e = min((q for q in range(E) if q not in present[p]), key=lambda q: (-L[q] / len(holders[q]), q))
            present[p].add(e)
            extra[p].append((e, False))
    slots: list[int] = []
    active: list[bool] = []
    for p in range(P):
        slots += list(range(p * s, (p + 1) * s)) + [e for e, _ in extra[p]]
        active += [True] * s + [a for _, a in extra[p]]
    return Placement(E, P, tuple(slots), tuple(active))


def _replica_counts(L: list[float], layout: Layout) -> list[int]:
    n = [1] * layout.num_experts
    for _ in range(layout.redundant):
        e = min((q for q in range(layout.num_experts) if n[q] < layout.num_ranks), key=lambda q: (-L[q] / n[q], q))
        n[e] += 1
    return n


def _pack(L: list[float], n: list[int], layout: Layout) -> list[list[int]]:
    """Replicas onto ranks, heaviest first, each to the least loaded rank that can take it."""
    P, S = layout.num_ranks, layout.slots_per_rank
    items = sorted(((L[e] / n[e], e) for e in range(len(n)) for _ in range(n[e])), key=lambda it: (-it[0], it[1]))
    ranks: list[list[int]] = [[] for _ in range(P)]
    load = [0.0] * P

    def w(e: int) -> float:
        return L[e] / n[e]

    for weight, e in items:
        free = [p for p in range(P) if len(ranks[p]) < S and e not in ranks[p]]
        if free:
            p = min(free, key=lambda q: (load[q], len(ranks[q]), q))
            ranks[p].append(e)
            load[p] += weight
            continue
        # Every rank with a free slot holds e already (there is one: slots remain). A full rank
        # q without e has an expert f that such a rank p lacks (q holds S experts, p fewer):
        # f moves from q to p and e takes its slot on q. Pick the swap with the lowest maximum.
        best = None
        for p in (p for p in range(P) if len(ranks[p]) < S):
            for q in (q for q in range(P) if e not in ranks[q]):
                for f in ranks[q]:
                    if f in ranks[p]:
                        continue
                    trial = list(load)
                    trial[p] += w(f)
                    trial[q] += weight - w(f)
                    key = (max(trial), p, q, f)
                    if best is None or key < best[0]:
                        best = (key, p, q, f)
        if best is None:  # unreachable (see the comment above); never a silent wrong placement
            raise RuntimeError(f"hierarchical: no rank can take a replica of expert {e} ({ranks})")
        _, p, q, f = best
        ranks[q][ranks[q].index(f)] = e
        ranks[p].append(f)
        load[p] += w(f)
        load[q] += weight - w(f)
    return ranks


def hierarchical(loads: Sequence[float] | torch.Tensor, layout: Layout) -> Placement:
    """Replicate hot experts, then pack the replicas onto ranks (module docstring)."""
    E, P = layout.num_experts, layout.num_ranks
    L = _loads(loads, E, "hierarchical")
    ranks = _pack(L, _replica_counts(L, layout), layout)
    packed = Placement(E, P, tuple(e for rank in ranks for e in sorted(rank)))
    baseline = max(rank_loads(Placement.identity(E, P), L))
    if max(rank_loads(packed, L)) > baseline * (1 + _EPS):
        return greedy(L, layout)
    return packed


POLICIES: dict[str, Callable[[Sequence[float] | torch.Tensor, Layout], Placement]] = {
    "greedy": greedy, "hierarchical": hierarchical}


def get_policy(name: str) -> Callable[[Sequence[float] | torch.Tensor, Layout], Placement]:
    if name not in POLICIES:
        raise ValueError(f"policy: {name!r} is not one of {sorted(POLICIES)}")
    return POLICIES[name]

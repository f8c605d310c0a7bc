"""Logical experts on physical slots: the layout, the placement and the replica choice.

Legend: E logical experts (the checkpoint's), P EP ranks, S slots per rank, N = P * S physical
slots, R = N - E redundant slots, T tokens, K top-k.

    physical slot s lives on EP rank s // S, at local index s % S, and holds the weights of
    logical expert ``placement.slots[s]``. A logical expert has one or more slots (replicas), at
    most one per rank. A slot is *active* (takes tokens) or *standby* (holds its expert's weights
    but takes no tokens; a later rebalance may activate it without moving any weight).

The experts kernels, the dispatch backends, sharding and checkpoint loading all work on slots:
the layer maps the router's logical ids to slot ids right after routing (``choose_replicas``)
and builds its backend for N "experts" (``backend_config``); a rank's kernel sees its S local
slot ids. The reference knows nothing of slots: a replica computes exactly its logical expert.

Replica choice, for the (token, k) pair of a token at row ``row`` of its DP rank's batch routed
to logical expert e, whose n_e active replicas are the slots r_0 < r_1 < ... (rank order)::

    slot = r_j,   j = (row + k + e + dp_rank) mod n_e

A pure function of the token's position in its DP rank's batch, its DP rank, k and e: every rank
that routes or sees that token (the TP ranks of its DP rank under SP, every EP rank after an
all-gather) picks the same replica; consecutive tokens (and decode batches of one token on
different DP ranks) go round robin over the replicas. Computed on the device by two gathers,
with no host synchronisation; its tables have a fixed shape [E, P], so a rebalance rewrites
them in place.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from moeshard.config import MoEConfig
from moeshard.validate import is_int, nonneg_int, positive_int


@dataclass(frozen=True)
class Layout:
    """The shape of a placement: E logical experts on P EP ranks, ``redundant_per_rank`` extra
    slots per rank (R = P * redundant_per_rank); S = E / P + redundant_per_rank slots per rank.

    E must divide by P (as without EP load balancing), and S <= E: a rank never holds two
    replicas of one expert.
    """

    num_experts: int
    num_ranks: int
    redundant_per_rank: int = 0

    def __post_init__(self) -> None:
        positive_int("Layout", "num_experts", self.num_experts)
        positive_int("Layout", "num_ranks", self.num_ranks)
        nonneg_int("Layout", "redundant_per_rank", self.redundant_per_rank)
        E, P = self.num_experts, self.num_ranks
        if E % P:
            raise ValueError(f"Layout.num_ranks: num_experts={E} is not divisible by num_ranks={P}")
        if self.slots_per_rank > E:
            raise ValueError(f"Layout.redundant_per_rank: {self.redundant_per_rank} gives {self.slots_per_rank} slots "
                             f"per rank, more than num_experts={E}: a rank would hold two replicas of one expert "
                             f"(at most {E - E // P} redundant slots per rank)")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def slots_per_rank(self) -> int:
        return self.num_experts // self.num_ranks + self.redundant_per_rank

    @property
    def num_slots(self) -> int:
        return self.num_ranks * self.slots_per_rank

    @property
    def redundant(self) -> int:
        """R, the redundant slots over all ranks."""
        return self.num_ranks * self.redundant_per_rank


@dataclass(frozen=True)
class Placement:
    """Which logical expert each physical slot holds, and whether it takes tokens.

    num_experts: E; num_ranks: P (the EP size); slots: N = P * S logical ids, slot s on rank
    s // S; active: N bools (None: every slot active), False for a standby slot.

    Validated on construction (``ValueError`` naming the field, the values, the rank): ids in
    [0, E), N a multiple of P with S <= E, no expert twice on one rank, every expert with at
    least one active slot. Two placements are equal when their fields are.
    """

    num_experts: int
    num_ranks: int
    slots: tuple[int, ...]
    active: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        positive_int("Placement", "num_experts", self.num_experts)
        positive_int("Placement", "num_ranks", self.num_ranks)
        slots = tuple(self.slots)
        if not all(is_int(e) for e in slots):
            raise ValueError(f"Placement.slots: must hold ints, got {list(slots)!r}")
        object.__setattr__(self, "slots", tuple(int(e) for e in slots))
        active = (True,) * len(slots) if self.active is None else tuple(self.active)
        if len(active) != len(slots) or not all(isinstance(a, bool) for a in active):
            raise ValueError(f"Placement.active: must be {len(slots)} bools (one per slot), got {list(active)!r}")
        object.__setattr__(self, "active", active)
        E, P, N = self.num_experts, self.num_ranks, len(slots)
        if E % P:
            raise ValueError(f"Placement.num_ranks: num_experts={E} is not divisible by num_ranks={P}")
        if N == 0 or N % P or N // P < E // P:
            raise ValueError(f"Placement.slots: {N} slots do not spread evenly over {P} ranks with at least "
                             f"E / P = {E // P} each")
        bad = [e for e in slots if not 0 <= e < E]
        if bad:
            raise ValueError(f"Placement.slots: expert ids {sorted(set(bad))} are outside [0, {E})")
        S = N // P
        for rank in range(P):
            mine = slots[rank * S:(rank + 1) * S]
            twice = sorted({e for e in mine if mine.count(e) > 1})
            if twice:
                raise ValueError(f"Placement.slots: rank {rank} holds experts {twice} twice (slots "
                                 f"[{rank * S}, {(rank + 1) * S}) = {list(mine)}); replicas of one expert must be "
                                 f"on different ranks")
        served = {e for e, a in zip(slots, active, strict=True) if a}
        missing = sorted(set(range(E)) - served)
        if missing:
            raise ValueError(f"Placement.slots: experts {missing} have no active slot (slots {list(slots)}, "
                             f"active {list(active)})")

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def identity(cls, num_experts: int, num_ranks: int) -> Placement:
        """No redundancy: rank p holds experts [p E/P, (p+1) E/P), as without load balancing."""
        Layout(num_experts, num_ranks)
        return cls(num_experts, num_ranks, tuple(range(num_experts)))

    @classmethod
    def initial(cls, layout: Layout) -> Placement:
        """A placement before any load is known: rank p holds its block of E / P experts, then
        replicas of the next ``redundant_per_rank`` experts after its block (cyclically), all
        active. Under uniform loads every rank carries the same load."""
        E, P, s, r = layout.num_experts, layout.num_ranks, layout.experts_per_rank, layout.redundant_per_rank
        slots: list[int] = []
        for p in range(P):
            slots += list(range(p * s, (p + 1) * s)) + [((p + 1) * s + j) % E for j in range(r)]
        return cls(E, P, tuple(slots))

    # -- shape ------------------------------------------------------------------------------
    @property
    def _active(self) -> tuple[bool, ...]:
        """``active`` as ``__post_init__`` leaves it: never None (None became all True)."""
        assert self.active is not None  # replaced by a tuple in __post_init__
        return self.active

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots) // self.num_ranks

    @property
    def layout(self) -> Layout:
        return Layout(self.num_experts, self.num_ranks, self.slots_per_rank - self.num_experts // self.num_ranks)

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The logical experts of rank ``rank``'s S slots, in local slot order."""
        S = self.slots_per_rank
        return self.slots[rank * S:(rank + 1) * S]

    def replicas(self, expert: int, active_only: bool = True) -> tuple[int, ...]:
        """The slots holding ``expert`` (the active ones by default), in slot (= rank) order."""
        return tuple(s for s, (e, a) in enumerate(zip(self.slots, self._active, strict=True))
                     if e == expert and (a or not active_only))

    @property
    def is_identity(self) -> bool:
        """No slot differs from the layout without load balancing: routing needs no mapping."""
        return self.slots == tuple(range(self.num_experts)) and all(self._active)

    @property
    def has_replicas(self) -> bool:
        """Some expert has two or more active slots (its rows are split over ranks)."""
        active = [e for e, a in zip(self.slots, self._active, strict=True) if a]
        return len(active) != len(set(active))

    def fingerprint(self) -> int:
        """A stable integer of the whole placement, for the configuration exchange between ranks."""
        text = f"{self.num_experts}/{self.num_ranks}/{','.join(map(str, self.slots))}/" + \
               "".join("1" if a else "0" for a in self._active)
        return zlib.crc32(text.encode())

    def aligned_to(self, current: Placement) -> Placement:
        """An equivalent placement that moves fewer weights from ``current`` (same shape): the
        ranks' sets of slots are permuted so that each lands on the rank of ``current`` it shares
        the most experts with (greedily, largest overlap first), then each rank's slots are
        reordered so that experts ``current`` has there keep their slot. Rank loads under the
        load model do not change (a rank's load is a function of its set of slots)."""
        if (current.num_experts, current.num_ranks, current.num_slots) != (self.num_experts, self.num_ranks, self.num_slots):
            raise ValueError(f"Placement.aligned_to: shapes differ: (E, P, N) = ({self.num_experts}, {self.num_ranks}, "
                             f"{self.num_slots}) vs ({current.num_experts}, {current.num_ranks}, {current.num_slots})")
        S, P = self.slots_per_rank, self.num_ranks
        sets = [set(self.rank_slots(q)) for q in range(P)]
        pairs = sorted((-len(sets[q] & set(current.rank_slots(p))), p, q) for p in range(P) for q in range(P))
        source: dict[int, int] = {}  # rank of the result -> rank of self
        for _, p, q in pairs:
            if p not in source and q not in source.values():
                source[p] = q
        slots: list[int] = []
        active: list[bool] = []
        for p in range(P):
            q = source[p]
            mine = dict(zip(self.rank_slots(q), self._active[q * S:(q + 1) * S], strict=True))
            old = current.rank_slots(p)
            keep = [e if e in mine else None for e in old]
            rest = iter(sorted(e for e in mine if e not in old))
            row = [e if e is not None else next(rest) for e in keep]
            slots += row
            active += [mine[e] for e in row]
        return Placement(self.num_experts, self.num_ranks, tuple(slots), tuple(active))

    # -- what the layer uses ----------------------------------------------------------------
    def backend_config(self, cfg: MoEConfig) -> MoEConfig:
        """The configuration a dispatch backend is built with: N physical "experts" (slot ids
        are what it routes), spread evenly over the EP ranks. Routing already happened, so the
        routing-group fields are dropped (N need not divide by ``n_group``). ``cfg`` itself when
        N == E."""
        from dataclasses import replace

        if self.num_slots == cfg.num_experts:
            return cfg
        return replace(cfg, num_experts=self.num_slots, n_group=1, topk_group=1)

    def tables(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(table int64 [E, P], count int64 [E]): expert e's active slots in rank order in
        ``table[e, :count[e]]`` (the rest repeats the first), ``count[e] >= 1``."""
        E, P = self.num_experts, self.num_ranks
        table = torch.zeros(E, P, dtype=torch.int64)
        count = torch.zeros(E, dtype=torch.int64)
        for e in range(E):
            reps = self.replicas(e)
            table[e, :len(reps)] = torch.tensor(reps, dtype=torch.int64)
            table[e, len(reps):] = reps[0]
            count[e] = len(reps)
        return table.to(device), count.to(device)


def choose_replicas(topk_ids: torch.Tensor, table: torch.Tensor, count: torch.Tensor, first_row: int = 0,
                    dp_rank: int = 0) -> torch.Tensor:
    """Physical slot of every (token, k) pair (the rule in the module docstring).

    topk_ids: int64 [T, K] logical expert ids of T consecutive tokens of one DP rank's batch,
    the first at row ``first_row`` (under SP: the start of this TP rank's chunk); table, count:
    ``Placement.tables`` on topk_ids' device; dp_rank: the tokens' DP rank. Returns int64
    [T, K] slot ids. No host synchronisation.
    """
    T, K = topk_ids.shape
    device = topk_ids.device
    rows = torch.arange(first_row, first_row + T, device=device, dtype=torch.int64).unsqueeze(1)
    key = rows + torch.arange(K, device=device, dtype=torch.int64).unsqueeze(0) + topk_ids + dp_rank
    j = torch.remainder(key, count[topk_ids])
    return table[topk_ids, j]

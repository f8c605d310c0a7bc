"""How one MoE layer is spread over ranks: data (DP), tensor (TP) and expert (EP) parallelism.

Global rank layout (the same everywhere in moeshard)::

    r = dp_rank * tp + tp_rank            0 <= dp_rank < dp, 0 <= tp_rank < tp

so the TP ranks of one DP rank are neighbours (``[d*tp, d*tp + tp)``), which keeps the chatty
TP collectives on the closest devices.  With ``enable_ep`` every rank is one expert-parallel
rank (``ep_size = dp * tp``, ``ep_rank = r``), and with ``tp > 1`` the layer becomes sequence
parallel: each TP rank routes only its 1/tp chunk of the (replicated) tokens, otherwise every
routed copy would be dispatched tp times.

Experts are placed in contiguous blocks: EP rank ``e`` owns ``[e * E/ep_size, (e+1) * E/ep_size)``.
An expert count that does not divide by ``ep_size`` is refused rather than placed unevenly:
uneven placement changes every rank's weight shapes and the dispatch tables, and no model we
target needs it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeshard.config import MoEConfig
from moeshard.validate import boolean, is_int, size

# The two spellings of a layout that ParallelConfig.parse reads; ParallelConfig.name writes the first.
_NAMED = re.compile(r"dp([0-9]+)-tp([0-9]+)-(ep|noep)")
_TRIPLE = re.compile(r"([0-9]+)\s*,\s*([0-9]+)\s*,\s*(on|off)")
LAYOUT_FORMS = "dp<D>-tp<T>-ep, dp<D>-tp<T>-noep, <D>,<T>,on or <D>,<T>,off (e.g. dp2-tp2-ep, dp1-tp2-noep, 2,2,on)"


def _at(rank: int | None) -> str:
    """Message prefix naming the rank that refuses, when it is known."""
    return "ParallelConfig" if rank is None else f"ParallelConfig (rank {rank})"


@dataclass(frozen=True)
class ParallelConfig:
    """Layout of ranks: ``dp`` data-parallel replicas, each split ``tp`` ways; EP on or off.

    ``dp`` and ``tp`` are positive ints (at most ``validate.MAX_DIM``); ``enable_ep`` is a bool.
    Validated on construction (how many ranks a machine can start is ``LocalWorld``'s check);
    ``validate`` checks it against a world size and an ``MoEConfig``.
    """

    dp: int = 1
    tp: int = 1
    enable_ep: bool = False

    def __post_init__(self) -> None:
        size("ParallelConfig", "dp", self.dp)
        size("ParallelConfig", "tp", self.tp)
        boolean("ParallelConfig", "enable_ep", self.enable_ep)
        if self.enable_ep and self.dp * self.tp == 1:
            # EP spreads the experts over ranks; a single rank holds them all, and the layer there
            # runs without groups, where EP backends cannot run: refused rather than contradicted.
            raise ValueError("ParallelConfig.enable_ep: expert parallelism spreads the experts over ranks, but "
                             "dp=1, tp=1 is one rank, which holds every expert; turn EP off (dp1-tp1-noep) or "
                             "use more ranks")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def ep_size(self) -> int:
        """Ranks the experts are spread over: every rank with EP on, none (1) with it off."""
        return self.dp * self.tp if self.enable_ep else 1

    @property
    def is_sequence_parallel(self) -> bool:
        """EP with tp > 1: each TP rank routes its own chunk of the replicated tokens."""
        return self.enable_ep and self.tp > 1

    @property
    def name(self) -> str:
        """The layout's one spelling, e.g. ``"dp2-tp2-ep"`` (EP on) or ``"dp1-tp4-noep"`` (EP off):
        case ids, JSON, messages and ``parse`` all use it."""
        return f"dp{self.dp}-tp{self.tp}-" + ("ep" if self.enable_ep else "noep")

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """The layout ``text`` names: ``"dp2-tp2-ep"`` / ``"dp1-tp2-noep"`` (``name``'s spelling) or
        ``"2,2,on"`` / ``"1,2,off"`` (dp, tp, EP); case and surrounding spaces are ignored.

        Strict: anything else (``"dp2-tp1-bogus"``, ``"dp2-tp1"``) is a ValueError naming ``text``
        and the accepted forms; a well-formed text with bad values (``"dp0-tp1-ep"``) is a
        ValueError naming ``text`` and the field.
        """
        t = text.strip().lower() if isinstance(text, str) else ""
        match = _NAMED.fullmatch(t) or _TRIPLE.fullmatch(t)
        if match is None:
            raise ValueError(f"{text!r} is not a layout; write {LAYOUT_FORMS}")
        dp, tp, ep = match.groups()
        try:
            return cls(int(dp), int(tp), ep in ("ep", "on"))
        except ValueError as exc:
            raise ValueError(f"layout {text!r}: {exc}") from None

    def _check_rank(self, rank: int) -> None:
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"{self.name}: rank must be an integer in [0, {self.world_size}), got {rank!r}")

    def dp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.tp

    def ep_rank(self, rank: int) -> int:
        """``rank`` with EP on (the EP group is all ranks, in global order), 0 with EP off."""
        self._check_rank(rank)
        return rank if self.enable_ep else 0

    def validate_world_size(self, world_size: int, rank: int | None = None) -> None:
        """Refuses a world size other than ``dp * tp``; ``rank`` (if known) goes into the message."""
        if world_size != self.world_size:
            raise ValueError(f"{_at(rank)}: world size {world_size} does not match layout {self.name}: "
                             f"dp*tp = {self.dp}*{self.tp} = {self.world_size}")

    def validate(self, world_size: int, moe: MoEConfig | None = None, rank: int | None = None) -> None:
        """Checks the layout against the world size and, if given, the MoE block's shape.

        Raises ``ValueError`` naming the field, the values and ``rank`` when:
          * ``world_size != dp * tp``;
          * EP on and ``moe.num_experts % ep_size != 0`` (uneven expert placement is refused);
          * EP off, ``tp > 1`` and ``moe.intermediate_size % tp != 0`` (TP splits each expert's
            intermediate dimension into equal slices).
        Pure and local: every rank can call it before any collective.
        """
        self.validate_world_size(world_size, rank)
        if moe is None:
            return
        if self.enable_ep:
            if moe.num_experts % self.ep_size:
                raise ValueError(
                    f"{_at(rank)}: MoEConfig.num_experts={moe.num_experts} is not divisible by the EP size "
                    f"{self.ep_size} of layout {self.name}; uneven expert placement is not supported "
                    f"(choose dp*tp dividing {moe.num_experts})")
        elif self.tp > 1 and moe.intermediate_size % self.tp:
            raise ValueError(
                f"{_at(rank)}: MoEConfig.intermediate_size={moe.intermediate_size} is not divisible by "
                f"tp={self.tp} of layout {self.name}; tensor parallelism splits it into equal slices")

    def local_experts(self, rank: int, num_experts: int) -> range:
        """Global ids of the experts this rank holds: a contiguous block of ``E / ep_size``.

        With EP off every rank holds all experts (``range(num_experts)``).
        """
        self._check_rank(rank)
        if not is_int(num_experts) or num_experts <= 0:
            raise ValueError(f"{_at(rank)}: num_experts must be a positive integer, got {num_experts!r}")
        if num_experts % self.ep_size:
            raise ValueError(f"{_at(rank)}: num_experts={num_experts} is not divisible by the EP size "
                             f"{self.ep_size} of layout {self.name}; uneven expert placement is not supported")
        per_rank = num_experts // self.ep_size
        first = self.ep_rank(rank) * per_rank
        return range(first, first + per_rank)

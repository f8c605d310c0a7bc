"""The layer's cross-rank agreement: one small all-gather at construction (and at a rebalance)
that every rank must pass with the same values, so that ranks configured differently are refused
together, naming the field and every rank's value, instead of hanging in a later collective."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from moeshard.config import MODEL_DTYPES
from moeshard.dispatch.registry import BACKENDS
from moeshard.eplb.placement import Placement
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.trace import traced
from moeshard.quant import scheme_names


def code(name: str) -> int:
    """A stable integer for a name, for the configuration exchange (decoded by ``name_of``)."""
    return zlib.crc32(name.encode())


def name_of(value: int) -> str | int:
    """The scheme, backend or dtype name of an exchanged code (the code itself if none)."""
    return {code(n): n for n in (*scheme_names(), *BACKENDS, *MODEL_DTYPES)}.get(value, value)


def placement_code(placement: Placement | None) -> int:
    """The configuration exchange's value for a placement (0: none)."""
    return 0 if placement is None or placement.is_identity else placement.fingerprint()


def check_same_on_all_ranks(groups: ParallelGroups, fields: dict[str, int],
                            values: dict[str, object] | None = None) -> None:
    """One small all-gather at construction: every rank must agree on the layer's configuration.

    fields: name -> int (a size, or a ``code`` of a name or of a value's repr). values: name ->
    this rank's value, for fields whose ints are digests that say nothing to a reader: when the
    ranks disagree on such a field, a second exchange (of the values' reprs, on the failure path
    only) lets the refusal show every rank's value.

    Every rank sees the same gathered table, so every rank takes the failure path and raises
    together (nobody is left waiting in a later collective)."""
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=groups.device)
    table = [torch.empty_like(mine) for _ in range(groups.world_size)]
    with traced(groups.trace, "all_gather", "world", mine):
        dist.all_gather(table, mine)
    rows = torch.stack(table).cpu()
    columns = {name: rows[:, i].tolist() for i, name in enumerate(fields)}
    differ = [name for name, column in columns.items() if len(set(column)) > 1]
    if not differ:
        return
    name = differ[0]
    shown: list[object] = [name_of(v) for v in columns[name]]
    if values and name in values:
        # Every rank is here with the same ``name`` (the same table): the exchange is collective.
        reprs: list[object] = [None] * groups.world_size
        with traced(groups.trace, "all_gather_object", "world"):
            dist.all_gather_object(reprs, repr(values[name]))
        shown = [str(r) for r in reprs]
    raise ValueError(f"MoELayer (rank {groups.rank}): ranks disagree on {name}: "
                     + ", ".join(f"rank {r}={v}" for r, v in enumerate(shown)))

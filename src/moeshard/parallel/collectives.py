"""Uneven collectives: every rank contributes or receives its own number of rows.

Shapes (``G`` = ranks in the group, ``i`` = this rank's index in it, ``*rest`` = any trailing
shape, the same on every rank):

    all_gatherv      x [sizes[i], *rest]          -> [sum(sizes), *rest]        rows in group-rank order
    reduce_scatterv  x [sum(sizes), *rest]        -> [sizes[i], *rest]          block i summed over ranks
    all_to_allv      x [sum(send_sizes), *rest]   -> [sum(recv_sizes), *rest]   block j goes to rank j
    exchange_sizes   n (int)                      -> [n of rank 0, ..., n of rank G-1]
    exchange_counts  counts [G] int64             -> [G] int64: what each rank will send to me

Cross-rank preconditions (they cannot be checked without an extra exchange, so they are the
caller's): ``sizes`` is the same list on every rank; ``recv_sizes[j]`` on rank i equals
``send_sizes[i]`` on rank j; ``*rest`` and the dtype agree.  A violation is not detected here: it
ends in an error from the backend or in the process group's timeout, the bound on every wait in
this module.

Every op takes ``trace``: this rank's ``CollectiveTrace`` (``ParallelGroups.trace``), which records
entering and leaving it (op, group, sizes, dtype, call site; see ``moeshard.parallel.trace``).

Local preconditions are checked on every rank before any communication starts: a refusal is a
``CollectiveSizeError`` (sizes and row counts) or ``CollectiveInputError`` (tensor, device,
dtype, group) whose message names the op, the group, the global rank, what was expected and
what was given.

Payloads move as bytes: every op here only moves rows (the sum of ``reduce_scatterv`` is done
locally), so a tensor travels as a ``uint8 [rows, bytes per row]`` view and is viewed back as its
dtype on arrival.  That is what lets float8 (and any other 1-byte float) cross gloo, which has no
float8 type, and it gives one code path for every dtype on both gloo and NCCL.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moeshard.parallel.trace import CollectiveTrace, traced
from moeshard.validate import is_int

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11 may
# only have the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveInputError(ValueError):
    """An input refused before the collective started (tensor, device, dtype or group)."""


class CollectiveSizeError(CollectiveInputError):
    """Sizes or row counts that do not fit the op, refused before the collective started."""


@dataclass(frozen=True)
class _Call:
    """Who is calling what, for error messages: op, group name, global rank; and the group's shape."""

    op: str
    group_name: str
    rank: int
    group_rank: int
    group_size: int

    def error(self, message: str, kind: type[CollectiveInputError] = CollectiveSizeError) -> CollectiveInputError:
        return kind(f"{self.op} on group '{self.group_name}' (rank {self.rank}): {message}")


def _call(op: str, group: Any, group_name: str) -> _Call:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op} on group '{group_name}': the default process group is not initialised")
    rank = dist.get_rank()
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise CollectiveInputError(f"{op} on group '{group_name}' (rank {rank}): this rank is not a member "
                                   f"of the group it was given")
    return _Call(op, group_name, rank, dist.get_rank(group), dist.get_world_size(group))


def _check_sizes(call: _Call, name: str, sizes: Sequence[int]) -> list[int]:
    """``sizes`` as a list of ints >= 0 with one entry per group rank."""
    if not isinstance(sizes, (list, tuple)):
        raise call.error(f"{name} must be a list of ints, got {type(sizes).__name__}")
    values = []
    for entry in sizes:
        # operator.index accepts ints and numpy ints but not floats; tensors are refused because
        # turning a CUDA tensor into an int would hide a device sync in a size check.
        if isinstance(entry, (bool, Tensor)):
            raise call.error(f"{name} must hold ints, got {entry!r} in {list(sizes)!r}")
        try:
            values.append(operator.index(entry))
        except TypeError:
            raise call.error(f"{name} must hold ints, got {entry!r} in {list(sizes)!r}") from None
    if len(values) != call.group_size:
        raise call.error(f"{name} has {len(values)} entries {values} but the group has {call.group_size} ranks")
    negative = [v for v in values if v < 0]
    if negative:
        raise call.error(f"{name} must be >= 0, got {values}")
    return values


def _check_tensor(call: _Call, name: str, x: Any, group: Any) -> None:
    """``x`` is a tensor with a row dimension, on the device the group's backend talks to."""
    if not isinstance(x, Tensor):
        raise call.error(f"{name} must be a torch.Tensor, got {type(x).__name__}", CollectiveInputError)
    if x.dim() == 0:
        raise call.error(f"{name} is a 0-d tensor; expected [rows, ...]", CollectiveInputError)
    backend = str(dist.get_backend(group))
    wanted = {"nccl": "cuda", "gloo": "cpu"}.get(backend)
    if wanted is not None and x.device.type != wanted:
        raise call.error(f"{name} is on {x.device} but the group's backend {backend} needs {wanted} tensors",
                         CollectiveInputError)


def _ints(values: Any) -> tuple[int, ...]:
    """``values`` as ints for a trace record, or () when they are not a list of ints (the
    checks report that)."""
    try:
        return tuple(operator.index(v) for v in values) if isinstance(values, (list, tuple)) else ()
    except TypeError:
        return ()


def all_reduce(x: Tensor, group: Any, group_name: str, op: str = "sum", *,
               trace: CollectiveTrace | None = None) -> Tensor:
    """``torch.distributed.all_reduce`` of ``x`` in place (``op``: "sum" or "max"), recorded in
    ``trace``; returns ``x``."""
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    with traced(trace, f"all_reduce_{op}", group_name, x):
        dist.all_reduce(x, op=reduce_op, group=group)
    return x


def _as_rows(x: Tensor) -> Tensor:
    """``x [n, *rest]`` as contiguous ``uint8 [n, bytes per row]`` (a view when x is contiguous)."""
    n, row_bytes = x.shape[0], math.prod(x.shape[1:]) * x.element_size()
    if x.numel() == 0:
        return torch.empty((n, row_bytes), dtype=torch.uint8, device=x.device)
    # Flatten first: a "contiguous" tensor may still carry odd strides on size-1 dims, which
    # a dtype view refuses; the flat view of a contiguous tensor always has stride 1.
    return x.contiguous().reshape(-1).view(torch.uint8).view(n, row_bytes)


def _from_rows(rows: Tensor, like: Tensor) -> Tensor:
    """Inverse of ``_as_rows``: ``uint8 [m, bytes per row]`` -> ``[m, *like.shape[1:]]`` of like.dtype."""
    shape = (rows.shape[0], *like.shape[1:])
    if rows.numel() == 0:
        return torch.empty(shape, dtype=like.dtype, device=rows.device)
    return rows.contiguous().reshape(-1).view(like.dtype).view(shape)


def _all_to_all_rows(rows: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
    out = rows.new_empty((sum(recv), rows.shape[1]))
    if rows.shape[1] == 0:
        # Rows of zero bytes: nothing to move.  Every rank has the same row shape (a
        # precondition), so every rank skips together.
        return out
    dist.all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_gatherv(x: Tensor, sizes: list[int], group: Any, group_name: str, *,
                trace: CollectiveTrace | None = None) -> Tensor:
    """Concatenates every rank's rows in group-rank order.

    Args:
      x: ``[sizes[i], *rest]``, any dtype; this rank's rows (``i`` = index in ``group``).
      sizes: ``G`` ints >= 0, rows contributed by each group rank; the same list on every rank.
      group: the process group (``None`` = default group); group_name: its name for messages.
      trace: this rank's ``CollectiveTrace`` (``ParallelGroups.trace``), or None.
    Returns ``[sum(sizes), *rest]`` of ``x.dtype``: rows of group rank 0, then 1, ...
    """
    call = _call("all_gatherv", group, group_name)
    with traced(trace, call.op, group_name, x, _ints(sizes)):
        return _all_gatherv(call, x, sizes, group)


def _all_gatherv(call: _Call, x: Tensor, sizes: list[int], group: Any) -> Tensor:
    sizes = _check_sizes(call, "sizes", sizes)
    _check_tensor(call, "input", x, group)
    mine = sizes[call.group_rank]
    if x.shape[0] != mine:
        raise call.error(f"input has {x.shape[0]} rows but sizes[{call.group_rank}] (this rank's entry of "
                         f"{sizes}) is {mine}")
    rows = _as_rows(x)
    width, cap = rows.shape[1], max(sizes)
    if cap == 0 or width == 0:
        # sizes and the row shape agree on all ranks, so all ranks skip the collective together.
        return _from_rows(rows.new_empty((sum(sizes), width)), x)
    # Pad every rank's block to the largest one so a plain (equal-size) all-gather moves it;
    # zero padding so no stale memory crosses to other ranks.  The padding is dropped below.
    padded = rows.new_zeros((cap, width))
    padded[:mine] = rows
    gathered = rows.new_empty((call.group_size, cap, width))
    _all_gather_single(gathered.view(call.group_size * cap, width), padded, group=group)
    out = torch.cat([gathered[g, :n] for g, n in enumerate(sizes)])
    return _from_rows(out, x)


def reduce_scatterv(x: Tensor, sizes: list[int], group: Any, group_name: str, *,
                    trace: CollectiveTrace | None = None) -> Tensor:
    """Sums the ranks' inputs and leaves block ``i`` (``sizes[i]`` rows) on group rank ``i``.

    Args:
      x: ``[sum(sizes), *rest]``, a float or integer dtype (1-byte floats cannot be summed); rows
        ``[sum(sizes[:j]), sum(sizes[:j+1]))`` are this rank's contribution to group rank ``j``.
      sizes: ``G`` ints >= 0, rows each group rank keeps; the same list on every rank.
    Returns ``[sizes[i], *rest]`` of ``x.dtype``: ``sum over ranks g = 0, 1, ... of x_g[block i]``,
    added in that fixed order (fp16/bf16 accumulate in fp32, then round once).

    Why not ``dist.reduce_scatter``: it needs equal blocks, gloo builds may lack it, and its
    summation order depends on the backend and topology.  An uneven all-to-all followed by a
    local sum in rank order moves the same bytes per rank, works on gloo and NCCL alike, and
    gives bit-identical results on both for the same inputs (so tolerances can stay tight).
    """
    call = _call("reduce_scatterv", group, group_name)
    with traced(trace, call.op, group_name, x, _ints(sizes)):
        return _reduce_scatterv(call, x, sizes, group)


def _reduce_scatterv(call: _Call, x: Tensor, sizes: list[int], group: Any) -> Tensor:
    sizes = _check_sizes(call, "sizes", sizes)
    _check_tensor(call, "input", x, group)
    if x.shape[0] != sum(sizes):
        raise call.error(f"input has {x.shape[0]} rows but sizes {sizes} sum to {sum(sizes)}")
    if x.element_size() == 1 and x.dtype not in (torch.uint8, torch.int8, torch.bool):
        raise call.error(f"cannot sum dtype {x.dtype}; dequantize before reducing", CollectiveInputError)
    mine = sizes[call.group_rank]
    received = _from_rows(_all_to_all_rows(_as_rows(x), sizes, [mine] * call.group_size, group), x)
    blocks = received.view(call.group_size, mine, *x.shape[1:])
    acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    out = blocks[0].to(acc_dtype, copy=True)
    for g in range(1, call.group_size):
        out += blocks[g]
    return out.to(x.dtype)


def all_to_allv(x: Tensor, send_sizes: list[int], recv_sizes: list[int], group: Any, group_name: str, *,
                trace: CollectiveTrace | None = None) -> Tensor:
    """Sends block ``j`` of ``x`` to group rank ``j`` and concatenates what arrives, by sender.

    Args:
      x: ``[sum(send_sizes), *rest]``, any dtype; rows ``[sum(send_sizes[:j]), sum(send_sizes[:j+1]))``
        go to group rank ``j``.
      send_sizes: ``G`` ints >= 0, rows sent to each group rank.
      recv_sizes: ``G`` ints >= 0, rows received from each group rank; must equal what each
        sender put in its ``send_sizes`` for this rank (use ``exchange_counts`` to learn it).
    Returns ``[sum(recv_sizes), *rest]`` of ``x.dtype``: rows from group rank 0, then 1, ...
    """
    call = _call("all_to_allv", group, group_name)
    with traced(trace, call.op, group_name, x, _ints(send_sizes), _ints(recv_sizes)):
        return _all_to_allv(call, x, send_sizes, recv_sizes, group)


def _all_to_allv(call: _Call, x: Tensor, send_sizes: list[int], recv_sizes: list[int], group: Any) -> Tensor:
    send_sizes = _check_sizes(call, "send_sizes", send_sizes)
    recv_sizes = _check_sizes(call, "recv_sizes", recv_sizes)
    _check_tensor(call, "input", x, group)
    if x.shape[0] != sum(send_sizes):
        raise call.error(f"input has {x.shape[0]} rows but send_sizes {send_sizes} sum to {sum(send_sizes)}")
    return _from_rows(_all_to_all_rows(_as_rows(x), send_sizes, recv_sizes, group), x)


def exchange_sizes(n: int, group: Any, device: torch.device | str, *, group_name: str = "group",
                   trace: CollectiveTrace | None = None) -> list[int]:
    """Every rank's ``n`` (an int >= 0), in group-rank order; the same list on every rank.

    ``device`` is where the one-element int64 buffer lives: cpu for gloo, cuda for NCCL.  Returns
    Python ints, so it synchronises with the device.
    """
    call = _call("exchange_sizes", group, group_name)
    with traced(trace, call.op, group_name, None, _ints([n])):
        return _exchange_sizes(call, n, group, device)


def _exchange_sizes(call: _Call, n: int, group: Any, device: torch.device | str) -> list[int]:
    if not is_int(n) or n < 0:  # a tensor is refused too: reading it would hide a device sync
        raise call.error(f"n must be an int >= 0, got {n!r}")
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    _check_tensor(call, "the size buffer", mine, group)
    everyone = mine.new_empty(call.group_size)
    _all_gather_single(everyone, mine, group=group)
    return everyone.tolist()


def exchange_counts(counts: Tensor, group: Any, *, group_name: str = "group",
                    trace: CollectiveTrace | None = None) -> Tensor:
    """Tells every rank how many rows each rank will send it.

    Args:
      counts: ``[G]`` int64 >= 0 on the group's device; ``counts[j]`` = rows this rank sends to
        group rank ``j``.  Checking ``>= 0`` reads the values back (a device sync).
    Returns ``[G]`` int64: element ``j`` = rows group rank ``j`` sends to this rank, i.e. the
    ``recv_sizes`` matching this rank's ``send_sizes = counts`` in ``all_to_allv``.
    """
    call = _call("exchange_counts", group, group_name)
    # counts are recorded only from the host (reading them off a GPU would add a sync)
    sent = _ints(counts.tolist()) if isinstance(counts, Tensor) and counts.device.type == "cpu" and counts.dim() == 1 else ()
    with traced(trace, call.op, group_name, counts if isinstance(counts, Tensor) else None, sent):
        return _exchange_counts(call, counts, group)


def _exchange_counts(call: _Call, counts: Tensor, group: Any) -> Tensor:
    _check_tensor(call, "counts", counts, group)
    if counts.dtype != torch.int64:
        raise call.error(f"counts must be int64, got {counts.dtype}", CollectiveInputError)
    if tuple(counts.shape) != (call.group_size,):
        raise call.error(f"counts has shape {list(counts.shape)} but the group has {call.group_size} ranks "
                         f"(expected [{call.group_size}])")
    if counts.numel() and int(counts.min()) < 0:
        raise call.error(f"counts must be >= 0, got {counts.tolist()}")
    received = torch.empty_like(counts, memory_format=torch.contiguous_format)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received

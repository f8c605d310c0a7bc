"""Sequence parallelism: each TP rank routes only its contiguous chunk of the tokens.

The ``T`` tokens are replicated on the ``tp`` ranks of a TP group.  Conceptually they are padded
to ``padded = ceil(T / tp) * tp`` rows and TP rank ``t`` takes rows ``[t*chunk, (t+1)*chunk)``
with ``chunk = padded // tp``.  Only the real rows of that slice are handed out: padding never
reaches the router, the experts or the shared experts (padding rows would be routed like tokens,
cost expert work and, for shared experts, be easy to add twice).  A rank whose slice lies wholly
in the padding gets ``real = 0`` rows, which happens whenever ``T < tp`` (small decode batches).

Example, T = 5, tp = 4: padded = 8, chunk = 2 -> real rows per rank 2, 2, 1, 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor

from moeshard.parallel.collectives import CollectiveInputError, CollectiveSizeError, all_gatherv
from moeshard.parallel.trace import CollectiveTrace
from moeshard.validate import index, int_at_least


@dataclass(frozen=True)
class SequenceChunk:
    """Where one TP rank's chunk sits in the sequence.

    Fields: ``total`` = T real rows; ``padded`` = T rounded up to a multiple of ``tp``;
    ``chunk`` = padded // tp, rows per rank including padding; ``start`` = first row of this
    rank's chunk (= tp_rank * chunk); ``real`` = real rows in it, ``0 <= real <= chunk``;
    ``tp_rank``, ``tp`` = this rank's index and the TP size.  Build with ``SequenceChunk.of``.
    """

    total: int
    padded: int
    chunk: int
    start: int
    real: int
    tp_rank: int
    tp: int

    @classmethod
    def of(cls, total: int, tp_rank: int, tp: int) -> SequenceChunk:
        int_at_least("SequenceChunk", "total", total, 0)
        int_at_least("SequenceChunk", "tp", tp, 1)
        index("SequenceChunk", "tp_rank", tp_rank, tp)
        padded = -(-total // tp) * tp
        chunk = padded // tp
        start = tp_rank * chunk
        real = max(0, min(total, start + chunk) - start)
        return cls(total=total, padded=padded, chunk=chunk, start=start, real=real, tp_rank=tp_rank, tp=tp)

    @property
    def rows_per_rank(self) -> list[int]:
        """Real rows of every TP rank's chunk, in TP-rank order (sums to ``total``)."""
        return [SequenceChunk.of(self.total, t, self.tp).real for t in range(self.tp)]


def sequence_parallel_chunk(x: Tensor, tp_rank: int, tp: int) -> tuple[Tensor, SequenceChunk]:
    """This TP rank's real rows of ``x``.

    Args:
      x: ``[T, H]`` (any trailing shape), the tokens, identical on every rank of the TP group.
      tp_rank, tp: this rank's index in the TP group and the group's size.
    Returns ``(x[start : start + real]`` (a view, ``[real, H]``, possibly 0 rows), the chunk).
    """
    if not isinstance(x, Tensor) or x.dim() == 0:
        raise ValueError(f"sequence_parallel_chunk: x must be a tensor [T, ...], got "
                         f"{type(x).__name__ if not isinstance(x, Tensor) else 'a 0-d tensor'}")
    chunk = SequenceChunk.of(x.shape[0], tp_rank, tp)
    return x[chunk.start:chunk.start + chunk.real], chunk


def sequence_parallel_gather(y: Tensor, chunk: SequenceChunk, tp_group: Any, *,
                             trace: CollectiveTrace | None = None) -> Tensor:
    """Reassembles the full sequence from every TP rank's chunk, in order, without padding.

    Args:
      y: ``[chunk.real, H]`` (any trailing shape, the same on every rank), this rank's results.
      chunk: this rank's ``SequenceChunk`` (from ``sequence_parallel_chunk``); ``total`` and
        ``tp`` are the same on every rank of the group.
      tp_group: the TP group; its size is ``chunk.tp`` and this rank's index is ``chunk.tp_rank``.
      trace: this rank's ``CollectiveTrace``, or None.
    Returns ``[chunk.total, H]``, identical on every rank of the TP group.  Checks run before the
    collective.  Each rank's block is padded to ``chunk.chunk`` rows for the equal-size all-gather
    and the padding is dropped again (``all_gatherv`` with the per-rank real row counts).
    """
    rank = dist.get_rank()
    where = f"sequence_parallel_gather on group 'tp' (rank {rank})"
    if not isinstance(y, Tensor) or y.dim() == 0:
        raise CollectiveInputError(f"{where}: y must be a tensor [rows, ...], got {type(y).__name__}")
    if y.shape[0] != chunk.real:
        raise CollectiveSizeError(f"{where}: y has {y.shape[0]} rows but this rank's chunk has {chunk.real} "
                                  f"real rows (rows [{chunk.start}, {chunk.start + chunk.real}) of {chunk.total})")
    size, index = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if (size, index) != (chunk.tp, chunk.tp_rank):
        raise CollectiveInputError(f"{where}: the chunk is for tp_rank {chunk.tp_rank} of tp={chunk.tp} but "
                                   f"this rank is index {index} of a group of {size}")
    return all_gatherv(y, chunk.rows_per_rank, tp_group, "tp", trace=trace)

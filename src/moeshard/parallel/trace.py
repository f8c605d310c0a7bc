"""A per-rank record of the collectives a rank entered, and the diff that explains a hang.

Each rank keeps a bounded ring (``CollectiveTrace``) of the last ``capacity`` collectives it
entered: op, group, sizes or split sizes, dtype, the call site, the case being run, and whether
it returned, raised or is still inside. Recording is a few microseconds per collective (a
``struct.pack_into`` into a preallocated buffer), so it stays on by default; nothing is written
anywhere unless a run fails. The buffer may be shared memory that the parent process reads
(``CollectiveTrace.shared``): then even a rank that hangs, in a collective or anywhere else,
leaves its trace readable.

``explain_divergence`` compares the ranks' sequences for one case: SPMD code makes every rank
enter the same collectives in the same order, so the first position where ranks differ (or
where one stops) names who skipped, who waits and where, and sizes that do not fit each other
(an all-to-all whose send and receive splits disagree, an all-gather whose size lists differ).

Who records: the uneven collectives of ``moeshard.parallel.collectives`` (their ``trace``
argument) and the plain ``torch.distributed`` calls of the layer and its backends (through
``traced``); ``ParallelGroups.trace`` carries the rank's ring to all of them.
"""

from __future__ import annotations

import contextlib
import re
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

# seq, state, case, op, group, dtype, n_send, n_recv, send[8], recv[8], numel, site
_RECORD = struct.Struct("<qBi16s8s12sBB8i8iq64s")
_MAX_SIZES = 8
ENTERED, RETURNED, RAISED = 1, 2, 3
TRACE_CAPACITY = 64  # collectives a rank keeps (a layer forward enters 3 to 15)
STATE_NAMES = {ENTERED: "inside", RETURNED: "returned", RAISED: "raised"}
_SKIP_FILES = ("moeshard/parallel/trace.py", "moeshard/parallel/collectives.py", "contextlib.py")


@dataclass(frozen=True)
class TraceEntry:
    """One collective a rank entered. seq: its number on this rank (from 1); case: the harness's
    case index when it was entered (-1 outside the harness); state: ENTERED (still inside),
    RETURNED or RAISED; send / recv: sizes or split sizes (send alone for one-list ops; may be
    cut to 8 entries, ``sizes_cut``); numel: elements of the tensor given; site: ``file:line
    function`` of the caller in moeshard."""

    seq: int
    case: int
    state: int
    op: str
    group: str
    dtype: str
    send: tuple[int, ...]
    recv: tuple[int, ...]
    numel: int
    site: str
    sizes_cut: bool = False

    def describe(self, number: int | None = None) -> str:
        """``all_to_allv #4 (ep, send [3, 0], recv [37, 0], bfloat16) at dispatch/all2all.py:84 combine``."""
        parts = [self.group]
        if self.send:
            parts.append(("send " if self.recv else "sizes ") + str(list(self.send)) + ("..." if self.sizes_cut else ""))
        if self.recv:
            parts.append("recv " + str(list(self.recv)) + ("..." if self.sizes_cut else ""))
        if self.dtype:
            parts.append(self.dtype)
        tag = f" #{number}" if number is not None else ""
        return f"{self.op}{tag} ({', '.join(parts)}) at {self.site}"


class CollectiveTrace:
    """The ring of one rank. ``buffer``: a writable buffer of ``capacity * record_size()`` bytes
    (a ``multiprocessing`` RawArray to share it with the parent), or None for private memory.
    ``case``: the harness sets it before each case; entries carry it."""

    def __init__(self, capacity: int = 64, buffer: Any = None) -> None:
        if capacity < 1:
            raise ValueError(f"CollectiveTrace.capacity: must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._buffer = buffer if buffer is not None else bytearray(capacity * _RECORD.size)
        self._view = memoryview(self._buffer).cast("B")
        if len(self._view) < capacity * _RECORD.size:
            raise ValueError(f"CollectiveTrace: the buffer holds {len(self._view)} bytes, "
                             f"{capacity} records need {capacity * _RECORD.size}")
        self._seq = 0
        self.case = -1

    @staticmethod
    def record_size() -> int:
        return _RECORD.size

    @classmethod
    def shared(cls, capacity: int = 64) -> Any:
        """A zeroed shared buffer for ``capacity`` records (``multiprocessing.RawArray``): create
        it in the parent, hand it to a rank among a ``LocalWorld``'s arguments, and wrap it on
        both sides with ``CollectiveTrace(capacity, buffer)``."""
        import multiprocessing
        return multiprocessing.RawArray("B", capacity * _RECORD.size)

    def _write(self, seq: int, state: int, op: str, group: str, dtype: str, send: Sequence[int],
               recv: Sequence[int], numel: int, site: str) -> None:
        s, r = list(send)[:_MAX_SIZES], list(recv)[:_MAX_SIZES]
        cut = len(send) > _MAX_SIZES or len(recv) > _MAX_SIZES
        _RECORD.pack_into(self._view, ((seq - 1) % self.capacity) * _RECORD.size, seq, state | (cut << 7), self.case,
                          op.encode()[:16], group.encode()[:8], dtype.encode()[:12], len(s), len(r),
                          *(s + [0] * (_MAX_SIZES - len(s))), *(r + [0] * (_MAX_SIZES - len(r))), numel,
                          site.encode()[:64])

    def enter(self, op: str, group: str, *, send: Sequence[int] = (), recv: Sequence[int] = (), dtype: str = "",
              numel: int = 0, site: str = "") -> tuple:
        """Records entering ``op``; returns the token ``leave`` needs."""
        self._seq += 1
        record = (self._seq, op, group, dtype, tuple(send), tuple(recv), numel, site or call_site())
        self._write(record[0], ENTERED, *record[1:])
        return record

    def leave(self, record: tuple, state: int = RETURNED) -> None:
        """Marks the collective of ``record`` (from ``enter``) returned or raised."""
        self._write(record[0], state, *record[1:])

    def entries(self) -> list[TraceEntry]:
        """The entries still in the ring, oldest first (the parent may call this while the rank
        runs: an entry being written can be torn, the rest are whole)."""
        out = []
        for i in range(self.capacity):
            fields = _RECORD.unpack_from(self._view, i * _RECORD.size)
            seq, state, case, op, group, dtype, n_send, n_recv = fields[:8]
            if seq <= 0:
                continue
            send, recv = fields[8:8 + _MAX_SIZES][:n_send], fields[8 + _MAX_SIZES:8 + 2 * _MAX_SIZES][:n_recv]
            out.append(TraceEntry(seq, case, state & 0x7F, _text(op), _text(group), _text(dtype), tuple(send),
                                  tuple(recv), fields[-2], _text(fields[-1]), bool(state & 0x80)))
        return sorted(out, key=lambda e: e.seq)


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


def call_site() -> str:
    """``path:line function`` of the nearest caller outside this module, the collectives module
    and contextlib (the path from ``moeshard/`` on); when that function is a private helper
    (``_exchange``), its caller's name too (``_exchange < combine``)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.replace("\\", "/").endswith(_SKIP_FILES):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.replace("\\", "/")
    path = path.split("moeshard/", 1)[-1] if "moeshard/" in path else path.rsplit("/", 1)[-1]
    name = frame.f_code.co_name
    if name.startswith("_") and frame.f_back is not None:
        name += " < " + frame.f_back.f_code.co_name
    return f"{path}:{frame.f_lineno} {name}"


@contextlib.contextmanager
def _traced(trace: CollectiveTrace, op: str, group: str, tensor: Any, send: Sequence[int],
            recv: Sequence[int]) -> Iterator[None]:
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else ""
    numel = tensor.numel() if tensor is not None else 0
    record = trace.enter(op, group, send=send, recv=recv, dtype=dtype, numel=numel, site=call_site())
    try:
        yield
    except BaseException:
        trace.leave(record, RAISED)
        raise
    trace.leave(record, RETURNED)


def traced(trace: CollectiveTrace | None, op: str, group: str, tensor: Any = None, send: Sequence[int] = (),
           recv: Sequence[int] = ()) -> contextlib.AbstractContextManager:
    """``with traced(groups.trace, "all_reduce", "tp", out): dist.all_reduce(...)`` records the
    collective in ``trace`` (nothing when it is None)."""
    if trace is None:
        return contextlib.nullcontext()
    return _traced(trace, op, group, tensor, send, recv)


def error_headline(message: str) -> str:
    """The first line of a rank's error message, without gloo's ``[file.cc:123] `` prefix, cut
    to 160 characters: what a collective diff quotes of how a rank ended."""
    line = (message.strip().splitlines() or [""])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", line)[:160]


def last_collectives(trace: CollectiveTrace, count: int = 3) -> str:
    """The last ``count`` collectives of one rank's trace in words, each with its number on the
    rank and whether it returned, raised or is still inside: what a rank reports of itself when
    no parent is there to diff the ranks (under torchrun)."""
    entries = trace.entries()[-count:]
    if not entries:
        return "no collective entered"
    return "; ".join(f"{e.describe(e.seq)}: {STATE_NAMES[e.state]}" for e in entries)


# -- the diff -------------------------------------------------------------------------------

def _case_entries(entries: list[TraceEntry], case: int) -> list[TraceEntry]:
    return [e for e in entries if e.case == case]


def _consistency(at: dict[int, TraceEntry], ep_members: list[int] | None) -> list[str]:
    """Sizes that do not fit each other at one position where every rank entered the same op on
    the EP group (TP groups differ between DP ranks, so only the EP group is compared)."""
    ranks = sorted(at)
    first = at[ranks[0]]
    if first.group != "ep" or ep_members is None or any(at[r].sizes_cut for r in ranks):
        return []
    if first.op in ("all_gatherv", "reduce_scatterv"):
        if len({at[r].send for r in ranks}) > 1:
            return [f"the ranks of {first.op} disagree on the sizes: "
                    + ", ".join(f"rank {r} {list(at[r].send)}" for r in ranks)]
        return []
    problems = []
    if first.op == "all_to_allv":
        for r in ranks:
            for j, peer in enumerate(ep_members):
                if peer in at and r in ep_members and j < len(at[r].send):
                    expects = at[peer].recv[ep_members.index(r)] if ep_members.index(r) < len(at[peer].recv) else None
                    if expects is not None and at[r].send[j] != expects:
                        problems.append(f"rank {r} sends {at[r].send[j]} rows to rank {peer}, "
                                        f"which expects {expects} from it")
    return problems


def explain_divergence(traces: dict[int, list[TraceEntry]], case: int, world_size: int,
                       outcome: dict[int, str], ep_members: list[int] | None = None) -> list[str]:
    """Lines that say, for case ``case``, where the ranks' collective sequences part.

    traces: rank -> its entries (``CollectiveTrace.entries``), ranks with no trace left out;
    outcome: rank -> what the parent knows of how it ended the case ("finished the case",
    "raised ValueError: ... at file:line", "stopped reporting", ...); ep_members: the global ranks
    of the EP group in order (for matching all-to-all splits), if any.
    Numbers (#n) count the collectives of this case on each rank, from 1.
    """
    lines = []
    seqs = {r: _case_entries(traces[r], case) for r in sorted(traces)}
    missing = [r for r in range(world_size) if r not in traces]
    if not seqs:
        return ["no rank left a collective trace"]
    longest = max(len(s) for s in seqs.values())
    position, problems = None, []
    for k in range(longest):
        here = {r: s[k] for r, s in seqs.items() if k < len(s)}
        ops = {(e.op, e.group) for e in here.values()}
        unfinished = [r for r, e in here.items() if e.state != RETURNED]
        if len(here) < len(seqs) or len(ops) > 1 or unfinished:
            position = k
            if len(here) == len(seqs) and len(ops) == 1:  # same collective everywhere: do the sizes fit?
                mismatch = _consistency(here, ep_members)
                if mismatch:
                    lines.append("the sizes do not fit: " + "; ".join(mismatch))
            break
        problems = _consistency(here, ep_members)
        if problems:
            position = k
            break
    if position is None:
        last = longest
        lines.append(f"every rank with a trace entered the same {last} collectives of the case and left them"
                     + (f"; ranks {missing} left no trace" if missing else ""))
        return lines
    k = position
    inside, never, details = [], [], []
    for r, s in seqs.items():
        said = outcome.get(r, "")
        if k < len(s):
            e = s[k]
            if e.state == ENTERED:
                inside.append(f"rank {r} waits in {e.op} ({e.group}) at {e.site}")
                details.append(f"rank {r} waits in {e.describe(k + 1)}" + (f"; {said}" if said else ""))
            elif e.state == RAISED:
                inside.append(f"rank {r} failed in {e.op} ({e.group}) at {e.site}")
                details.append(f"rank {r} was inside {e.describe(k + 1)} when {said or 'it raised'}")
            else:
                inside.append(f"rank {r} entered {e.op} ({e.group}) at {e.site}")
                details.append(f"rank {r} entered {e.describe(k + 1)} and left it" + (f"; then {said}" if said else ""))
        else:
            never.append(f"rank {r} never entered it ({said or 'went no further'})")
            before = f"after {s[-1].describe(len(s))}" if s else "before any collective of the case"
            details.append(f"rank {r} never entered collective #{k + 1}: {before}, {said or 'it went no further'}")
    op_names = {e.op for r, s in seqs.items() if k < len(s) for e in [s[k]]}
    if len(op_names) > 1:
        inside.insert(0, "the ranks entered different collectives")
    if problems:
        op = next(iter(seqs.values()))[k].op
        lines.insert(0, f"the sizes of collective #{k + 1} of the case ({op}) do not fit: " + "; ".join(problems))
    else:
        lines.insert(0, f"ranks part at collective #{k + 1} of the case: " + "; ".join(inside + never))
    lines.extend(details)
    if missing:
        lines.append(f"ranks {missing} left no trace")
    return lines

"""Inside one rank that ``LocalWorld`` started: join the process group, run the function, report.

Everything a rank tells the parent crosses one multiprocessing queue as ``(kind, rank, payload)``:

    ("message", rank, bytes)    what the function sent through its ``RankChannel``, in order
    ("ok", rank, bytes)         the function's return value: the rank's last word
    ("error", rank, RankError)  what the function (or joining the group) raised instead

A rank marks in the parent's rendezvous store when it reached it (``ARRIVED_KEY + str(rank)``)
and when it joined the process group (``JOINED_KEY + str(rank)``): when the ranks that came
give up waiting at the rendezvous, the parent names the rank that never joined
(``LocalWorld.silent_ranks``). torch's C++ log lines printed while joining are held back
(``moeshard.parallel.held_stderr``) and dropped when the rendezvous gives up, which the parent
reports in one line.

Values travel as bytes made by ``dumps`` in the rank, so a value that cannot be pickled fails
there, as that rank's error, instead of vanishing in the queue's feeder thread.

A rank never outlives the process that started it, and never waits forever on it:

  * it dies with its parent: on Linux the kernel sends it SIGKILL when the parent dies
    (``prctl(PR_SET_PDEATHSIG)``, set before anything else runs), and on every system a watch
    thread exits the rank within ``PARENT_POLL_S`` once its parent process is gone (the parent
    may be killed with SIGKILL, which no handler of the parent can see);
  * its last report is handed over within a bound: if the parent does not read it within the
    process-group timeout (it is gone, or it has stopped listening), the rank exits anyway
    (``EXIT_REPORT_STUCK``) instead of blocking in the queue's pipe;
  * it ignores SIGINT: Ctrl-C reaches the whole foreground process group, and the parent, which
    stops every rank, is the one that answers it (no KeyboardInterrupt tracebacks from ranks).
    ``LocalWorld.start`` blocks SIGINT while it starts the ranks, so the ranks inherit it blocked
    until ``rank_main`` ignores it for good.

Caveat of the parent-death signal: Linux sends it when the *thread* that started the rank
exits. Start a ``LocalWorld`` from a thread that outlives it (moeshard does, from the main
thread).
"""

from __future__ import annotations

import ctypes
import datetime
import io
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeshard.parallel.held_stderr import stderr_held

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0
PARENT_POLL_S = 0.5
EXIT_PARENT_GONE = 86  # a rank's exit code when its parent died before it finished
EXIT_REPORT_STUCK = 87  # ... when nobody read its last report within the process-group timeout
ARRIVED_KEY = "moeshard/arrived/"  # + rank: set in the rendezvous store once that rank reached it
JOINED_KEY = "moeshard/joined/"  # + rank: ... once that rank joined the process group
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank: its type name, message and formatted traceback.
    ``joining``: raised before the rank joined the process group (reaching the store, setting up
    the group's connections), so the function never ran on it. ``rendezvous``: raised while
    joining as a torch ``DistError`` (the store or the group's set-up gave up waiting for its
    peers), not by the rank's own work."""

    rank: int
    type_name: str
    message: str
    traceback: str
    rendezvous: bool = False
    joining: bool = False

    @property
    def first_line(self) -> str:
        """The message's first non-blank line ("" for an empty message)."""
        return (self.message.strip().splitlines() or [""])[0]

    @classmethod
    def of(cls, rank: int, exc: BaseException, rendezvous: bool = False, joining: bool = False) -> RankError:
        return cls(rank, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)), rendezvous, joining)


def _rebuild_tensor(raw: bytes, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype_name)).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles tensors as raw bytes + dtype + shape; they come back as plain CPU tensors.

    Plain pickling of tensors cannot be loaded back for float8 dtypes (torch's storage
    unpickler fails on them), and torch's multiprocessing reductions would pass shared-memory
    handles that die with the child.  Raw bytes work for every dense dtype, CUDA included.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized:
                raise TypeError(f"cannot send a {obj.layout} / quantized tensor from a rank")
            raw = b""
            if obj.numel():
                flat = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                raw = ctypes.string_at(flat.data_ptr(), flat.numel())  # no numpy needed
            return _rebuild_tensor, (raw, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return NotImplemented


def dumps(value: Any) -> bytes:
    """``value`` as bytes for the parent (tensors as raw bytes, see ``_Pickler``)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """The value ``dumps`` made (in the parent, which runs this same code)."""
    return pickle.loads(data)


class RankChannel:
    """A rank's way to tell the parent something while its function runs.

    Pass ``world.channel`` among the function's arguments; inside a rank, ``send(value)``
    reaches the parent, in order, as ``RankEvent("message", rank, value)`` (tensors come back as
    CPU tensors).  Only usable inside the ranks of the world it belongs to.
    """

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def send(self, value: Any) -> None:
        self._queue.put(("message", dist.get_rank(), dumps(value)))


def _loopback_device_name() -> str | None:
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            return name
    return None


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL from the kernel when the parent dies (Linux), a watch thread everywhere, and an
    immediate exit if the parent is already gone (it may have died before the prctl)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: the watch thread alone
            pass
    if os.getppid() != parent_pid:
        os._exit(EXIT_PARENT_GONE)

    def watch() -> None:
        while True:
            threading.Event().wait(PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="moeshard-parent-watch", daemon=True).start()


def _release_fork_server() -> None:
    """A rank forked by the fork server holds the write end of the server's "alive" pipe (the
    standard library hands it to every child, so that the server lives while its children do).
    With PDEATHSIG tying the rank to the server, that is a loop: after the parent dies neither
    would ever end. The rank starts no processes, so it gives its end up: the server then exits
    with the parent, and the rank with the server. (A private attribute of the standard library:
    it is None in a rank that was not forked by a fork server.)"""
    import multiprocessing.forkserver as forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)  # not in the type stubs
    if fd is not None:
        os.close(fd)
        setattr(server, "_forkserver_alive_fd", None)  # noqa: B010 - the same: unknown to the stubs


def _report(queue: Any, message: tuple, wait_s: float) -> None:
    """Puts the rank's last report and waits at most ``wait_s`` for it to be written into the
    pipe (the queue's feeder thread blocks while the pipe is full and nobody reads it)."""
    queue.put(message)
    queue.close()
    joiner = threading.Thread(target=queue.join_thread, name="moeshard-report", daemon=True)
    joiner.start()
    joiner.join(wait_s)
    if joiner.is_alive():
        os._exit(EXIT_REPORT_STUCK)


def rank_main(rank: int, world_size: int, port: int, device: str, fn: Callable[..., Any], args: Sequence[Any],
              queue: Any, backend: str | None = None, pg_timeout_s: float = DEFAULT_TIMEOUT_S,
              parent_pid: int | None = None) -> None:
    """Entry point of one spawned rank: join the process group, run ``fn(*args)``, report.

    Args:
      rank, world_size: this rank and the number of ranks.
      port: the parent's TCPStore on 127.0.0.1 (the rendezvous).
      device: ``"cpu"`` or ``"cuda"``; with cuda this rank uses cuda device ``rank``.
      fn, args: what to run (picklable: a module-level function and picklable arguments).
      queue: the world's queue; gets the messages ``fn`` sends, then exactly one final report,
        ``("ok", rank, dumps(result))`` or ``("error", rank, RankError)``.
      backend: process-group backend; ``None`` = gloo for cpu, nccl for cuda.
      pg_timeout_s: the process group's timeout, the bound on every collective, and on how long
        the last report may wait for the parent to read it.
      parent_pid: the process that started this rank; the rank dies with it (None: the parent
        as this rank sees it at start).
    The default process group is destroyed after a successful ``fn``.  After a failure the
    process just exits: peers may still be inside a collective, and tearing the group down
    could wait on them; the parent stops whatever is left.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # discards a Ctrl-C left pending while starting
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent(os.getppid() if parent_pid is None else parent_pid)
    _release_fork_server()
    joined = False
    try:
        # Gloo's own connections would otherwise listen on the address the host name resolves
        # to; these ranks all live on this machine, so keep them on loopback like the store.
        loopback = _loopback_device_name()
        if loopback is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        backend = backend or ("nccl" if device == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        device_id = None
        if device == "cuda":
            torch.cuda.set_device(rank)
            if "nccl" in backend:
                device_id = torch.device("cuda", rank)  # binds the NCCL communicator to this GPU up front
        # A wait that runs out here is reported by the parent in one line: torch's C++ log of it is dropped.
        with stderr_held(dropped_on=(dist.DistError,)):
            store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
            store.set(f"{ARRIVED_KEY}{rank}", "1")
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=device_id)
        store.set(f"{JOINED_KEY}{rank}", "1")
        joined = True
        message: tuple = ("ok", rank, dumps(fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        message = ("error", rank, RankError.of(rank, exc, rendezvous=not joined and isinstance(exc, dist.DistError),
                                               joining=not joined))
    _report(queue, message, pg_timeout_s)
    if message[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()

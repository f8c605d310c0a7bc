"""Inside one rank that ``LocalWorld`` started: join the process group, run the function, report.

Everything a rank tells the parent crosses one multiprocessing queue as ``(kind, rank, payload)``:

    ("message", rank, bytes)    what the function sent through its ``RankChannel``, in order
    ("ok", rank, bytes)         the function's return value: the rank's last word
    ("error", rank, RankError)  what the function (or joining the group) raised instead

Values travel as bytes made by ``dumps`` in the rank, so a value that cannot be pickled fails
there, as that rank's error, instead of vanishing in the queue's feeder thread.
"""

from __future__ import annotations

import ctypes
import datetime
import io
import os
import pickle
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank: its type name, message and formatted traceback."""

    rank: int
    type_name: str
    message: str
    traceback: str

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> RankError:
        return cls(rank, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))


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


def rank_main(rank: int, world_size: int, port: int, device: str, fn: Callable[..., Any], args: Sequence[Any],
              queue: Any, backend: str | None = None, pg_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Entry point of one spawned rank: join the process group, run ``fn(*args)``, report.

    Args:
      rank, world_size: this rank and the number of ranks.
      port: the parent's TCPStore on 127.0.0.1 (the rendezvous).
      device: ``"cpu"`` or ``"cuda"``; with cuda this rank uses cuda device ``rank``.
      fn, args: what to run (picklable: a module-level function and picklable arguments).
      queue: the world's queue; gets the messages ``fn`` sends, then exactly one final report,
        ``("ok", rank, dumps(result))`` or ``("error", rank, RankError)``.
      backend: process-group backend; ``None`` = gloo for cpu, nccl for cuda.
      pg_timeout_s: the process group's timeout, the bound on every collective.
    The default process group is destroyed after a successful ``fn``.  After a failure the
    process just exits: peers may still be inside a collective, and tearing the group down
    could wait on them; the parent stops whatever is left.
    """
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
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id)
        message: tuple = ("ok", rank, dumps(fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        message = ("error", rank, RankError.of(rank, exc))
    queue.put(message)
    queue.close()
    queue.join_thread()
    if message[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()

"""Starting ranks: ``spawn`` for N local processes, ``init_from_env`` under torchrun.

``spawn(fn, world_size, args)`` starts ``world_size`` fresh interpreters ("spawn" start method,
so nothing of the parent's state, CUDA included, leaks into them), joins them into one process
group, runs ``fn(*args)`` on each and returns the per-rank results.  It never hangs:

  * the rendezvous is a TCPStore owned by the parent on a socket bound to 127.0.0.1 port 0, so
    it listens on loopback only and two runs at once get different ports (the port is held from
    the moment it is picked, so there is no pick-then-bind race);
  * the process group has a timeout, so a stuck collective raises inside the rank;
  * the parent waits at most ``timeout_s`` in all; when a rank fails it waits ``grace_s`` more for
    the others to report, then terminates and, if needed, kills every child still running.

A failed run raises ``RankFailure``: each rank's exception with its traceback, the ranks that
never reported, and the results of those that did.
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank: its type name, message and formatted traceback."""

    rank: int
    type_name: str
    message: str
    traceback: str


class RankFailure(RuntimeError):
    """Some ranks of a ``spawn`` raised, died, or did not finish in time.

    Attributes:
      ``errors``: rank -> ``RankError`` for each rank that raised.
      ``missing``: ranks that reported nothing (died, timed out, or stopped after another failed).
      ``died``: rank -> exit code, for the missing ranks that exited on their own.
      ``timed_out``: the deadline passed with no rank failed or dead.
      ``exitcodes``: rank -> final exit code of every rank (negative: ended by that signal).
      ``results``: rank -> return value, for the ranks that finished.
    """

    def __init__(self, world_size: int, errors: dict[int, RankError], missing: list[int], died: dict[int, int],
                 timed_out: bool, timeout_s: float, exitcodes: dict[int, int | None], results: dict[int, Any]):
        self.world_size = world_size
        self.errors = errors
        self.missing = missing
        self.died = died
        self.timed_out = timed_out
        self.exitcodes = exitcodes
        self.results = results
        lines = [f"spawn(world_size={world_size}) failed:"]
        for rank, err in sorted(errors.items()):
            lines.append(f"rank {rank} raised {err.type_name}: {err.message}")
        for rank, code in sorted(died.items()):
            lines.append(f"rank {rank} exited with code {code} without reporting a result")
        others = [r for r in missing if r not in died]
        if others:
            why = f"did not finish within {timeout_s:g} s" if timed_out else "were stopped after the failure above"
            lines.append(f"ranks {others} {why}")
        for rank, err in sorted(errors.items()):
            lines.append(f"--- traceback of rank {rank} ---\n{err.traceback.rstrip()}")
        super().__init__("\n".join(lines))


def _rebuild_tensor(raw: bytes, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype_name)).reshape(shape)


class _ResultPickler(pickle.Pickler):
    """Pickles tensors as raw bytes + dtype + shape; they come back as plain CPU tensors.

    Plain pickling of tensors cannot be loaded back for float8 dtypes (torch's storage
    unpickler fails on them), and torch's multiprocessing reductions would pass shared-memory
    handles that die with the child.  Raw bytes work for every dense dtype, CUDA included.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized:
                raise TypeError(f"spawn: cannot return a {obj.layout} / quantized tensor from a rank")
            raw = b""
            if obj.numel():
                raw = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _rebuild_tensor, (raw, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return NotImplemented


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _ResultPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _loopback_device_name() -> str | None:
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            return name
    return None


def _worker(rank: int, world_size: int, port: int, device: str, fn: Callable[..., Any], args: Sequence[Any],
            queue: Any, backend: str | None = None, pg_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Entry point of one spawned rank: join the process group, run ``fn(*args)``, report.

    Args:
      rank, world_size: this rank and the number of ranks.
      port: the parent's TCPStore on 127.0.0.1 (the rendezvous).
      device: ``"cpu"`` or ``"cuda"``; with cuda this rank uses cuda device ``rank``.
      fn, args: what to run (picklable: a module-level function and picklable arguments).
      queue: a multiprocessing queue; receives exactly one message,
        ``("ok", rank, pickled result)`` or ``("error", rank, RankError)``.
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
        result = fn(*args)
        # Pickle here, not in the queue's feeder thread: an unpicklable result then becomes this
        # rank's error instead of a message that silently never arrives.
        message: tuple = ("ok", rank, _dumps(result))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        message = ("error", rank, RankError(rank, type(exc).__name__, str(exc), traceback.format_exc()))
    queue.put(message)
    queue.close()
    queue.join_thread()
    if message[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()


def _rendezvous_store(world_size: int, timeout_s: float) -> tuple[Any, int]:
    """A TCPStore master listening on 127.0.0.1 on a port the OS picks (bound to port 0)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(max(world_size, 16))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns (and closes) the listening socket from here on
    try:
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    return store, port


def _stop(processes: list[Any], exit_wait_s: float) -> None:
    """Waits up to ``exit_wait_s`` for the children to exit, then terminates and kills the rest.

    Returns only once every child has exited.
    """
    processes = [p for p in processes if p.pid is not None]  # some may never have started
    deadline = time.monotonic() + exit_wait_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5.0)  # SIGKILL cannot be refused; the bound is only for a stuck kernel


def spawn(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), device: str = "cpu",
          timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None, pg_timeout_s: float | None = None,
          grace_s: float = 3.0) -> list[Any]:
    """Runs ``fn(*args)`` on ``world_size`` new local ranks joined in one default process group.

    Args:
      fn: a module-level (picklable) function; inside it use ``torch.distributed.get_rank()``.
        Its return value must be picklable; tensors in it come back as plain CPU tensors.
        The ranks are daemon processes, so ``fn`` cannot start processes of its own.
      world_size: number of ranks, >= 1 (<= visible GPUs for ``device="cuda"``).
      device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank r on cuda device r).
      timeout_s: the most the whole run may take, start-up included.
      backend: override the process-group backend (default gloo for cpu, nccl for cuda).
      pg_timeout_s: the process group's timeout (default ``timeout_s / 2``, so a stuck
        collective fails inside the rank, with its traceback, before the parent's deadline).
      grace_s: after a rank fails, how long to wait for the others to report before stopping them.
    Returns the results in rank order.  Raises ``RankFailure`` if any rank raised, died or did
    not finish in time; all children have exited by the time ``spawn`` returns or raises.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"spawn: world_size must be a positive integer, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"spawn: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"spawn: world_size={world_size} needs {world_size} GPUs but "
                         f"{torch.cuda.device_count()} are visible")
    if not timeout_s > 0 or not grace_s >= 0:
        raise ValueError(f"spawn: timeout_s must be > 0 and grace_s >= 0, got {timeout_s!r}, {grace_s!r}")
    pg_timeout_s = timeout_s / 2 if pg_timeout_s is None else pg_timeout_s

    ctx = torch_mp.get_context("spawn")
    queue = ctx.Queue()
    store, port = _rendezvous_store(world_size, timeout_s)
    processes = [ctx.Process(target=_worker, name=f"moeshard-rank{rank}", daemon=True,
                             args=(rank, world_size, port, device, fn, tuple(args), queue, backend, pg_timeout_s))
                 for rank in range(world_size)]
    results: dict[int, Any] = {}
    errors: dict[int, RankError] = {}
    exit_seen: dict[int, float] = {}  # rank -> when it was first seen exited without a report
    stop_at: float | None = None  # once something failed: when to stop waiting for the others
    timed_out = False
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            limit = deadline if stop_at is None else min(deadline, stop_at)
            if now >= limit:
                timed_out = stop_at is None
                break
            try:
                kind, rank, payload = queue.get(timeout=min(0.2, limit - now))
            except queue_module.Empty:
                kind = None
            if kind == "ok":
                try:
                    results[rank] = pickle.loads(payload)
                except Exception as exc:  # noqa: BLE001 - a broken result is that rank's failure
                    payload = RankError(rank, type(exc).__name__, f"result could not be unpickled: {exc}",
                                        traceback.format_exc())
                    kind = "error"
            if kind == "error":
                errors[rank] = payload
                stop_at = stop_at or time.monotonic() + grace_s
            # A rank that exited without a report has died, unless its report is still in the
            # pipe: allow it a second to arrive before calling the run failed.
            now = time.monotonic()
            for r, process in enumerate(processes):
                if r not in results and r not in errors and process.exitcode is not None:
                    exit_seen.setdefault(r, now)
            if stop_at is None and any(now - seen >= 1.0 for r, seen in exit_seen.items()
                                       if r not in results and r not in errors):
                stop_at = now + grace_s
    finally:
        # After a clean run the ranks are only tearing down their process group: let them
        # exit on their own for a while.  After a failure, stop them at once.
        clean = len(results) == world_size
        died = {r: processes[r].exitcode for r in exit_seen if r not in results and r not in errors}
        _stop(processes, exit_wait_s=10.0 if clean else 0.0)
        queue.close()
        del store
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    if errors or missing:
        exitcodes = {r: p.exitcode for r, p in enumerate(processes)}
        raise RankFailure(world_size, errors, missing, died, timed_out, timeout_s, exitcodes, results)
    return [results[r] for r in range(world_size)]


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a torchrun world (torchrun's contract is its
    environment: ``RANK`` and ``WORLD_SIZE`` are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Joins the process group torchrun describes (``env://``) and returns this rank's device.

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (``MASTER_ADDR``/``MASTER_PORT`` are read
    by torch's env:// rendezvous, used unchanged).  ``backend=None`` picks nccl when CUDA is
    available, else gloo; with nccl the current CUDA device is set to ``LOCAL_RANK``.  This is the
    only place moeshard reads environment variables (with ``launched_by_torchrun``).
    """
    if dist.is_initialized():
        raise RuntimeError("init_from_env: the default process group is already initialised")
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = os.environ.get(name)
        try:
            values[name] = int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise RuntimeError(f"init_from_env: environment variable {name} must be set to an integer "
                               f"(as torchrun does), got {raw!r}") from None
    rank, world_size, local_rank = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    device_id = None
    if "nccl" in backend:
        if not 0 <= local_rank < torch.cuda.device_count():
            raise RuntimeError(f"init_from_env (rank {rank}): LOCAL_RANK={local_rank} but "
                               f"{torch.cuda.device_count()} GPUs are visible")
        torch.cuda.set_device(local_rank)
        device = device_id = torch.device("cuda", local_rank)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)
    return device


def destroy() -> None:
    """Destroys the default process group, if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()

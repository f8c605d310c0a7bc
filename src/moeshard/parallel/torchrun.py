"""Running under torchrun: whether this process is one rank of a torchrun world
(``torchrun_environment``), joining its process group through ``env://`` (``init_from_env``), and
leaving it (``destroy``). Under torchrun the user's own rendezvous is used unchanged."""

from __future__ import annotations

import datetime
import errno
import os
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from moeshard.errors import TimedOut
from moeshard.parallel.held_stderr import stderr_held
from moeshard.parallel.worker import DEFAULT_TIMEOUT_S
from moeshard.validate import timeout

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
RENDEZVOUS_ERRORS = (dist.DistNetworkError, dist.DistStoreError)  # a rendezvous that did not answer in time


def torchrun_environment() -> bool:
    """Whether this process is one rank of a torchrun world, by torchrun's contract: it sets all
    of ``TORCHRUN_VARIABLES``. None set: False (moeshard starts its own local ranks). Some but
    not all (say a stale ``RANK``/``WORLD_SIZE`` left in a shell, without ``LOCAL_RANK``): a
    ValueError naming what is set and what is missing, rather than a silent switch of mode."""
    present = [name for name in TORCHRUN_VARIABLES if os.environ.get(name) is not None]
    if not present:
        return False
    missing = [name for name in TORCHRUN_VARIABLES if name not in present]
    if missing:
        raise ValueError(f"the environment sets {', '.join(present)} but not {', '.join(missing)}: torchrun sets all "
                         f"of {', '.join(TORCHRUN_VARIABLES)}. Start moeshard with torchrun, or unset "
                         f"{', '.join(present)} to run local ranks")
    return True


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Joins the process group torchrun describes (``env://``) and returns this rank's device.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_PORT`` (checked here;
    ``MASTER_ADDR``/``MASTER_PORT`` are then read by torch's env:// rendezvous, used unchanged).
    ``timeout_s`` (finite) bounds the rendezvous and every collective of the process group:
    the rendezvous runs on a helper thread that this one waits for at most ``timeout_s``, since
    torch's own bound does not hold (a port that accepts and never answers held it as long as
    the listener lived; an unreachable one, about twice ``timeout_s``), and a signal (Ctrl-C,
    SIGTERM) is answered while it waits. After ``TimedOut`` or a signal, the rendezvous may
    still be running on that thread: end the process. ``backend=None`` picks nccl when CUDA is
    available, else gloo; with nccl the current CUDA device is set to ``LOCAL_RANK``.  This is
    the only place moeshard reads environment variables (with ``torchrun_environment``).
    """
    if dist.is_initialized():
        raise RuntimeError("init_from_env: the default process group is already initialised")
    timeout("init_from_env", "timeout_s", timeout_s)
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = os.environ.get(name)
        try:
            values[name] = int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"init_from_env: environment variable {name} must be set to an integer "
                             f"(as torchrun does), got {raw!r}") from None
    rank, world_size, local_rank = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    # A rank outside the world would wait out the rendezvous for peers that never come.
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ValueError(f"init_from_env (rank {rank}): the environment needs WORLD_SIZE >= 1, 0 <= RANK < "
                         f"WORLD_SIZE and LOCAL_RANK >= 0 (as torchrun sets them), got RANK={rank}, "
                         f"WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}")
    port = os.environ.get("MASTER_PORT")
    if port is None or not port.strip().isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"init_from_env (rank {rank}): MASTER_PORT must be a port number in [1, 65535] (as torchrun "
                         f"sets it), got {port!r}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    device_id = None
    if "nccl" in backend:
        if not 0 <= local_rank < torch.cuda.device_count():
            raise ValueError(f"init_from_env (rank {rank}): LOCAL_RANK={local_rank} but "
                             f"{torch.cuda.device_count()} GPUs are visible")
        torch.cuda.set_device(local_rank)
        device = device_id = torch.device("cuda", local_rank)

    def join() -> None:
        if device_id is not None:  # the current CUDA device is the thread's own: the helper's too
            torch.cuda.set_device(device_id)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)

    where = f"MASTER_ADDR:MASTER_PORT={os.environ.get('MASTER_ADDR')}:{port}"
    late = f"rank {rank}: the torchrun rendezvous at {where} did not complete within {timeout_s:g} s (--timeout)"
    try:
        # torch's C++ log of a rendezvous that gives up or is given up (socket timeouts, a C++
        # backtrace) says what the one line below says: it is held back, and dropped in that case.
        with stderr_held(dropped_on=(*RENDEZVOUS_ERRORS, TimedOut, KeyboardInterrupt)):
            _bounded(join, timeout_s, late)
    except RENDEZVOUS_ERRORS as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if rank == 0 and ("EADDRINUSE" in str(exc) or os.strerror(errno.EADDRINUSE) in str(exc)):
            # Rank 0 serves the rendezvous: a port taken by another process is a setting to change.
            raise ValueError(f"rank 0: the torchrun rendezvous cannot listen at {where}: the port is in use "
                             f"(EADDRINUSE); choose a free MASTER_PORT") from None
        # The rendezvous torchrun describes did not answer (an unreachable MASTER_ADDR:MASTER_PORT,
        # or peers that never joined): one line naming where and for how long, not a traceback.
        raise TimedOut(f"{late}: {first}") from None
    return device


RENDEZVOUS_THREAD = "moeshard-rendezvous"


def rendezvous_pending() -> bool:
    """Whether a rendezvous that ``init_from_env`` gave up on (``TimedOut``, a signal) is still
    running on its helper thread, inside torch's C++ store client."""
    return any(t.name == RENDEZVOUS_THREAD and t.is_alive() for t in threading.enumerate())


def _bounded(join: Callable[[], None], timeout_s: float, late: str) -> None:
    """Runs ``join()`` on a daemon thread and waits for it at most ``timeout_s`` seconds: its
    exception is raised here, ``TimedOut(late)`` if it has not returned by then. The wait is
    interruptible, so this thread's signal handlers run while ``join`` blocks in C++."""
    done = threading.Event()
    raised: list[BaseException] = []

    def run() -> None:
        try:
            join()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            raised.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=RENDEZVOUS_THREAD, daemon=True).start()
    if not done.wait(timeout_s):
        raise TimedOut(late)
    if raised:
        raise raised[0]


def destroy() -> None:
    """Destroys the default process group, if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()

"""The processes of a local world: the loopback rendezvous store the parent owns (and which
ranks have joined through it), the start method the ranks are made with (spawned, or forked
from a fork server that imported torch once), what state a rank's process is in, and stopping
them within a bound."""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as torch_mp

from moeshard.parallel.worker import ARRIVED_KEY, JOINED_KEY, LOOPBACK

# The rendezvous store's own timeout is at least this: below a millisecond it rounds to zero and
# the store's construction fails. The run stays bounded by the caller's deadline.
MIN_STORE_TIMEOUT_S = 1.0


def rendezvous_store(world_size: int, timeout_s: float) -> tuple[Any, int]:
    """A TCPStore master listening on 127.0.0.1 on a port the OS picks (bound to port 0)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(max(world_size, 16))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # The store owns the listening socket from here on, and closes it itself when its
    # construction fails: closing it here too could close a descriptor reused in between.
    fd = sock.detach()
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=max(timeout_s, MIN_STORE_TIMEOUT_S)),
                          wait_for_workers=False, master_listen_fd=fd)
    return store, port


def rendezvous_progress(store: Any, world_size: int) -> tuple[set[int], set[int]]:
    """(the ranks that reached the rendezvous store, those that joined the process group), as
    they marked it in ``store``, the parent's (``moeshard.parallel.worker.rank_main`` sets the keys)."""
    def marked(prefix: str) -> set[int]:
        return {rank for rank in range(world_size) if store.check([f"{prefix}{rank}"])}
    return marked(ARRIVED_KEY), marked(JOINED_KEY)


# /proc/<pid>/stat's state letters that mean the process cannot run until someone lets it
_HALTED = {"T": "stopped by a signal (SIGSTOP or SIGTSTP)", "t": "stopped by a debugger (tracing stop)"}


def halted_state(pid: int) -> str:
    """Why process ``pid`` cannot run, in words (``"stopped by a signal (SIGSTOP or SIGTSTP)"``),
    or ``""`` when it can, is gone, or the system has no ``/proc`` to tell."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = raw[raw.rfind(")") + 2:].split()  # the command name, in parentheses, may hold spaces
    return _HALTED.get(fields[0], "") if fields else ""


def stop_processes(processes: list[Any], exit_wait_s: float) -> None:
    """Waits up to ``exit_wait_s`` for the children to exit, then terminates and kills the rest.

    A stopped child (SIGSTOP) keeps a SIGTERM pending until it is continued, so each terminated
    child is also sent SIGCONT: it then ends at once instead of after the wait for SIGTERM.
    Returns only once every child has exited.
    """
    processes = [p for p in processes if p.pid is not None]  # some may never have started
    deadline = time.monotonic() + exit_wait_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            if hasattr(signal, "SIGCONT"):
                try:
                    os.kill(process.pid, signal.SIGCONT)
                except ProcessLookupError:  # it ended in between
                    pass
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5.0)  # SIGKILL cannot be refused; the bound is only for a stuck kernel


def start_context(preload: tuple[str, ...]) -> Any:
    """The "spawn" context, or with ``preload`` the "forkserver" one: a fresh interpreter (started
    once per process, like a spawned rank) imports ``preload`` and forks every rank from there,
    so each rank skips importing torch (~1.7 s of CPU). Nothing of the calling process's state
    reaches the ranks either way. Where there is no forkserver (Windows), "spawn"."""
    if not preload or "forkserver" not in multiprocessing.get_all_start_methods():
        return torch_mp.get_context("spawn")
    ctx = torch_mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *preload])  # used when the server starts: the first world
    return ctx


def start_fork_server(preload: tuple[str, ...]) -> None:
    """Starts the fork server of ``LocalWorld(..., preload=preload)`` now, so that it imports
    while the caller does other work (it starts with the first world otherwise). Returns at once;
    a no-op where there is no fork server or it runs already."""
    if start_context(preload).get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()

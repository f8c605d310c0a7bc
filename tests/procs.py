"""Processes of a ``moeshard`` command started by a test: start it in its own session (process
group), find its ranks, send signals, and prove that none of its processes survives (via /proc:
psutil is not a dependency)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def start(argv: list[str], *, code: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m moeshard ARGV`` (or ``python -c CODE ARGV``) in a new session, so that the
    command and every process it starts share one process group (pgid == the command's pid)."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]), **(env or {}))
    cmd = [sys.executable, "-c", code, *argv] if code is not None else [sys.executable, "-m", "moeshard", *argv]
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=default_sigint)


def default_sigint() -> None:
    """A test suite started in the background of a shell (``make test &``) inherits SIGINT
    ignored, and Python then keeps ignoring it: the command under test must see Ctrl-C as a
    terminal user's command would. Give it as ``preexec_fn`` to any command a test signals."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def live_in_group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that are still running (zombies, already dead but not
    yet reaped by whoever adopted them, do not count)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[2] == pgid and stat[0] not in ("Z", "X"):
                pids.append(int(entry))
    return pids


def _is_rank(pid: int) -> bool:
    """A multiprocessing "spawn" child, or a process the fork server forked (``moeshard check``
    starts its ranks that way: they carry the server's command line, the server is their parent)."""
    if "spawn_main" in _cmdline(pid):
        return True
    stat = _stat(pid)
    return (stat is not None and "multiprocessing.forkserver" in _cmdline(pid)
            and "multiprocessing.forkserver" in _cmdline(stat[1]))


def ranks_of(pgid: int) -> list[int]:
    """The ranks running in process group ``pgid``, by pid."""
    return sorted(pid for pid in live_in_group(pgid) if _is_rank(pid))


def has_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped. A spawned rank imports torch while it
    unpickles its process object, which the parent writes, whole, just after starting it: from
    then on the rank no longer reads from its parent, and a parent killed then leaves it no
    half-read pipe (killed earlier, the rank's ``spawn_main`` dies on an EOFError traceback)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def wait_for(predicate, timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    """Waits for the command (killing its whole group if it overruns: the test then fails);
    returns (exit code, output)."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the command did not end within {timeout_s} s; output:\n{out.decode()[-3000:]}") from None
    return proc.returncode, out.decode(errors="replace")


def assert_no_survivors(pgid: int, timeout_s: float = 15.0) -> None:
    """Every process the command started is gone within ``timeout_s`` (killed with its group
    afterwards if not, so a failing test leaves nothing behind)."""
    if not wait_for(lambda: not live_in_group(pgid), timeout_s, 0.2):
        left = {pid: _cmdline(pid)[:120] for pid in live_in_group(pgid)}
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise AssertionError(f"processes of the command outlived it by {timeout_s} s: {left}")

"""Wall and CPU time of a command and of every process it starts (Linux).

    python3 scripts/cpu_time.py [-v] -- moeshard check --json /tmp/check.json     # -v: per process

``/usr/bin/time`` counts a process's descendants only once they are reaped by it; the ranks of
``moeshard check`` are forked by a fork server (see ``moeshard.parallel.spawn``) that outlives
the command, so their CPU time would be missing. This runs the command in a session of its own
and samples ``/proc`` every 20 ms: CPU = the sum over every process of that session of its last
seen user + system time (a process's last < 20 ms may be missed). It also prints the machine's
busy time over the run (``/proc/stat``, all processes, so only meaningful on an idle machine)
and the load average before and after, to say how busy the machine was.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def _session_cpu(sid: int, seen: dict[int, float], names: dict[int, str]) -> None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is field 3 (state): session is field 6, utime 14, stime 15
        if int(fields[3]) == sid:
            seen[int(entry)] = (int(fields[11]) + int(fields[12])) / TICK
            if int(entry) not in names:
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        names[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
                except OSError:
                    names[int(entry)] = "?"


def _busy() -> float:
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    return (sum(cpu) - cpu[3] - cpu[4]) / TICK  # all but idle and iowait


def main() -> int:
    args = sys.argv[1:]
    verbose = args[:1] == ["-v"]
    if verbose:
        args = args[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        raise SystemExit(__doc__)
    load = os.getloadavg()
    busy0, start = _busy(), time.perf_counter()
    proc = subprocess.Popen(args, start_new_session=True)
    seen: dict[int, float] = {}
    names: dict[int, str] = {}
    while proc.poll() is None:
        _session_cpu(proc.pid, seen, names)
        time.sleep(0.02)
    wall = time.perf_counter() - start
    _session_cpu(proc.pid, seen, names)  # what is left of the session (the fork server exiting)
    busy = _busy() - busy0
    if verbose:
        for pid, cpu in sorted(seen.items()):
            print(f"cpu_time: pid {pid}: {cpu:6.1f} s  {names.get(pid, '?')}", file=sys.stderr)
    print(f"cpu_time: {wall:.1f} s wall, {sum(seen.values()):.1f} s CPU in {len(seen)} processes of the run; "
          f"machine busy {busy:.1f} CPU-s on {os.cpu_count()} cores; load average before "
          f"{load[0]:.2f}, after {os.getloadavg()[0]:.2f}; exit code {proc.returncode}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())

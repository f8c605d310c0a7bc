"""Bounds of the local ranks' plumbing: a last report nobody reads does not keep a rank alive,
and the rendezvous listens on loopback only, on a port of its own."""

from __future__ import annotations

import time
from pathlib import Path

import faults
import torch.multiprocessing as torch_mp

from moeshard.parallel.processes import rendezvous_store
from moeshard.parallel.spawn import spawn
from moeshard.parallel.worker import EXIT_REPORT_STUCK


def test_a_report_nobody_reads_does_not_keep_the_rank_alive():
    ctx = torch_mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=faults.report_nobody_reads, args=(queue,), daemon=True)
    start = time.monotonic()
    process.start()
    process.join(60)
    try:
        assert process.exitcode == EXIT_REPORT_STUCK, process.exitcode
        assert time.monotonic() - start < 60
    finally:
        if process.is_alive():
            process.kill()
        queue.close()
        queue.cancel_join_thread()


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if int(hex_port, 16) == port and state == "0A":
                found.add(address)
    return found


def test_rendezvous_listens_on_loopback_only_and_two_runs_get_their_own_ports():
    (store_a, port_a), (store_b, port_b) = rendezvous_store(2, 10.0), rendezvous_store(2, 10.0)
    assert port_a != port_b
    for port in (port_a, port_b):
        assert _listening(port) == {"0100007F"}, _listening(port)  # 127.0.0.1, nothing else
    del store_a, store_b


def test_gloo_stays_on_loopback():
    assert spawn(faults.gloo_interface, 2, timeout_s=120) == ["lo", "lo"]

"""Timing on the GPU: CUDA events around each repetition, median of several.

Every repetition is preceded by an L2 flush (a write of a buffer larger than the cache, outside
the timed region), so decode shapes whose weights would otherwise stay in L2 between
repetitions are timed as they run in a model, reading weights from HBM. ``graphed`` captures a
callable in a CUDA graph, as a serving engine runs a layer, so host launch overhead is not
counted; eager timing is kept for code that cannot be captured (the per-expert loop).

Memory handed back to the driver slows HBM reads for a while after it: on one H200, a plain read
of 352 MB took 113 us instead of 101.6 us right after 16 GiB had been released, and a one-token
DeepSeek-V3 experts call 117 us instead of 107 (``scripts/after_prefill_probe.py --states``).
``torch.cuda.graph`` releases the allocator's cache when a capture begins, so a case captured
right after a large one (a one-token step after a 16384-token prefill) was timed while the
driver worked on the memory the large one left. ``graphed`` releases that memory itself before
capturing and, where the release was large, waits it out (``release_memory``).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median, fastest and slowest of ``reps`` repetitions."""

    median_ms: float
    min_ms: float
    max_ms: float
    reps: int

    def as_dict(self) -> dict:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms, "reps": self.reps}


class L2Flush:
    """Overwrites a buffer of several times the L2 size before each timed repetition."""

    def __init__(self, device: torch.device) -> None:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20)
        self.buffer = torch.empty(max(4 * l2, 256 * 2**20) // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()


# A release at least this large is waited out for RELEASE_SETTLE_S before anything is timed.
RELEASE_SETTLE_BYTES = 256 * 2**20
RELEASE_SETTLE_S = 0.3


def release_memory(collect: bool = False) -> int:
    """Hands the caching allocator's unused memory back to the driver (``torch.cuda.empty_cache``;
    collect: ``gc.collect()`` first) and, where at least ``RELEASE_SETTLE_BYTES`` went back, waits
    ``RELEASE_SETTLE_S`` so that the driver's work on it does not overlap a timing. Returns the
    bytes released (current device)."""
    if collect:
        gc.collect()
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    released = before - torch.cuda.memory_reserved()
    if released >= RELEASE_SETTLE_BYTES:
        torch.cuda.synchronize()
        time.sleep(RELEASE_SETTLE_S)
    return released


def time_host(fn: Callable[[], object], *, warmup: int, reps: int) -> Timing:
    """Wall-clock timing of ``fn`` on the host (CPU ranks: the distributed bench's plumbing runs
    there too; its figures say nothing about GPUs)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return Timing(statistics.median(times), min(times), max(times), reps)


def time_cuda(fn: Callable[[], object], *, warmup: int, reps: int, flush: L2Flush | None) -> Timing:
    """Runs ``fn`` ``warmup`` times, then times ``reps`` calls with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        if flush is not None:
            flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return Timing(statistics.median(times), min(times), max(times), reps)


class graphed:
    """``fn`` captured in a CUDA graph; calling the object replays it.

    ``fn`` is run three times on a side stream first (Triton compilation, cuBLAS handles and
    allocator pools must exist before capture). Then the allocator's unused memory (what earlier
    cases and these runs left) is released and waited out (``release_memory``), so that the
    capture's own ``empty_cache`` has nothing large left to hand back before the replays are
    timed. ``output`` holds the captured result tensor(s).
    """

    def __init__(self, fn: Callable[[], object]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        release_memory()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn()

    def __call__(self) -> None:
        self.graph.replay()

    def release(self) -> None:
        """Frees the graph's memory pool (large at prefill sizes)."""
        self.output = None
        self.graph.reset()


def graph_median_ms(fn: Callable[[], object], *, reps: int, flush: L2Flush | None, warmup: int = 2) -> float:
    """Median ms of ``fn`` captured in a CUDA graph (``graphed``), replayed ``warmup`` times and
    then ``reps`` timed times, each after ``flush``; the graph's memory is released after."""
    g = graphed(fn)
    try:
        return time_cuda(g, warmup=warmup, reps=reps, flush=flush).median_ms
    finally:
        g.release()


def alternating_medians(calls: dict[str, Callable[[], object]], *, rounds: int, reps: int,
                        flush: L2Flush | None) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Times every callable of ``calls`` with ``graph_median_ms``, ``rounds`` times in turn (each
    round times each callable once, in order), so drift over the run spreads over all of them
    instead of reading as a difference between them. Returns (each key's times per round, each
    key's median over the rounds), in ms."""
    times: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key].append(graph_median_ms(fn, reps=reps, flush=flush))
    return times, {key: statistics.median(v) for key, v in times.items()}


def kernel_times(fn: Callable[[], object], reps: int = 5) -> list[tuple[str, float]]:
    """(kernel name, GPU microseconds per call of ``fn``), largest first, from the CUDA profiler
    over ``reps`` calls after three warm-up calls (the profile scripts' attribution)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / reps) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])

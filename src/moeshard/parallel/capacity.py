"""How many local ranks this machine can hold: usable cores, available memory, and the refusal
of a world larger than that (``check_local_world``), before anything starts."""

from __future__ import annotations

import os

import torch

from moeshard.validate import positive_int

# Local CPU ranks: each is an interpreter with torch loaded (a few hundred MB) that mostly waits
# on its peers, so a few share a core well (the default check runs 4 ranks on 2 cores).
RANKS_PER_CORE = 8
RANK_MEMORY_BYTES = 256 * 2**20


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS says, else the count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_local_world(world_size: int, device: str = "cpu", what: str = "LocalWorld") -> None:
    """Refuses (ValueError) a world of local ranks this machine cannot hold: more ranks than
    GPUs on CUDA; more than ``RANKS_PER_CORE`` per usable core, or more than the available
    memory at ``RANK_MEMORY_BYTES`` per rank, on CPU. Cheap; call it before any other work."""
    positive_int(what, "world_size", world_size)
    if device == "cuda":
        if world_size > torch.cuda.device_count():
            raise ValueError(f"{what}: world_size={world_size} needs {world_size} GPUs (one per rank) but "
                             f"{torch.cuda.device_count()} are visible")
        return
    cores = usable_cores()
    if world_size > RANKS_PER_CORE * cores:
        raise ValueError(f"{what}: world_size={world_size} local CPU ranks is more than this machine can run: "
                         f"{cores} usable cores, at most {RANKS_PER_CORE} ranks per core")
    memory = available_memory()
    if memory is not None and world_size * RANK_MEMORY_BYTES > memory:
        raise ValueError(f"{what}: world_size={world_size} local ranks need about "
                         f"{world_size * RANK_MEMORY_BYTES / 2**30:.1f} GiB ({RANK_MEMORY_BYTES // 2**20} MiB each) "
                         f"but {memory / 2**30:.1f} GiB of memory is available")

"""The benchmark's machine: refuse without CUDA, describe what runs it."""

from __future__ import annotations

import datetime
import platform

import torch


def require_cuda() -> torch.device:
    """The current CUDA device; ``ValueError`` (exit code 2 from the CLI) where there is none."""
    if not torch.cuda.is_available():
        raise ValueError(f"bench needs a CUDA GPU, and torch.cuda.is_available() is False here "
                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
                         "run it on a machine with an NVIDIA GPU")
    return torch.device("cuda", torch.cuda.current_device())


def describe(device: torch.device) -> dict:
    """Device name, compute capability, multiprocessors, memory, software versions, UTC date."""
    props = torch.cuda.get_device_properties(device)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }

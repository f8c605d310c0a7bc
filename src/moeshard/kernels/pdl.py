"""Programmatic dependent launch (PDL) for the experts' chain of kernels (Hopper and later).

    tile plan --> gate_up GEMM --> quantize_h (and fp8_token's row max) --> down GEMM

A kernel launched with PDL may start while the kernel before it in the stream still runs: its
programs become resident as soon as every program of that kernel has signalled
(``gdc_launch_dependents``), and they block at ``gdc_wait`` until it has finished and its
writes are visible. At decode each of these kernels runs a few microseconds, so the launch gaps and the
ramp of every kernel are a large share of the step; PDL overlaps them with the kernel before.

The contract every kernel here keeps, which makes the chain safe with any neighbours: every
program calls ``enter`` first, so it waits for the kernel ahead before it touches memory that
kernel (or any before it) may write, and before it exits. A kernel therefore never completes
before the one ahead of it, and, by induction, the completion of any kernel implies that of
every kernel before it in the stream, as without PDL. Only then does it let the next kernel
start, so waiting programs of at most one kernel ahead hold SM slots.

A kernel launched without PDL, or one after a kernel that never signals (torch's, NCCL's),
starts when that kernel completes, as any launch does; the wait then returns at once.
Triton's interpreter has neither instruction, so the kernels take these paths on CUDA only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with PDL: an NVIDIA CUDA device of compute
    capability 9.0 or later (the ``griddepcontrol`` instructions) and a Triton that has them.
    ROCm builds also name their devices "cuda" and report their own capability numbers, which
    say nothing about these instructions."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (9, 0) and hasattr(tl.extra.cuda, "gdc_wait")


def launch_options(pdl: bool) -> dict:
    """Keyword arguments of a Triton launch: PDL's launch attribute when ``pdl``, else none
    (the interpreter and older Tritons take no such option)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def enter(PDL: tl.constexpr):
    """A kernel's first statement. Under PDL: block until the kernel before this one has
    completed and its writes are visible, then let the next kernel in the stream (if launched
    with PDL) start its programs. Without PDL: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

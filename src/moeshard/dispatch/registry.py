"""The one support registry: which backend runs which layouts and quantizations.

The layer refuses an unsupported combination with ``support(...)``'s reason, and the
verification matrix skips it with the same reason; ``moeshard backends`` prints this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moeshard.config import QUANT_SCHEMES, QuantConfig
from moeshard.parallel.config import ParallelConfig


@dataclass(frozen=True)
class BackendSpec:
    """name; quants it moves; layouts: "ep" (needs EP on) or "no_ep" (needs EP off);
    quantize_before_dispatch: whether quantized payloads may cross it (else it needs deferral);
    side_group_on: devices on which it needs ``ParallelGroups.side_group``; summary: one line."""

    name: str
    quants: tuple[str, ...]
    layouts: str
    quantize_before_dispatch: bool
    side_group_on: tuple[str, ...]
    summary: str
    factory: Callable


def _local(num_experts, groups):
    from moeshard.dispatch.local import LocalBackend
    return LocalBackend(num_experts)


def _agrs(num_experts, groups):
    from moeshard.dispatch.allgather_reducescatter import AllGatherReduceScatterBackend
    return AllGatherReduceScatterBackend(num_experts, groups)


def _a2a(num_experts, groups):
    from moeshard.dispatch.all2all import All2AllBackend
    return All2AllBackend(num_experts, groups)


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec("local", QUANT_SCHEMES, "no_ep", True, (),
                    "no expert parallelism: each rank computes all (TP-sliced) experts for its tokens", _local),
        BackendSpec("allgather_reducescatter", QUANT_SCHEMES, "ep", True, (),
                    "all-gather tokens+routing over EP, local experts, reduce-scatter back (uneven)", _agrs),
        BackendSpec("all2all", QUANT_SCHEMES, "ep", True, ("cuda",),
                    "exchange counts, uneven all-to-all of routed copies only, reverse", _a2a),
    )
}


def support(backend: str, quant: QuantConfig, parallel: ParallelConfig) -> tuple[bool, str]:
    """(ok, reason) for running ``backend`` with ``quant`` under ``parallel``."""
    spec = BACKENDS.get(backend)
    if spec is None:
        return False, f"unknown backend {backend!r}; known: {sorted(BACKENDS)}"
    if quant.scheme not in spec.quants:
        return False, f"{backend} does not support quant {quant.scheme!r}"
    if spec.layouts == "ep" and not parallel.enable_ep:
        return False, f"{backend} needs expert parallelism (EP on); layout {parallel.name} has EP off"
    if spec.layouts == "no_ep" and parallel.enable_ep:
        return False, f"{backend} runs without expert parallelism only; layout {parallel.name} has EP on"
    if quant.quantized and not quant.defer_input_quant and not spec.quantize_before_dispatch:
        return False, f"{backend} cannot move quantized activations; use defer_input_quant=True"
    return True, ""


def default_backend(parallel: ParallelConfig) -> str:
    return "all2all" if parallel.enable_ep else "local"

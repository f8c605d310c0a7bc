"""The one support registry: which backend runs which layouts and quantizations.

Each entry says, as data, what a backend supports and produces; ``support`` turns it into a
refusal with a reason. The layer refuses an unsupported combination with that reason before
any collective, the verification matrix lists it as not applicable with the same reason, and
``moeshard backends`` prints this table. Adding a backend is one module in ``dispatch/`` and one
``register_backend`` entry (see CONTRIBUTING.md).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeshard.config import QuantConfig
from moeshard.experts.base import FLAT, LAYOUTS
from moeshard.parallel.config import ParallelConfig
from moeshard.quant.schemes import scheme_names

if TYPE_CHECKING:
    from moeshard.dispatch.base import BackendContext, DispatchBackend
    from moeshard.parallel.groups import ParallelGroups
    from moeshard.parallel.trace import CollectiveTrace

# BackendContext -> the backend (``moeshard.dispatch.base``: cfg, quant, groups, max_tokens, recorder).
Factory = Callable[["BackendContext"], "DispatchBackend"]


@dataclass(frozen=True)
class BackendSpec:
    """One backend, as data.

    name: what ``MoELayer(backend=...)`` takes. layouts: ``"ep"`` (needs EP on) or ``"no_ep"``
    (needs EP off). output: the ``ExpertInput`` layout its dispatch hands the experts
    (``moeshard.experts.base.LAYOUTS``). quantize_before_dispatch: whether quantized payloads may
    cross it (else it needs ``defer_input_quant``). side_group_on: device types on which it needs
    ``ParallelGroups.side_group`` (a gloo group for host-side metadata). summary: one line.
    factory: ``BackendContext -> DispatchBackend``. quants: the schemes it
    moves, or None for every registered scheme (a backend that moves rows as opaque bytes supports
    any). needs_max_tokens: it sizes fixed buffers from ``MoELayer(max_tokens_per_rank=...)``.
    graph_safe: dispatch and combine never synchronise with the host, so a forward through it can
    be captured in a CUDA graph. backward: it implements ``dispatch.base.DifferentiableBackend``
    (the reverse communication of dispatch and combine), so gradients flow through it.
    combine_final: it has ``combine_final`` (``dispatch.base.FinalCombineBackend``: the combine that
    also adds the shared experts and rounds to the model dtype in one pass), which the layer's
    forward then calls where nothing sits between the two.
    payload_first: it has ``dispatch_payload`` (``dispatch.base.PayloadFirstBackend``: dispatch
    from the payload of x made beforehand; its payload needs neither the routing nor a
    collective), so the layer's forward on CUDA makes the payload on a side stream while it routes.
    combine_skips_empty: its combine (and ``combine_final``) adds nothing for a pair of id -1 (an
    empty pick, ``Routing.empty_picks``) whatever the experts' output row of that pair holds, so
    the layer's forward hands it those rows as the experts left them; for any other backend the
    layer first zeroes them in a pass over the experts' output.
    """

    name: str
    layouts: str
    output: str
    quantize_before_dispatch: bool
    side_group_on: tuple[str, ...]
    summary: str
    factory: Factory
    quants: tuple[str, ...] | None = None
    needs_max_tokens: bool = False
    graph_safe: bool = False
    backward: bool = False
    combine_final: bool = False
    payload_first: bool = False
    combine_skips_empty: bool = False

    def supported_quants(self) -> tuple[str, ...]:
        return scheme_names() if self.quants is None else self.quants


def _local(ctx):
    from moeshard.dispatch.local import LocalBackend
    return LocalBackend(ctx)


def _agrs(ctx):
    from moeshard.dispatch.allgather_reducescatter import AllGatherReduceScatterBackend
    return AllGatherReduceScatterBackend(ctx)


def _a2a(ctx):
    from moeshard.dispatch.all2all import All2AllBackend
    return All2AllBackend(ctx)


def _low_latency(ctx):
    from moeshard.dispatch.low_latency import LowLatencyBackend
    return LowLatencyBackend(ctx)


BACKENDS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> BackendSpec:
    """Adds ``spec`` to the registry after checking its fields; returns it."""
    where = f"register_backend({spec.name!r})"
    if spec.name in BACKENDS:
        raise ValueError(f"{where}: a backend of that name is registered already")
    if spec.layouts not in ("ep", "no_ep"):
        raise ValueError(f"{where}: layouts must be 'ep' or 'no_ep', got {spec.layouts!r}")
    if spec.output not in LAYOUTS:
        raise ValueError(f"{where}: output must be one of {list(LAYOUTS)}, got {spec.output!r}")
    if not callable(spec.factory):
        raise ValueError(f"{where}: factory must be callable, got {spec.factory!r}")
    BACKENDS[spec.name] = spec
    return spec


def unregister_backend(name: str) -> None:
    """Removes a backend (tests that register one of their own clean up with this)."""
    BACKENDS.pop(name, None)


for _spec in (
    BackendSpec("local", "no_ep", FLAT, True, (),
                "no expert parallelism: each rank computes all (TP-sliced) experts for its tokens", _local,
                graph_safe=True, backward=True, combine_final=True, payload_first=True, combine_skips_empty=True),
    BackendSpec("allgather_reducescatter", "ep", FLAT, True, (),
                "all-gather tokens+routing over EP, local experts, reduce-scatter back (uneven)", _agrs,
                backward=True, combine_skips_empty=True),
    BackendSpec("all2all", "ep", FLAT, True, ("cuda",),
                "exchange counts, uneven all-to-all of routed copies only, reverse", _a2a, backward=True,
                combine_skips_empty=True),
    BackendSpec("low_latency", "ep", FLAT, True, (),
                "fixed-capacity buffers, one packed equal-split all-to-all each way; no host sync "
                "(CUDA-graph capturable); needs max_tokens_per_rank", _low_latency,
                needs_max_tokens=True, graph_safe=True, backward=True, combine_skips_empty=True),
):
    register_backend(_spec)


def support(backend: str, quant: QuantConfig, parallel: ParallelConfig, *, device: str | None = None,
            has_side_group: bool | None = None, kernel_layouts: tuple[str, ...] | None = None,
            has_max_tokens: bool | None = None) -> tuple[bool, str]:
    """(ok, reason) for running ``backend`` with ``quant`` under ``parallel``.

    The optional facts are checked when given: ``device`` (a device type) with
    ``has_side_group`` (whether ``ParallelGroups.side_group`` exists) against ``side_group_on``;
    ``kernel_layouts`` (the expert kernel's ``layouts``) against the backend's ``output``;
    ``has_max_tokens`` (whether the layer has ``max_tokens_per_rank``) against
    ``needs_max_tokens``.
    """
    spec = BACKENDS.get(backend)
    if spec is None:
        return False, f"unknown backend {backend!r}; known: {sorted(BACKENDS)}"
    if quant.scheme not in spec.supported_quants():
        return False, f"{backend} does not support quant {quant.scheme!r}"
    if spec.layouts == "ep" and not parallel.enable_ep:
        return False, f"{backend} needs expert parallelism (EP on); layout {parallel.name} has EP off"
    if spec.layouts == "no_ep" and parallel.enable_ep:
        return False, f"{backend} runs without expert parallelism only; layout {parallel.name} has EP on"
    if quant.quantized and not quant.defer_input_quant and not spec.quantize_before_dispatch:
        return False, f"{backend} cannot move quantized activations; use defer_input_quant=True"
    if device is not None and device in spec.side_group_on and has_side_group is False:
        return False, (f"{backend} on {device} needs a gloo side channel for its counts, but "
                       "ParallelGroups.side_group is None; build the groups with "
                       "ParallelGroups.build(config, side_channel=True)")
    if has_max_tokens is False and spec.needs_max_tokens:
        return False, (f"{backend} keeps fixed-capacity buffers: give MoELayer(max_tokens_per_rank=...), the most "
                       "tokens one forward hands a rank")
    if kernel_layouts is not None and spec.output not in kernel_layouts:
        return False, (f"{backend} hands the experts {spec.output!r} rows, but the expert kernel accepts "
                       f"{list(kernel_layouts)}")
    return True, ""


def side_group_needed(parallel: ParallelConfig, device: str, backends: Iterable[str] | None = None) -> bool:
    """Whether any of ``backends`` (default: every registered one) needs ``ParallelGroups.side_group``
    on ``device`` (a device type) under ``parallel``. Only EP backends move rows between ranks, so
    without EP no backend needs one (``ParallelGroups.build`` makes none)."""
    names = list(BACKENDS) if backends is None else list(backends)
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"side_group_needed: unknown backend(s) {unknown}; known: {sorted(BACKENDS)}")
    return parallel.enable_ep and any(device in BACKENDS[n].side_group_on for n in names)


def build_groups(parallel: ParallelConfig, device: str, backends: Iterable[str] | None = None, *,
                 trace: CollectiveTrace | None = None, timeout: datetime.timedelta | None = None) -> ParallelGroups:
    """The process groups of ``parallel`` for running ``backends`` (default: any registered one) on
    ``device`` ("cpu" or "cuda"): with the gloo side group exactly where a backend's entry says it
    needs one. Call on every rank together, as ``ParallelGroups.build``."""
    from moeshard.parallel.groups import ParallelGroups

    return ParallelGroups.build(parallel, side_channel=side_group_needed(parallel, device, backends),
                                timeout=timeout, trace=trace)


def ep_backends() -> tuple[str, ...]:
    """The registered backends that run with expert parallelism, in registration order."""
    return tuple(n for n, spec in BACKENDS.items() if spec.layouts == "ep")


def default_backend(parallel: ParallelConfig) -> str:
    return "all2all" if parallel.enable_ep else "local"

"""``MoELayer``: one MoE block under any (dp, tp, ep) layout.

    x [T, H]  this DP rank's tokens (replicated over its TP ranks)
     -> SP only: keep this TP rank's contiguous chunk (real rows only)
     -> router: logits [T, E] (+ router bias) in ``cfg.router_dtype`` (fp32, or the model dtype
        rounded) -> topk ids / fp32 weights [T, K], selected and weighted in fp32
     -> weights on the input (Llama-4's kind): each (token, k) becomes a row x * w of its own,
        routed to its one expert with weight 1, and the K rows' outputs are summed
     -> quantize activations (unless none or deferred): data + per-row scales
     -> dispatch (backend) -> experts (grouped kernel) -> combine (backend): fp32 [T, H]
     -> TP without EP: all-reduce the partial sums over TP
     -> + shared experts (model dtype, or quantized per row or block with ``QuantConfig.shared``;
        on the same rows, once; times ``cfg.shared_scale``), the
        sum in fp32 rounded once to the model dtype (forward without TP reduction: inside the
        backend's combine, ``combine_final``)
     -> SP only: all-gather over TP, drop the padding -> [T, H]

The backend (``moeshard.dispatch``) owns the middle three steps' wire format: it quantizes
(per-tensor activation scales are dynamic over the quantization domain, the EP group when EP is
on, this DP rank's tokens otherwise; see ``moeshard.dispatch.payload``), moves rows and scales,
and hands the experts their input; the layer only routes, runs the kernel and reduces. So the
single-device reference on the same tokens reproduces every quantization exactly.

Training: when x or a parameter requires grad (and grad mode is on), every collective above runs
as an autograd Function whose backward is the reverse communication (``moeshard.autograd``),
under the replicated loss: the TP ranks of a DP rank compute the same loss from the same output.
The experts then run on the portable ``GroupedExperts`` (the Triton kernels are forward only).
Which combinations have a backward: ``moeshard.autograd.support``; which gradients a training
loop must then reduce over which group: ``moeshard.training``. Nothing requires grad: the
forward is the inference path, unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from moeshard.autograd import routed as differentiable
from moeshard.autograd.collectives import gather_rows, shard_rows, tp_copy, tp_reduce
from moeshard.autograd.roles import GradRole, layer_role
from moeshard.autograd.support import backward_refusal
from moeshard.config import MoEConfig, QuantConfig, dtype_name
from moeshard.dispatch.base import BackendContext, DispatchBackend, FinalCombineBackend, PayloadFirstBackend
from moeshard.dispatch.payload import Payload
from moeshard.dispatch.registry import BACKENDS, default_backend, support
from moeshard.eplb.loads import LoadCounter
from moeshard.eplb.moves import MoveStats, move_slots, plan_moves
from moeshard.eplb.placement import Placement, choose_replicas
from moeshard.experts.base import ExpertKernel, ExpertWeights
from moeshard.experts.grouped import GroupedExperts
from moeshard.experts.shared import QuantizedSharedMLP
from moeshard.kernel_choice import select_kernel
from moeshard.layer_agreement import check_same_on_all_ranks, code, placement_code
from moeshard.layer_params import Gate, RoutedExperts, SharedExperts
from moeshard.parallel.collectives import all_reduce
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.sequence import SequenceChunk, sequence_parallel_chunk, sequence_parallel_gather
from moeshard.parallel.trace import traced
from moeshard.quant import QuantizedActivations, to_wire
from moeshard.router import Routing, route_tokens, weighted_rows
from moeshard.sharding import shard_experts, shard_spec
from moeshard.stages import StageRecorder
from moeshard.validate import is_int
from moeshard.weights import SHARED_ALIASES, MoEWeights

_EXCHANGED = ("num_experts", "top_k", "hidden_size", "intermediate_size", "expert_bias", "dtype")


def _config_fields(cfg: MoEConfig) -> dict[str, object]:
    """cfg's fields that the layer's configuration exchange holds no column of their own for."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _EXCHANGED}


def _record_dispatched(rec: StageRecorder, inp, slot_expert: torch.Tensor) -> None:
    """The experts' input as received (wire views, so that bytes can be compared), with each
    row's global logical expert id (-1 padding): slot_expert int64 [S] is the logical expert of
    each of this rank's slots."""
    x = inp.x
    if isinstance(x, QuantizedActivations):
        rows, scale, tensor_scale = to_wire(x.data), None if x.row_scale is None else to_wire(x.row_scale), x.tensor_scale
    else:
        rows, scale, tensor_scale = x, None, None
    ids = inp.expert_ids
    logical = torch.where(ids >= 0, slot_expert[ids.clamp_min(0)], torch.full_like(ids, -1))
    rec.record("dispatch", rows=rows, row_scale=scale, tensor_scale=tensor_scale, expert_ids=logical,
               repeat=inp.repeat, first_expert=0)


def _final_combiner(backend: DispatchBackend, declared: bool) -> Callable[..., torch.Tensor] | None:
    """``backend.combine_final`` where its registry entry declares one (``BackendSpec.combine_final``),
    else None; a declared method the backend lacks is refused when the layer is built."""
    if not declared:
        return None
    method = getattr(backend, "combine_final", None)
    if not callable(method):
        raise TypeError(f"{backend.name}: its registry entry says combine_final=True but the backend has no "
                        f"combine_final (moeshard.dispatch.base.FinalCombineBackend)")
    return cast(FinalCombineBackend, backend).combine_final


def _payload_first(backend: DispatchBackend, declared: bool) -> PayloadFirstBackend | None:
    """The backend as a ``PayloadFirstBackend`` where its registry entry declares it
    (``BackendSpec.payload_first``), else None; a declared backend without the methods is
    refused when the layer is built. The layer calls its methods at each forward (not bound
    once), so a check that wraps ``backend.dispatch_payload`` sees every call."""
    if not declared:
        return None
    if not (callable(getattr(backend, "dispatch_payload", None)) and callable(getattr(backend, "payload", None))):
        raise TypeError(f"{backend.name}: its registry entry says payload_first=True but the backend has no "
                        f"payload and dispatch_payload (moeshard.dispatch.base.PayloadFirstBackend)")
    return cast(PayloadFirstBackend, backend)


_T = TypeVar("_T")


class MoELayer(nn.Module):
    """One MoE block.

    cfg: model shape and routing; quant: expert quantization; groups: process groups of an
    initialised torch.distributed world (None: one device); backend: a name from
    ``moeshard.dispatch.registry.BACKENDS`` (default: ``local`` without EP, ``all2all`` with EP);
    weights: full canonical weights, identical on every rank (None: random, from torch's RNG);
    local_experts: this rank's routed experts already sharded (and quantized) for ``quant`` and
    the layout, e.g. read slice by slice from a checkpoint; then ``weights.gate_up`` and
    ``weights.down`` may be None;
    device: where this rank computes (default ``groups.device`` or CPU);
    max_tokens_per_rank: the most tokens one ``forward`` hands a rank (None: unbounded); backends
    with fixed-capacity buffers (``low_latency``) need it, and ``forward`` refuses more;
    recorder: a ``moeshard.stages.StageRecorder`` that keeps a copy of every stage of the next
    forward on this rank (``moeshard check --explain``); None: nothing is recorded;
    placement: expert-parallel load balancing (``moeshard.eplb.Placement``, EP on): E logical
    experts on P * S physical slots, hot experts with several replicas (None: no redundancy);
    load_window: forwards over which ``expert_loads`` counts tokens per logical expert;
    shared_stored: the shared MLP quantized with ``quant.shared`` as one expert (gate_up [1, 2S,
    H], down [1, H, S]), as an fp8 checkpoint stores it (``LoadedBlock.shared_stored``): run as
    stored while ``weights``' shared tensors are its dequantization (``QuantizedSharedMLP``);
    empty_picks: the routing may hold empty picks (id -1, ``Routing.empty_picks``), as
    ``MoEExperts`` gives for zero-computation experts; a layer that routes itself gives none.
    Backends with fixed-capacity buffers size them for these picks too.

    With a placement the router's logical ids become slot ids right after routing
    (``physical_ids``: deterministic, identical on every rank that sees a token); the backend is
    built for the P * S slots, each rank's kernel computes its S slots, and a replica's weights
    are its logical expert's. Outputs do not depend on the placement. ``rebalance`` changes it
    at run time, moving only the slots whose expert changed.

    On CUDA the shared experts run on a side stream while the routed path is dispatched and
    computed (``overlap_shared``, default on), and are joined before they are added. Where the
    backend's payload needs neither the routing nor a collective (``BackendSpec.payload_first``:
    the local backend), the forward makes it (the input's amax and quantization, for per-tensor
    scales) on another side stream while it routes (``overlap_payload``, default on CUDA; not
    under autograd or the stage recorder).

    Cross-rank precondition: every rank of the world constructs the layer with the same cfg,
    quant, layout and backend (checked here by one all-gather) and calls ``forward`` the same
    number of times; token counts may differ per DP rank.
    """

    # False for a subclass that takes its routing as given (``MoEExperts``): then the layer holds
    # no router, and ``weights`` may hold none.
    routes_itself: ClassVar[bool] = True
    gate: Gate

    # Buffers registered in __init__, declared so that type checkers see tensors, not Module attributes.
    replica_table: torch.Tensor
    replica_count: torch.Tensor
    slot_expert: torch.Tensor

    def __init__(self, cfg: MoEConfig, quant: QuantConfig | None = None, groups: ParallelGroups | None = None,
                 backend: str | None = None, weights: MoEWeights | None = None,
                 local_experts: ExpertWeights | None = None, device=None,
                 max_tokens_per_rank: int | None = None, placement: Placement | None = None,
                 load_window: int = 64, recorder: StageRecorder | None = None,
                 shared_stored: ExpertWeights | None = None, empty_picks: bool = False) -> None:
        super().__init__()
        quant = quant or QuantConfig()
        parallel = groups.config if groups is not None else ParallelConfig()
        rank = groups.rank if groups is not None else 0
        backend = backend or default_backend(parallel)
        max_ok = max_tokens_per_rank is None or (isinstance(max_tokens_per_rank, int)
                                                 and not isinstance(max_tokens_per_rank, bool) and max_tokens_per_rank >= 1)
        placement_ok = placement is None or isinstance(placement, Placement)
        if groups is not None:
            # First, before any rank-local refusal: the checks below are pure functions of what
            # this exchange proves identical, so every rank then raises (or not) together.
            check_same_on_all_ranks(groups, {
                "num_experts": cfg.num_experts, "top_k": cfg.top_k, "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size, "shared_width": cfg.shared_width,
                "expert_bias": int(cfg.expert_bias),
                "dtype": code(dtype_name(cfg.dtype)), "quant": code(quant.scheme),
                "defer_input_quant": int(quant.defer_input_quant), "shared_quant": code(quant.shared),
                "backend": code(backend),
                "layout(dp,tp,ep)": parallel.dp * 10000 + parallel.tp * 10 + int(parallel.enable_ep),
                "max_tokens_per_rank": (max_tokens_per_rank or 0) if max_ok else -1,
                "placement": placement_code(placement) if placement_ok else -1,
                "load_window": load_window if is_int(load_window) else -1,
                "empty_picks": int(empty_picks) if isinstance(empty_picks, bool) else -1,
                # Every other field of the config, each as a digest of its value: a rank with
                # another activation, routing or scale would otherwise run without an error and
                # give its peers a mixed result.
                **{f"MoEConfig.{name}": code(repr(value)) for name, value in _config_fields(cfg).items()}},
                values={f"MoEConfig.{name}": value for name, value in _config_fields(cfg).items()})
        if not max_ok:
            raise ValueError(f"MoELayer (rank {rank}): max_tokens_per_rank must be None or an int >= 1, "
                             f"got {max_tokens_per_rank!r}")
        if not is_int(load_window) or load_window < 1:
            raise ValueError(f"MoELayer (rank {rank}): load_window must be an int >= 1, got {load_window!r}")
        if not isinstance(empty_picks, bool):
            raise ValueError(f"MoELayer (rank {rank}): empty_picks must be a bool, got {empty_picks!r}")
        parallel.validate(parallel.world_size, cfg, rank)
        self.placement = self._check_placement(placement, cfg, parallel, rank)
        self.cfg, self.quant, self.groups, self.parallel, self.backend_name = cfg, quant, groups, parallel, backend
        self.empty_picks = empty_picks
        self.device = torch.device(device) if device is not None else (groups.device if groups else torch.device("cpu"))
        self.kernel: ExpertKernel = select_kernel(cfg.activation, cfg.dtype, self.device, quant.scheme)
        ok, reason = support(backend, quant, parallel, device=self.device.type,
                             has_side_group=groups is not None and groups.side_group is not None,
                             kernel_layouts=self.kernel.layouts, has_max_tokens=max_tokens_per_rank is not None)
        if not ok:
            raise ValueError(f"MoELayer (rank {rank}): backend {backend!r}: {reason}")
        weights = weights if weights is not None else MoEWeights.random(cfg)
        weights.validate(cfg, routed=local_experts is None, router=self.routes_itself)
        weights = weights.to(dtype=cfg.dtype)
        self.shard = shard_spec(self.parallel, rank, cfg.num_experts, self.placement)
        self.shard.validate(cfg, quant)
        if local_experts is None:
            assert weights.gate_up is not None and weights.down is not None  # validate(routed=True) refused None
            local_experts = shard_experts(weights.gate_up, weights.down, cfg, quant, self.shard, weights.gate_up_bias,
                                          weights.down_bias)
        self._check_local_experts(local_experts, rank)
        if self.routes_itself:
            self.gate = Gate(weights)
        self.experts = RoutedExperts(local_experts)
        quant.check_model(cfg, f"MoELayer (rank {rank})")
        shared_quantized = None
        if shared_stored is not None and quant.shared == "none":
            raise ValueError(f"MoELayer (rank {rank}): shared_stored ({shared_stored.scheme}) given, but "
                             f"quant.shared is 'none' (the shared experts run in {cfg.dtype})")
        if quant.shared != "none":
            shared_quantized = QuantizedSharedMLP(quant.shared, select_kernel(cfg.shared_act, cfg.dtype, self.device,
                                                                              quant.shared), shared_stored)
        self.shared_experts = (SharedExperts(weights, cfg.shared_act, shared_quantized) if cfg.has_shared_experts
                               else None)
        self.shared_expert_gate = None
        if cfg.shared_expert_gate:
            assert weights.shared_expert_gate is not None  # validate() requires it when configured
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.shared_expert_gate.weight = nn.Parameter(weights.shared_expert_gate.clone(), requires_grad=False)
        self.loads = LoadCounter(cfg.num_experts, load_window)
        table, count = self.placement.tables()
        self.register_buffer("replica_table", table, persistent=False)
        self.register_buffer("replica_count", count, persistent=False)
        self.register_buffer("slot_expert", torch.tensor(list(self.shard.logical_experts), dtype=torch.int64),
                             persistent=False)
        self._dp_rank = parallel.dp_rank(rank)
        self.to(self.device)
        self.max_tokens_per_rank = max_tokens_per_rank
        routed_max = None
        if max_tokens_per_rank is not None:  # under SP a rank routes its 1/tp chunk
            routed_max = -(-max_tokens_per_rank // parallel.tp) if parallel.is_sequence_parallel else max_tokens_per_rank
        # With a placement the backend routes slots: P * S of them, S per EP rank. With weights on
        # the input it routes each (token, k) pair as a row of its own, to one expert.
        backend_cfg = self.placement.backend_config(cfg)
        if cfg.routing_kind.weights_on_input:
            backend_cfg = dataclasses.replace(backend_cfg, top_k=1)
            routed_max = None if routed_max is None else routed_max * cfg.top_k
        self.backend: DispatchBackend = BACKENDS[backend].factory(
            BackendContext(backend_cfg, quant, groups, routed_max, recorder, empty_picks))
        # A backend lacking what its registry entry declares is refused here, at build time; the
        # forward reads both again from self.backend (``_final_combine``, ``_payload_backend``).
        _final_combiner(self.backend, BACKENDS[backend].combine_final)
        _payload_first(self.backend, BACKENDS[backend].payload_first)
        self.overlap_shared = self.device.type == "cuda"
        self.overlap_payload = self.device.type == "cuda"
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}  # side streams by use and device
        self.recorder = recorder
        # Training losses on the router (moeshard.training.router_losses) set this: every forward
        # then keeps the fp32 logits of the rows it routed, and the first row's index in its DP
        # rank's batch (the SP chunk's start).
        self.keep_router_logits = False
        self.router_logits: tuple[torch.Tensor, int] | None = None
        self._register_load_state_dict_pre_hook(self._accept_shared_alias)

    @property
    def accumulation(self) -> float:
        """The expert kernels' accumulation error for this layer's schemes (the larger of the
        routed experts' and, when quantized, the shared experts'): pass it to
        ``reference_forward`` so that the reference prices the roundings it may flip."""
        routed = self.kernel.accumulation(self.quant.scheme)
        shared = self.shared_experts.quantized if self.shared_experts is not None else None
        return routed if shared is None else max(routed, shared.accumulation())

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], cfg: MoEConfig, **kwargs) -> MoELayer:
        """A layer from a full block state dict (transformers-5 names); kwargs as ``__init__``."""
        return cls(cfg, weights=MoEWeights.from_state_dict(state, cfg), **kwargs)

    @staticmethod
    def _accept_shared_alias(state, prefix, *args) -> None:
        # Qwen2-MoE names its shared MLP ``shared_expert`` (singular).
        for key in [k for k in state if k.startswith(prefix + SHARED_ALIASES[1])]:
            state[prefix + SHARED_ALIASES[0] + key[len(prefix + SHARED_ALIASES[1]):]] = state.pop(key)

    @staticmethod
    def _check_placement(placement: Placement | None, cfg: MoEConfig, parallel: ParallelConfig, rank: int) -> Placement:
        """The placement to use (identity when None); refuses one that does not fit. Every check
        is a function of values the configuration exchange proved identical on every rank."""
        if placement is None:
            return Placement.identity(cfg.num_experts, parallel.ep_size)
        if not isinstance(placement, Placement):
            raise ValueError(f"MoELayer (rank {rank}): placement must be a moeshard.eplb.Placement or None, "
                             f"got {type(placement).__name__}")
        if placement.num_experts != cfg.num_experts or placement.num_ranks != parallel.ep_size:
            raise ValueError(f"MoELayer (rank {rank}): placement is for {placement.num_experts} experts on "
                             f"{placement.num_ranks} EP ranks, but num_experts={cfg.num_experts} and layout "
                             f"{parallel.name} has EP size {parallel.ep_size}")
        if not parallel.enable_ep and not placement.is_identity:
            raise ValueError(f"MoELayer (rank {rank}): placement {list(placement.slots)} needs expert parallelism; "
                             f"layout {parallel.name} has EP off (every rank holds every expert once)")
        return placement

    def _check_local_experts(self, experts: ExpertWeights, rank: int) -> None:
        s, cfg = self.shard, self.cfg
        E_l, I_l = s.expert_stop - s.expert_start, cfg.intermediate_size // s.tp_size
        P = cfg.activation_kind.products  # gate and up rows, or up rows alone (ungated)
        want = {"gate_up": (E_l, P * I_l, cfg.hidden_size), "down": (E_l, cfg.hidden_size, I_l),
                "gate_up_bias": (E_l, P * I_l) if cfg.expert_bias else None,
                # Added once to the TP-reduced sum: TP rank 0 holds it.
                "down_bias": (E_l, cfg.hidden_size) if cfg.expert_bias and s.tp_rank == 0 else None}
        for name, shape in want.items():
            value = getattr(experts, name)
            got = None if value is None else tuple(value.shape)
            if got != shape:
                raise ValueError(f"MoELayer (rank {rank}): local_experts.{name} has shape {got}, "
                                 f"this rank's shard needs {shape}")
        if experts.scheme != self.quant.scheme:
            raise ValueError(f"MoELayer (rank {rank}): local_experts are {experts.scheme!r}, quant is {self.quant.scheme!r}")

    # -- forward --------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> bool:
        """Refuses a bad x with the field and values; returns whether the forward carries gradients."""
        rank = self.groups.rank if self.groups else 0
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"MoELayer.forward (rank {rank}): x must be a torch.Tensor [T, hidden_size="
                             f"{self.cfg.hidden_size}], got {type(x).__module__}.{type(x).__qualname__} "
                             f"(convert it with torch.from_numpy / torch.as_tensor first)")
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"MoELayer.forward (rank {rank}): x must be [T, hidden_size="
                             f"{self.cfg.hidden_size}], got {tuple(x.shape)}")
        if x.dtype != self.cfg.dtype:
            raise ValueError(f"MoELayer.forward (rank {rank}): x.dtype is {x.dtype}, the layer's dtype is {self.cfg.dtype}")
        if x.device != self.device and not (x.device.type == self.device.type == "cuda" and self.device.index is None):
            raise ValueError(f"MoELayer.forward (rank {rank}): x is on {x.device}, the layer on {self.device}")
        held = self.experts.gate_up_proj.dtype
        if self.quant.scheme == "none" and held != self.cfg.dtype:
            # A cast after construction (.bfloat16(), .double(), .to(dtype)) changes the tensors, not
            # the config the kernels and the combine follow: a TypeError deep in a GEMM before.
            raise ValueError(f"MoELayer.forward (rank {rank}): the layer's experts are {held} but its cfg.dtype "
                             f"is {self.cfg.dtype} (cast after it was built?); build the layer with "
                             f"MoEConfig(dtype={held}) instead")
        if self.max_tokens_per_rank is not None and x.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"MoELayer.forward (rank {rank}): x has {x.shape[0]} tokens, more than "
                             f"max_tokens_per_rank={self.max_tokens_per_rank}")
        if not torch.is_grad_enabled():
            return False
        what = self._needs_grad(x)
        if what is None:
            return False
        reason = backward_refusal(self.backend_name, self.quant, self.placement.has_replicas)
        if reason:
            raise ValueError(f"MoELayer.forward (rank {rank}): {what}, but {reason} (or run the layer under "
                             f"torch.no_grad() / torch.inference_mode())")
        return True

    def _needs_grad(self, x: torch.Tensor) -> str | None:
        """What makes this forward carry gradients (grad mode on): x or a parameter that requires
        grad, named for messages; None if nothing does."""
        if x.requires_grad:
            return "x requires grad"
        return next((f"parameter {n!r} requires grad" for n, q in self.named_parameters() if q.requires_grad), None)

    def route(self, x: torch.Tensor) -> Routing:
        """x: [T, H] rows this rank routes -> top-k ids / fp32 weights [T, K] (global logical
        expert ids; ``physical_ids`` maps them to the slots the backend routes)."""
        return route_tokens(x, self.gate.weight, self.cfg, self.gate.e_score_correction_bias, self.gate.bias)

    def physical_ids(self, topk_ids: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """topk_ids: int64 [T, K] logical ids of T consecutive tokens of this rank's DP batch, the
        first at row ``first_row`` -> int64 [T, K] physical slot ids (``moeshard.eplb.placement``:
        a function of the token's row, its DP rank, k and the expert; the same on every rank).
        The ids themselves without a placement; an empty pick (-1) stays -1. No host
        synchronisation."""
        if self.placement.is_identity:
            return topk_ids
        slots = choose_replicas(topk_ids.clamp(min=0), self.replica_table, self.replica_count, first_row,
                                self._dp_rank)
        return torch.where(topk_ids < 0, topk_ids, slots)

    def _replica_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """fp32 [S] per-slot amax of h -> the amax of each slot's logical expert over all its
        replicas (one all-reduce of E values over the EP group): h is quantized with the
        logical expert's per-tensor scale, as on one device."""
        full = torch.zeros(self.cfg.num_experts, dtype=torch.float32, device=amax.device)
        full.scatter_reduce_(0, self.slot_expert, amax.float(), reduce="amax", include_self=True)
        assert self.groups is not None  # replicas share an amax under EP only, which needs groups
        all_reduce(full, self.groups.ep_group, "ep", "max", trace=self.groups.trace)
        return full[self.slot_expert]

    @property
    def _shares_amax(self) -> bool:
        return (self.parallel.enable_ep and self.placement.has_replicas
                and self.quant.spec.per_tensor_activation)

    def _routed(self, x: torch.Tensor, first_row: int = 0, grad: bool = False,
                join_shared: Callable[[], torch.Tensor | None] = lambda: None,
                join_payload: Callable[[], Payload] | None = None) -> tuple[torch.Tensor, bool]:
        """x: [T, H] rows this rank routes (the first at row ``first_row`` of its DP rank's batch)
        -> (out, final): the fp32 [T, H] routed-expert output (TP-reduced), final False; or, where
        the backend's combine can finish the layer's sum (``_final_combine``), the model-dtype
        [T, H] sum of the routed output and ``join_shared()`` (the shared experts, or None),
        final True. grad: carry gradients (the differentiable collectives and the portable
        experts). join_payload: the join of x's payload started on a side stream
        (``_start_payload``), or None to make it at dispatch."""
        rec = self.recorder
        routing = self.route(x)
        if rec is not None:
            rec.record("routing", topk_ids=routing.topk_ids, topk_weights=routing.topk_weights, first_token=first_row)
            if grad:
                rec.record_grad("topk_weights", routing.topk_weights)
        self.loads.record(self.load_ids(routing))
        if self.keep_router_logits:
            if routing.logits is None:
                raise ValueError(f"MoELayer: keep_router_logits is set but {type(self).__name__}.route returned no "
                                 f"logits (build its Routing with moeshard.router.route)")
            self.router_logits = (routing.logits.float(), first_row)  # fp32 (a model-dtype router's widened)
        routing = Routing(self.physical_ids(routing.topk_ids, first_row), routing.topk_weights,
                          empty_picks=routing.empty_picks)
        T = x.shape[0]
        if self.cfg.routing_kind.weights_on_input:
            x, routing = weighted_rows(x, routing, self.cfg.dtype)
        tp_sliced = self.parallel.tp > 1 and not self.parallel.enable_ep
        if grad and tp_sliced:
            assert self.groups is not None  # tp > 1 needs groups (without them the layout is one device)
            # This rank's experts compute one slice of I from x and the weights whole: their
            # gradients of both are partial sums over TP.
            x, weights = tp_copy(x, routing.topk_weights, group=self.groups.tp_group, trace=self.groups.trace)
            routing = Routing(routing.topk_ids, weights, empty_picks=routing.empty_picks)
        if join_payload is not None:
            payload_backend = self._payload_backend()
            assert payload_backend is not None  # _start_payload starts one only for such a backend
            d = payload_backend.dispatch_payload(x, join_payload(), routing)
        else:
            d = differentiable.dispatch(self.backend, x, routing) if grad else self.backend.dispatch(x, routing)
        inp = d.input
        if rec is not None:
            _record_dispatched(rec, inp, self.slot_expert)
        if self._shares_amax:
            inp = dataclasses.replace(inp, amax_reduce=self._replica_amax)
        kernel = self.kernel
        if grad and type(kernel) is not GroupedExperts:  # the Triton kernels are forward only
            kernel = GroupedExperts(self.cfg.activation, self.cfg.dtype)
        y = kernel(inp, self.experts.weights)
        if routing.empty_picks and (grad or rec is not None or not BACKENDS[self.backend.name].combine_skips_empty):
            # No expert computed the rows of empty picks (id -1, as padding): their output rows are
            # unspecified. A combine that weighs every pair's row needs them as exact zeros (0 * an
            # unwritten NaN would be NaN), and so do the backward (their weights get no gradient)
            # and the recorded stage; a forward through a combine that skips them
            # (``BackendSpec.combine_skips_empty``) saves this pass over y.
            # Without autograd y is the kernel's own new tensor, zeroed in place.
            empty = (inp.expert_ids < 0).unsqueeze(1)
            y = y.masked_fill(empty, 0) if grad else y.masked_fill_(empty, 0)
        if rec is not None:
            rec.record("experts", y=y)
        if grad:
            out = differentiable.combine(self.backend, y, routing.topk_weights, d)
        elif (combine_final := self._final_combine(tp_sliced)) is not None:
            # Nothing runs between the combine and the shared sum: one pass sums both and rounds.
            return combine_final(y, d, join_shared(), self.cfg.dtype), True
        else:
            out = self.backend.combine(y, d)
        if rec is not None:
            rec.record("combine", out=out)
        if self.cfg.routing_kind.weights_on_input:
            out = out.view(T, self.cfg.top_k, out.shape[1]).sum(dim=1)  # the K weighted rows of each token
        if tp_sliced:
            assert self.groups is not None  # tp > 1 needs groups (without them the layout is one device)
            if grad:
                out = tp_reduce(out, self.groups.tp_group, trace=self.groups.trace)
            else:
                all_reduce(out, self.groups.tp_group, "tp", trace=self.groups.trace)
            if rec is not None:
                rec.record("tp_reduce", out=out)
        return out, False

    def _final_combine(self, tp_sliced: bool) -> Callable[..., torch.Tensor] | None:
        """The backend's ``combine_final`` (``dispatch.base.FinalCombineBackend``: the combine that also
        adds the shared experts and rounds to the model dtype), where its registry entry says it
        has one (``BackendSpec.combine_final``) and nothing sits between the two (no TP reduction
        of the routed output, no sum of per-copy rows, no stage recorder reading the fp32 sum),
        else None. Forward only (the caller has grad=False)."""
        if tp_sliced or self.cfg.routing_kind.weights_on_input or self.recorder is not None:
            return None
        return _final_combiner(self.backend, BACKENDS[self.backend.name].combine_final)

    def _payload_backend(self) -> PayloadFirstBackend | None:
        """``self.backend`` as a ``PayloadFirstBackend`` where its registry entry says
        ``payload_first``, else None. Read at each forward, as ``_final_combine`` is, so that a
        backend assigned after the layer was built, or a check wrapping its methods, is the one
        the forward calls."""
        return _payload_first(self.backend, BACKENDS[self.backend.name].payload_first)

    def _start_payload(self, x: torch.Tensor, grad: bool) -> Callable[[], Payload] | None:
        """Starts the backend's payload of x [T, H] (the rows this rank routes, quantized as the
        backend sends them) on a side stream, and returns its join: called once, it gives the
        payload, readable on the current stream. None where the backend makes the payload
        itself at dispatch: a backend without ``payload_first``, off CUDA, ``overlap_payload``
        off, under autograd, with the stage recorder (which records the payload in stage order),
        weights on the input (the payload is then of the weighted rows), or a scheme without a
        per-tensor activation scale.

        Why: a per-tensor scale takes two passes over x before the experts (the amax, then the
        quantization; the amax alone when the experts quantize), and the router reads x once
        more and runs its top-k; neither needs the other's result. On one H200 (the layer with
        and without, alternating, ``scripts/payload_overlap_study.py``) the overlap took fp8_tensor's
        layer 0.2-7.6% faster at the bench's shapes (Qwen3-30B-A3B at one token 49.2 -> 45.4 us);
        fp8_token's and fp8_block's one pass gained nothing (-1.5 to +3.5%, within the runs'
        spread), so they quantize at dispatch."""
        spec = self.quant.spec
        backend = self._payload_backend()
        if (backend is None or not (self.overlap_payload and x.is_cuda) or grad
                or self.recorder is not None or self.cfg.routing_kind.weights_on_input
                or not spec.per_tensor_activation):
            return None
        return self._beside("payload", x, lambda: backend.payload(x),
                            lambda p: (p.rows, p.row_scale, p.tensor_scale, p.input_amax))

    def _start_shared(self, x: torch.Tensor) -> Callable[[], torch.Tensor | None]:
        """Starts the shared experts on x [T, H] (the rows this rank routes) and returns their
        join: called once, it gives ``_shared(x)`` ([T, H], model dtype; None without shared
        experts), readable on the current stream. On CUDA (``overlap_shared``) they run on a side
        stream, independent of dispatch, while the routed path runs; elsewhere when joined."""
        if self.shared_experts is None:
            return lambda: None
        if not (self.overlap_shared and x.is_cuda):
            return lambda: self._shared(x)
        return self._beside("shared", x, lambda: self._shared(x), lambda shared: (shared,))

    def _beside(self, name: str, x: torch.Tensor, work: Callable[[], _T],
                held: Callable[[_T], tuple[torch.Tensor | None, ...]]) -> Callable[[], _T]:
        """Runs ``work()`` on the layer's side stream ``name`` on x's device (made on first use),
        after what the current stream has issued so far, and returns its join: called once, it
        makes the current stream wait for the side stream and gives work's result. Outside a
        graph capture the tensors ``held(result)`` are then marked as used on the current stream,
        which keeps the allocator from reusing them too early (a captured graph keeps its own pool)."""
        main = torch.cuda.current_stream(x.device)
        # Keyed by device too: a layer moved to another GPU (``.to``) must not keep queueing its
        # side work on the first device's streams.
        side = self._streams.get((name, x.device))
        if side is None:
            side = self._streams[(name, x.device)] = torch.cuda.Stream(device=x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            result = work()

        def join() -> _T:
            main.wait_stream(side)
            if not torch.cuda.is_current_stream_capturing():
                for t in held(result):
                    if t is not None:
                        t.record_stream(main)
            return result

        return join

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] rows this rank routes -> [T, H] in the model dtype: the shared experts'
        contribution (the forward adds it to the fp32 routed output in fp32, reading it in place:
        no fp32 copy of it is made)."""
        assert self.shared_experts is not None  # called only when the config has shared experts
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        if self.cfg.shared_scale != 1.0:
            shared = shared * self.cfg.shared_scale
        return shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] in ``cfg.dtype`` on this rank's device (T may be 0 and may differ per DP
        rank; identical on the TP ranks of one DP rank; at most ``max_tokens_per_rank``) -> [T, H]
        in ``cfg.dtype``. Under ``torch.compile`` of a model holding the layer, the layer itself
        runs eagerly (the rest of the model is compiled)."""
        if torch.compiler.is_compiling():
            return eager_under_compile(MoELayer._forward)(self, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        grad = self._check_input(x)
        p = self.parallel
        first_row = 0
        if p.is_sequence_parallel:
            assert self.groups is not None  # sequence parallelism needs tp > 1, hence groups
            if grad:
                chunk = SequenceChunk.of(x.shape[0], p.tp_rank(self.groups.rank), p.tp)
                x = shard_rows(x, chunk.rows_per_rank, chunk.tp_rank, self.groups.tp_group, "tp",
                               trace=self.groups.trace)
            else:
                x, chunk = sequence_parallel_chunk(x, p.tp_rank(self.groups.rank), p.tp)
            first_row = chunk.start
        # The payload's side stream is issued before the shared experts': the routed experts wait
        # for the payload, the shared experts' output is needed only at the combine. Issued after
        # them, DeepSeek-V3's fp8_tensor layer took 183-194 us at one token against 160 us with
        # the payload made at dispatch (scripts/decode_layer_study.py, one H200), likely its two
        # small kernels waiting behind the shared experts' GEMMs (not profiled).
        join_payload = self._start_payload(x, grad)
        join_shared = self._start_shared(x)
        out, final = self._routed(x, first_row, grad, join_shared, join_payload)
        if not final:
            shared = join_shared()
            if shared is not None:
                if self.recorder is not None:
                    self.recorder.record("shared", out=shared.float())
                # (out + shared in fp32) rounded to the model dtype. Without autograd, one pass that
                # rounds as it stores (the sum in fp32 and a separate cast cost two more passes over
                # [T, H] fp32: 0.5 ms at DeepSeek-V3's 16384 tokens).
                if grad:
                    out = (out + shared).to(self.cfg.dtype)
                else:
                    out = torch.add(out, shared, out=torch.empty_like(shared, dtype=self.cfg.dtype))
            else:
                out = out.to(self.cfg.dtype)
        if p.is_sequence_parallel:
            assert self.groups is not None  # sequence parallelism needs tp > 1, hence groups
            if grad:
                if self.recorder is not None:
                    self.recorder.record_grad("sp_gather", out)
                out = gather_rows(out, chunk.rows_per_rank, chunk.tp_rank, self.groups.tp_group, "tp",
                                  trace=self.groups.trace)
            else:
                out = sequence_parallel_gather(out, chunk, self.groups.tp_group, trace=self.groups.trace)
        if self.recorder is not None:
            self.recorder.record("output", out=out)
        return out

    def gradient_roles(self) -> dict[str, GradRole]:
        """For each parameter (by name, as ``named_parameters``): over which group its gradient
        is summed after the backward and whether this rank counts it in the gradient norm
        (``moeshard.autograd.roles``; ``moeshard.training.reduce_gradients`` applies them)."""
        rank = self.groups.rank if self.groups is not None else 0
        return {name: layer_role(name, self.parallel, rank) for name, _ in self.named_parameters()}

    # -- expert-parallel load balancing -----------------------------------------------------
    def load_ids(self, routing: Routing) -> torch.Tensor:
        """The logical ids [R, K] the load counter counts for ``routing``: all of them; -1 for a
        copy that counts nowhere (``MoEExperts``: a given pick of weight 0)."""
        return routing.topk_ids

    def expert_loads(self, all_reduce: bool = True) -> torch.Tensor:
        """int64 [E] on the layer's device: routed copies (token, k) per logical expert over the
        last ``load_window`` forwards. all_reduce: summed over the EP group (EP on; under SP each
        TP rank counted its own chunk) or over the DP group (EP off: the TP ranks of a DP rank
        route the same tokens), so every rank gets the whole world's loads; collective then, and
        every rank must call it. Reads nothing back to the host."""
        loads = self.loads.read()
        if all_reduce and self.groups is not None:
            name = self.load_group_name
            with traced(self.groups.trace, "all_reduce_sum", name, loads):
                dist.all_reduce(loads, group=self.groups.group(name))
        return loads

    @property
    def load_group_name(self) -> str:
        """The group over whose ranks this rank's loads sum to the whole world's: "ep" with EP on
        (each rank routed rows of its own: its DP rank's tokens, or under SP its chunk of them),
        "dp" with EP off (the TP ranks of a DP rank route the same tokens)."""
        return "ep" if self.parallel.enable_ep else "dp"

    def reset_expert_loads(self) -> None:
        """Empties the load window (this rank only; call it on every rank to restart together)."""
        self.loads.reset()

    def rebalance(self, placement: Placement) -> MoveStats:
        """Switches to ``placement`` (same E, P and slots per rank), moving only the slots whose
        expert changed: from a slot of the same rank when it holds that expert, else from a rank
        that does, as bytes over the EP group (quantized weights with their scales). Collective:
        every rank calls it with the same placement (checked first by one all-gather, so ranks
        that disagree all raise). Buffers keep their shapes and addresses. Returns what this
        rank moved."""
        rank = self.groups.rank if self.groups is not None else 0
        if self.groups is not None:
            check_same_on_all_ranks(self.groups, {"placement": placement_code(placement)
                                                   if isinstance(placement, Placement) else -1})
        if not isinstance(placement, Placement):
            raise ValueError(f"MoELayer.rebalance (rank {rank}): placement must be a moeshard.eplb.Placement, "
                             f"got {type(placement).__name__}")
        old = self.placement
        if (placement.num_experts, placement.num_ranks, placement.num_slots) != (old.num_experts, old.num_ranks,
                                                                                   old.num_slots):
            raise ValueError(f"MoELayer.rebalance (rank {rank}): placement has {placement.num_experts} experts on "
                             f"{placement.num_ranks} ranks in {placement.num_slots} slots, the layer "
                             f"{old.num_experts} on {old.num_ranks} in {old.num_slots}; a rebalance keeps the slots")
        self._check_placement(placement, self.cfg, self.parallel, rank)
        moves = plan_moves(old, placement)
        group = self.groups.ep_group if self.groups is not None else None
        stats = move_slots(self.experts.slot_tensors(), moves, old.slots_per_rank,
                           self.parallel.ep_rank(rank), group, self.groups.trace if self.groups is not None else None)
        table, count = placement.tables(self.replica_table.device)
        self.replica_table.copy_(table)
        self.replica_count.copy_(count)
        self.shard = shard_spec(self.parallel, rank, self.cfg.num_experts, placement)
        self.slot_expert.copy_(torch.tensor(list(self.shard.logical_experts), dtype=torch.int64))
        self.placement = placement
        return stats


_EAGER: dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = {}


def eager_under_compile(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``method`` (``MoELayer._forward``, or a subclass's entry) as ``torch.compile`` calls it:
    eagerly, a graph break at the layer's boundary. Traced, the layer fails (its float32 grouped
    GEMM has no meta function on torch 2.13, and a backward fails on its custom autograd
    Functions around graph breaks), and it keeps host-side state (the experts' weight views,
    dispatch plans, side streams) while its GPU work is its own Triton kernels already. Made on
    first use, under a compile: importing dynamo costs about 1.1 s, which the layer's import does
    not pay."""
    if method not in _EAGER:
        _EAGER[method] = torch.compiler.disable(method)
    return _EAGER[method]

"""``MoEExperts``: a transformers experts module run by moeshard on the routing transformers
computed, for a family whose decoder layer or block routes itself (``ModelFamily.experts_only``:
Gemma 4, DeepSeek-V4, ZAYA, LongCat-Flash, Inkling's text model).

Such a layer or block calls ``experts(rows [T, H], top_k_index [T, K], top_k_weights [T, K])``;
its router reads an input the experts do not (Gemma 4's router normalizes and scales the residual
stream, its experts get another norm of it; DeepSeek-V4's first layers pick experts by token id;
ZAYA's MLP router adds the previous layer's router state; LongCat-Flash's and Inkling's routers
also score experts that are not the routed ones: zero-computation experts, the shared experts),
so moeshard cannot route the experts' rows itself. The layer holds no router (``routes_itself``
False): none of these three has an [E, H] weight.
``MoEExperts`` takes the ids and weights as given and runs everything after the router: dispatch
under the layout, the experts, the combine. Under sequence parallelism each TP rank takes its
chunk of the rows, ids and weights; with autograd the weights' chunk is cut by ``shard_rows``,
whose backward all-gathers, so the gradient reaching the router (transformers', replicated on
every TP rank) is whole on each rank, as a replicated parameter's must be.
"""

from __future__ import annotations

from typing import Any

import torch

from moeshard.autograd.collectives import shard_rows
from moeshard.config import MoEConfig
from moeshard.layer import MoELayer, eager_under_compile
from moeshard.parallel.sequence import SequenceChunk
from moeshard.router import Routing
from moeshard.validate import is_int


class MoEExperts(MoELayer):
    """``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``.

    hidden_states: the rows the experts take, in the model dtype (T may be 0); top_k_index: int64
    logical expert ids in [0, E + identity_experts) (not checked on the device: that would
    synchronize); top_k_weights:
    the combine weights (any float dtype, used in fp32), differentiable. On the TP ranks of one DP
    rank all three are the same tensors (the decoder layer runs replicated there). The output is
    the weighted sum of the K experts' outputs, in the model dtype. ``weights`` as ``MoELayer``'s,
    but the router's tensors may be None: the router stays transformers', on the decoder layer or
    block (any router tensor given is checked for its shape, not used, nor held). layer: the
    decoder layer index (for messages). zero_weight_skips: a given pick of weight exactly 0 is a
    skip (ZAYA's skip class, which its router gives as expert 0 with weight 0 by a masked fill,
    so that weight has no gradient) and goes on as an empty pick; a pick of weight 0 of any other
    family is computed as given. identity_experts: Z zero-computation experts beside the E
    routed ones (LongCat-Flash): ids E .. E + Z - 1 pass the row through, scaled by its weight.
    Such picks go on to the layer as empty picks (id -1, weight 0: ``Routing.empty_picks``),
    which no expert computes, no link carries and no expert's load counts; the rows' own term is
    added after the layer, to whole rows, the same on every TP rank. Other arguments as
    ``MoELayer``.
    """

    routes_itself = False

    def __init__(self, cfg: MoEConfig, *, layer: int | None = None, identity_experts: int = 0,
                 zero_weight_skips: bool = False, **kwargs: Any) -> None:
        if not is_int(identity_experts) or identity_experts < 0:
            raise ValueError(f"MoEExperts (layer {layer}): identity_experts must be an int >= 0, got "
                             f"{identity_experts!r}")
        if not isinstance(zero_weight_skips, bool):
            raise ValueError(f"MoEExperts (layer {layer}): zero_weight_skips must be a bool, got {zero_weight_skips!r}")
        super().__init__(cfg, empty_picks=identity_experts > 0 or zero_weight_skips, **kwargs)
        self.layer_index = layer
        self.identity_experts = identity_experts
        self.zero_weight_skips = zero_weight_skips
        self._given: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,  # type: ignore[override]
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # Under torch.compile of the model the module runs eagerly, as MoELayer does: it holds
        # the given routing between its stages, which a trace would not see.
        if torch.compiler.is_compiling():
            return eager_under_compile(MoEExperts._run)(self, hidden_states, top_k_index, top_k_weights)
        return self._run(hidden_states, top_k_index, top_k_weights)

    def _run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        rank = self.groups.rank if self.groups is not None else 0
        where = f"MoEExperts (layer {self.layer_index}, rank {rank})"
        rows = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() else None
        want = (rows, self.cfg.top_k)
        for name, t, integer in (("top_k_index", top_k_index, True), ("top_k_weights", top_k_weights, False)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.is_floating_point() == integer:
                got = (f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__)
                raise ValueError(f"{where}: {name} must be [T={rows}, top_k={self.cfg.top_k}] "
                                 f"{'integer' if integer else 'floating point'}, got {got}")
            if t.device != hidden_states.device:
                raise ValueError(f"{where}: {name} is on {t.device}, hidden_states on {hidden_states.device}")
        identity = None
        if self.identity_experts:
            # A zero-computation pick adds weight * row; the layer sees it as an empty pick.
            picked = top_k_index >= self.cfg.num_experts
            identity = (top_k_weights * picked).sum(-1, keepdim=True)
            top_k_index = top_k_index.masked_fill(picked, -1)
            top_k_weights = top_k_weights.masked_fill(picked, 0)
        if self.zero_weight_skips:
            # A skip (ZAYA's skip class) comes as expert 0 with weight 0: an empty pick.
            top_k_index = top_k_index.masked_fill(top_k_weights == 0, -1)
        self._given = (top_k_index.long(), top_k_weights)
        try:
            out = self._forward(hidden_states)
        finally:
            self._given = None
        if identity is None:
            return out
        return (out.float() + hidden_states.float() * identity.float()).to(out.dtype)

    def _needs_grad(self, x: torch.Tensor) -> str | None:
        assert self._given is not None  # set by forward
        if self._given[1].requires_grad:
            return "top_k_weights requires grad"
        return super()._needs_grad(x)

    def route(self, x: torch.Tensor) -> Routing:
        """x: [T, H] rows this rank routes -> the given ids and fp32 weights of those rows: all of
        them, or under sequence parallelism this TP rank's chunk."""
        assert self._given is not None  # set by forward
        ids, weights = self._given
        p = self.parallel
        if not p.is_sequence_parallel:
            return Routing(ids, weights.float(), empty_picks=self.empty_picks)
        assert self.groups is not None  # sequence parallelism needs tp > 1, hence groups
        chunk = SequenceChunk.of(ids.shape[0], p.tp_rank(self.groups.rank), p.tp)
        rows = slice(chunk.start, chunk.start + chunk.real)
        if weights.requires_grad and torch.is_grad_enabled():
            mine = shard_rows(weights.float(), chunk.rows_per_rank, chunk.tp_rank, self.groups.tp_group, "tp",
                              trace=self.groups.trace)
        else:
            mine = weights[rows].float()
        return Routing(ids[rows], mine, empty_picks=self.empty_picks)

    def load_ids(self, routing: Routing) -> torch.Tensor:
        """The ids the load counter counts: a pick of weight exactly 0 contributes nothing and
        counts nowhere (-1), an empty pick (-1) neither; without ``zero_weight_skips`` a skip
        given as expert 0 with weight 0 would otherwise count as expert 0's load."""
        return routing.topk_ids.masked_fill(routing.topk_weights == 0, -1)

    def extra_repr(self) -> str:
        s = self.shard
        return (f"layer={self.layer_index}, layout={self.parallel.name}, backend={self.backend_name}, "
                f"quant={self.quant.name}, experts=[{s.expert_start}, {s.expert_stop}) of {self.cfg.num_experts}, "
                f"routing given")


"""From full weights to this rank's shard of the routed experts.

Expert parallelism keeps whole experts: rank with EP index j holds experts
[j * E / ep, (j + 1) * E / ep). Tensor parallelism (EP off) slices the intermediate dimension:
TP rank r keeps gate rows [r I/tp, (r+1) I/tp), the same up rows (offset by I; an ungated
activation's experts hold up rows alone), and the same columns of down. Weights are quantized
per expert before slicing, so every TP shard carries the scales of the full expert (a
per-expert fp8 scale or nvfp4 global scale is shared by the shards) and
``shard.dequantize()`` equals a slice of ``full.dequantize()``.

Expert biases (``MoEConfig.expert_bias``) go with their expert: under EP (and a placement's
replicas) a slot holds its expert's biases; under TP the gate_up bias is sliced as gate_up's
rows, and the down bias, added to a sum that TP all-reduces, is held by TP rank 0 alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from moeshard.config import MoEConfig, QuantConfig
from moeshard.eplb.placement import Placement
from moeshard.experts.base import ExpertWeights, Weight
from moeshard.parallel.config import ParallelConfig
from moeshard.quant import QuantizedWeight, quantize_weight


@dataclass(frozen=True)
class ShardSpec:
    """expert_start/expert_stop: this rank's experts (physical slots [start, stop) with a
    placement); tp_rank/tp_size: its slice of I (tp_size 1 under EP, where experts stay whole);
    experts: with expert-parallel load balancing, the logical expert of each of those slots
    (``moeshard.eplb.Placement``), whose weights the slot holds; None: slot i holds expert i."""

    expert_start: int
    expert_stop: int
    tp_rank: int = 0
    tp_size: int = 1
    experts: tuple[int, ...] | None = None

    @property
    def logical_experts(self) -> range | tuple[int, ...]:
        """The logical expert of each of this rank's slots, in slot order (what is read and kept)."""
        return range(self.expert_start, self.expert_stop) if self.experts is None else self.experts

    def validate(self, cfg: MoEConfig, quant: QuantConfig) -> None:
        I = cfg.intermediate_size
        if self.experts is None and not 0 <= self.expert_start < self.expert_stop <= cfg.num_experts:
            raise ValueError(f"ShardSpec: experts [{self.expert_start}, {self.expert_stop}) outside "
                             f"[0, {cfg.num_experts})")
        if self.experts is not None:
            if not 0 <= self.expert_start < self.expert_stop or len(self.experts) != self.expert_stop - self.expert_start:
                raise ValueError(f"ShardSpec: slots [{self.expert_start}, {self.expert_stop}) and experts "
                                 f"{list(self.experts)} do not match (one logical expert per slot)")
            bad = [e for e in self.experts if not 0 <= e < cfg.num_experts]
            if bad:
                raise ValueError(f"ShardSpec: logical experts {bad} outside [0, {cfg.num_experts})")
        if I % self.tp_size:
            raise ValueError(f"ShardSpec: intermediate_size={I} is not divisible by tp={self.tp_size}")
        scheme = quant.spec
        width, align = I // self.tp_size, scheme.slice_align
        if self.tp_size > 1 and width % align:
            raise ValueError(f"ShardSpec: quant {quant.scheme!r} needs tensor-parallel slices of the "
                             f"intermediate dimension aligned to {align}, but intermediate_size={I} / "
                             f"tp={self.tp_size} = {width}")
        for name, k in (("hidden_size", cfg.hidden_size), ("intermediate slice", width)):
            if k % scheme.dim_multiple:
                raise ValueError(f"ShardSpec: {quant.scheme} needs {name} divisible by {scheme.dim_multiple}, got {k}")


def shard_spec(parallel: ParallelConfig, rank: int, num_experts: int, placement: Placement | None = None) -> ShardSpec:
    """The experts and slice of I that ``rank`` holds under ``parallel``: EP on, whole experts
    ``parallel.local_experts(rank, E)``; EP off, all experts and this TP rank's slice of I.

    placement: with expert-parallel load balancing (EP on), the rank's S physical slots
    [ep_rank * S, (ep_rank + 1) * S) and the logical expert each holds; an identity placement
    gives the spec without one."""
    experts = parallel.local_experts(rank, num_experts)
    if placement is not None and not placement.is_identity:
        if not parallel.enable_ep or placement.num_ranks != parallel.ep_size or placement.num_experts != num_experts:
            raise ValueError(f"shard_spec (rank {rank}): a placement of {placement.num_experts} experts on "
                             f"{placement.num_ranks} ranks does not fit layout {parallel.name} with "
                             f"num_experts={num_experts} (EP size {parallel.ep_size})")
        S = placement.slots_per_rank
        p = parallel.ep_rank(rank)
        return ShardSpec(p * S, (p + 1) * S, experts=placement.rank_slots(p))
    if parallel.enable_ep:
        return ShardSpec(experts.start, experts.stop)
    return ShardSpec(0, num_experts, parallel.tp_rank(rank), parallel.tp)


def _slice_rows(w: Weight, start: int, stop: int) -> Weight:
    return w.slice_out(start, stop) if isinstance(w, QuantizedWeight) else w[:, start:stop]


def _slice_cols(w: Weight, start: int, stop: int) -> Weight:
    return w.slice_in(start, stop) if isinstance(w, QuantizedWeight) else w[..., start:stop]


def _cat_rows(parts: list[Weight]) -> Weight:
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat_out(cast(list[QuantizedWeight], parts))
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(cast(list[torch.Tensor], parts), dim=1)
    raise TypeError(f"_cat_rows: the parts must be all tensors or all QuantizedWeight, got "
                    f"{[type(p).__name__ for p in parts]}")


# Experts converted and quantized per step: bounds the fp32 temporaries of quantization (and, under
# TP, the unsliced copies) to a few experts at a time.
EXPERT_CHUNK = 8


def _cat_experts(parts: list[Weight]) -> Weight:
    # Every part is of one scheme (shard_experts quantizes them alike), so of parts[0]'s kind.
    if isinstance(parts[0], QuantizedWeight):
        return QuantizedWeight.cat_experts(cast(list[QuantizedWeight], parts))
    return parts[0] if len(parts) == 1 else torch.cat(cast(list[torch.Tensor], parts), dim=0)


def _pick(w: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Experts ``ids`` of ``w`` [E, ...]: a view when they are consecutive, else a copy."""
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return w[ids[0]:ids[0] + len(ids)]
    return w.index_select(0, torch.tensor(ids, dtype=torch.int64, device=w.device))


def _check_biases(gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, cfg: MoEConfig,
                  experts: int) -> None:
    """ValueError unless the biases are given exactly when ``cfg.expert_bias``, with the shapes
    [experts, 2I] and [experts, H]."""
    want = {"gate_up_bias": (experts, cfg.gate_up_size), "down_bias": (experts, cfg.hidden_size)}
    for name, t in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if (t is not None) != cfg.expert_bias:
            raise ValueError(f"shard_experts: {name} was {'not ' if t is None else ''}given, but "
                             f"MoEConfig.expert_bias={cfg.expert_bias}")
        if t is not None and tuple(t.shape) != want[name]:
            raise ValueError(f"shard_experts: {name} must be {want[name]}, got {tuple(t.shape)}")


def _bias_part(bias: torch.Tensor | None, chunk: list[int], dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else _pick(bias, chunk).to(dtype, copy=True).contiguous()


def shard_experts(gate_up: torch.Tensor, down: torch.Tensor, cfg: MoEConfig, quant: QuantConfig,
                  spec: ShardSpec, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> ExpertWeights:
    """gate_up: [E, 2I, H], down: [E, H, I] full-precision full weights (any float dtype; experts
    outside the spec may be absent only if the caller passes the selected experts themselves,
    i.e. E == expert_stop - expert_start); gate_up_bias [E, 2I] and down_bias [E, H]: the
    experts' biases, given iff ``cfg.expert_bias``. With a placement (``spec.experts``) slot i
    gets logical expert ``spec.experts[i]``. Returns this rank's ``ExpertWeights``. Experts are
    converted, quantized and sliced ``EXPERT_CHUNK`` at a time, so the temporaries stay small
    next to the weights themselves (full-size models on one GPU)."""
    spec.validate(cfg, quant)
    _check_biases(gate_up_bias, down_bias, cfg, gate_up.shape[0])
    # Each slot gets a copy of its logical expert, quantized alone (every scale is per expert or
    # finer), so a replica is bit for bit its expert.
    ids = list(spec.logical_experts) if gate_up.shape[0] == cfg.num_experts else list(range(gate_up.shape[0]))
    parts = []
    for i in range(0, len(ids), EXPERT_CHUNK):
        chunk = ids[i:i + EXPERT_CHUNK]
        # copy=True: the layer owns its weights; it must never alias (and later mutate) the caller's.
        gu_plain = _pick(gate_up, chunk).to(cfg.dtype, copy=True).contiguous()
        dn_plain = _pick(down, chunk).to(cfg.dtype, copy=True).contiguous()
        gu: Weight = quantize_weight(gu_plain, quant.scheme) if quant.quantized else gu_plain
        dn: Weight = quantize_weight(dn_plain, quant.scheme) if quant.quantized else dn_plain
        parts.append(_tp_slice(ExpertWeights(gu, dn, quant.scheme, _bias_part(gate_up_bias, chunk, cfg.dtype),
                                             _bias_part(down_bias, chunk, cfg.dtype)), cfg, spec))
    return ExpertWeights(_cat_experts([p.gate_up for p in parts]), _cat_experts([p.down for p in parts]),
                         quant.scheme, _cat_biases([p.gate_up_bias for p in parts]),
                         _cat_biases([p.down_bias for p in parts]))


def _cat_biases(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    # Every part has a bias or none does (one config, one TP rank).
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(cast(list[torch.Tensor], parts), dim=0)


def prepare_experts(gate_up: torch.Tensor, down: torch.Tensor, cfg: MoEConfig, quant: QuantConfig,
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> ExpertWeights:
    """Every expert in ``cfg.dtype``, quantized with ``quant`` (per expert): what ``shard_experts``
    computes before it slices, for all E experts at once; ``shard_of`` then gives any rank's
    shard of it without quantizing again (bit-identical to ``shard_experts``)."""
    return shard_experts(gate_up, down, cfg, quant, ShardSpec(0, cfg.num_experts), gate_up_bias, down_bias)


def shard_of(experts: ExpertWeights, cfg: MoEConfig, quant: QuantConfig, spec: ShardSpec) -> ExpertWeights:
    """This rank's shard of ``prepare_experts``' result (which stays untouched; the shard owns
    its storage)."""
    spec.validate(cfg, quant)
    ids = torch.tensor(list(spec.logical_experts), dtype=torch.int64)
    gate_up, down = experts.gate_up, experts.down
    gu: Weight
    dn: Weight
    if isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight):
        gu, dn = gate_up.select_experts(ids), down.select_experts(ids)
    elif isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
        gu, dn = gate_up[ids], down[ids]  # advanced indexing copies
    else:
        raise TypeError(f"shard_of: gate_up and down must both be tensors or both QuantizedWeight, got "
                        f"{type(gate_up).__name__} and {type(down).__name__}")
    pick = lambda b: None if b is None else b[ids]  # noqa: E731  (advanced indexing copies)
    return _tp_slice(ExpertWeights(gu, dn, experts.scheme, pick(experts.gate_up_bias), pick(experts.down_bias)),
                     cfg, spec)


def _tp_slice(experts: ExpertWeights, cfg: MoEConfig, spec: ShardSpec) -> ExpertWeights:
    gu, dn = experts.gate_up, experts.down
    gu_bias, dn_bias = experts.gate_up_bias, experts.down_bias
    if spec.tp_size > 1:
        I = cfg.intermediate_size
        w = I // spec.tp_size
        lo, hi = spec.tp_rank * w, (spec.tp_rank + 1) * w
        rows = cfg.activation_kind.gate_up_rows(lo, hi, I)
        gu = _cat_rows([_slice_rows(gu, r.start, r.stop) for r in rows])
        dn = _slice_cols(dn, lo, hi)
        if experts.scheme == "none":
            assert isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor)  # scheme "none" holds tensors
            gu, dn = gu.contiguous(), dn.contiguous()
        if gu_bias is not None:
            gu_bias = torch.cat([gu_bias[:, r] for r in rows], dim=1)
        # The TP ranks' outputs are partial sums that are all-reduced: the down bias is added once.
        dn_bias = dn_bias if spec.tp_rank == 0 else None
    return ExpertWeights(gu, dn, experts.scheme, gu_bias, dn_bias)

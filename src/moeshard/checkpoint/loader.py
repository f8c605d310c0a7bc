"""One layer's MoE block from a Hugging Face model directory, as one rank needs it.

    config.json --------------------------> HFMoEModel -> MoEConfig (model shape, routing)
    *.safetensors (+ index) -- headers ---> names, shapes, dtypes checked before any data is read
                            -- router, bias, shared experts (small): read whole
                            -- routed experts: only this rank's experts / slice of I (``experts``)
    -> LoadedBlock -> build_layer(...) -> MoELayer

Nothing here needs a process group: the layout (``ParallelConfig``) and the rank say what to
read, so a loader can run (and be measured) alone. ``build_layer`` hands the result to
``MoELayer`` as ``weights`` (router, bias, shared experts) plus ``local_experts``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moeshard.checkpoint.dense import in_dtype, read_stored
from moeshard.checkpoint.experts import ExpertReader
from moeshard.checkpoint.hf_config import HFMoEModel, read_hf_config
from moeshard.checkpoint.names import BlockNames, resolve_block_names
from moeshard.checkpoint.reader import SafetensorsCheckpoint
from moeshard.config import MoEConfig, QuantConfig, parse_dtype
from moeshard.eplb.placement import Placement
from moeshard.experts.base import ExpertWeights
from moeshard.parallel.config import ParallelConfig
from moeshard.quant import FP8_BLOCK, QuantizedWeight
from moeshard.sharding import ShardSpec, shard_spec
from moeshard.weights import MoEWeights


@dataclass(frozen=True)
class LoadedBlock:
    """One rank's view of one MoE block.

    model: what config.json says; layer: the layer index; cfg: the block's ``MoEConfig`` (in the
    dtype the layer will run in); quant: the expert quantization; parallel/rank/spec: the layout,
    this rank, and which experts / slice of I it holds; names: where the tensors were found;
    weights: router ``gate`` [E, H], ``correction_bias`` fp32 [E], router ``gate_bias`` [E] and
    shared experts, in ``cfg.dtype``, with the routed experts' tensors None; local_experts: this
    rank's routed experts, ``gate_up`` [E_l, 2 I_l, H], ``down`` [E_l, H, I_l], quantized for
    ``quant``, with their biases when the config has ``expert_bias``; shared_stored: with
    ``quant.shared`` fp8_block in an FP8 block checkpoint whose shared MLP is stored in fp8, that
    MLP as one fp8_block expert with the file's codes and scales (``MoELayer``'s shared_stored),
    else None.
    """

    model: HFMoEModel
    layer: int
    cfg: MoEConfig
    quant: QuantConfig
    parallel: ParallelConfig
    rank: int
    spec: ShardSpec
    names: BlockNames
    weights: MoEWeights
    local_experts: ExpertWeights
    placement: Placement | None = None
    shared_stored: ExpertWeights | None = None


def resolve_quant(model: HFMoEModel, quant: QuantConfig | str | None) -> QuantConfig:
    """The expert quantization: ``None`` means the checkpoint's own (``CheckpointFormat.stored_scheme``:
    fp8_block for an FP8 block checkpoint, fp8_token for one with per-tensor or per-row scales, else
    none). A quantized checkpoint loads as one of its ``stored_schemes`` (its weights read as stored)
    or as none (dequantized to the model dtype as they are read: for training, or to run in the
    model dtype), never requantized into another scheme."""
    if isinstance(quant, str):
        quant = QuantConfig(quant)
    stored = model.format.stored_schemes
    if quant is None:
        return QuantConfig(stored[0] if stored else "none")
    if stored and quant.scheme not in (*stored, "none"):
        raise ValueError(f"quant {quant.scheme!r} was asked for, but {model.source} describes "
                         f"{model.format.summary}, which loads only as quant {' or '.join(map(repr, stored))} "
                         f"(as stored) or 'none' (dequantized)")
    return quant


class _SmallTensors:
    """Router, correction bias and shared experts: read whole, checked, in the model dtype."""

    def __init__(self, ckpt: SafetensorsCheckpoint, names: BlockNames, cfg: MoEConfig, weight_scales: str | None) -> None:
        self.ckpt, self.names, self.cfg, self.weight_scales = ckpt, names, cfg, weight_scales
        self._read: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def stored(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A tensor as stored, read once (``read_stored``): the shared MLP's serve both its
        model-dtype weights and ``shared_stored``."""
        if name not in self._read:
            self._read[name] = read_stored(self.ckpt, name, shape, self.weight_scales)
        return self._read[name]

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A weight in ``dtype`` (default the model dtype); see ``read_dense``."""
        return in_dtype(*self.stored(name, shape), dtype or self.cfg.dtype, self.weight_scales)

    def correction_bias(self) -> torch.Tensor:
        """fp32 [E]: the bias decides routing, so it stays fp32 as the layer keeps it. Stored [E],
        or [1, E] as ERNIE 4.5 stores it."""
        name, E = self.names.correction_bias, self.cfg.num_experts
        rows = self.ckpt.has(name) and self.ckpt.info(name).shape == (1, E)
        return self.dense(name, (1, E) if rows else (E,), torch.float32).reshape(E)

    def shared_stored(self, quant: QuantConfig) -> ExpertWeights | None:
        """The shared MLP as one fp8_block expert (gate_up [1, 2S, H]: gate's tiles then up's;
        down [1, H, S]) with the file's codes and scales, where ``quant.shared`` is fp8_block and
        all three are stored in fp8; None otherwise, and where S is not a multiple of 128 (a
        128-row tile would then hold gate and up rows, which no stored scale describes)."""
        cfg, n = self.cfg, self.names
        if not (self.weight_scales == "block" and cfg.has_shared_experts and quant.shared == "fp8_block"):
            return None
        H, S = cfg.hidden_size, cfg.shared_width
        if S % FP8_BLOCK:
            return None
        if n.shared_fused:  # already gate's rows then up's, and S a multiple of the tile
            gu, gus = self.stored(n.shared("gate_up"), (2 * S, H))
        else:
            (g, gs), (u, us) = (self.stored(n.shared(p), (S, H)) for p in ("gate", "up"))
            gu, gus = torch.cat([g, u]), None if gs is None or us is None else torch.cat([gs, us])
        d, ds = self.stored(n.shared("down"), (H, S))
        if gus is None or ds is None:
            return None
        gate_up = QuantizedWeight("fp8_block", gu.unsqueeze(0), gus.unsqueeze(0), None, (1, 2 * S, H))
        return ExpertWeights(gate_up, QuantizedWeight("fp8_block", d.unsqueeze(0), ds.unsqueeze(0), None, (1, H, S)),
                             "fp8_block")

    def shared_gate_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared MLP's gate and up weights [S, H] in the model dtype, from one fused
        ``gate_up_proj`` [2S, H] (dequantized whole, then split: its fp8 scale blocks may hold
        rows of both) where the checkpoint stores them so."""
        n, H, S = self.names, self.cfg.hidden_size, self.cfg.shared_width
        if n.shared_fused:
            gate_up = self.dense(n.shared("gate_up"), (2 * S, H))
            return gate_up[:S].contiguous(), gate_up[S:].contiguous()
        return self.dense(n.shared("gate"), (S, H)), self.dense(n.shared("up"), (S, H))

    def weights(self) -> MoEWeights:
        cfg, n = self.cfg, self.names
        E, H, S = cfg.num_experts, cfg.hidden_size, cfg.shared_width
        shared_gate, shared_up = self.shared_gate_up() if cfg.has_shared_experts else (None, None)
        return MoEWeights(
            gate=self.dense(n.router, (E, H)) if n.family.linear_router else None,
            gate_up=None,
            down=None,
            correction_bias=self.correction_bias() if cfg.use_correction_bias else None,
            shared_gate=shared_gate,
            shared_up=shared_up,
            shared_down=self.dense(n.shared("down"), (H, S)) if cfg.has_shared_experts else None,
            shared_expert_gate=self.dense(n.shared_expert_gate, (1, H)) if cfg.shared_expert_gate else None,
            gate_bias=self.dense(n.router_bias, (E,)) if cfg.routing_kind.router_bias else None,
        )


def load_moe_block(model_dir: str | Path, layer: int, *, parallel: ParallelConfig | None = None, rank: int = 0,
                   quant: QuantConfig | str | None = None, dtype: torch.dtype | str | None = None,
                   placement: Placement | None = None) -> LoadedBlock:
    """Reads layer ``layer``'s MoE block for ``rank`` of ``parallel`` (default: one rank).

    quant: expert quantization (None: the checkpoint's own, see ``resolve_quant``); dtype: the
    model dtype to run in (None: the checkpoint's declared dtype, else fp32); placement:
    expert-parallel load balancing (``moeshard.eplb.Placement``): the rank reads the logical
    expert of each of its physical slots, once per slot.
    Everything that can be checked from config.json and the safetensors headers is checked
    before any tensor data is read; every refusal is a ValueError naming the field or tensor.
    """
    model = read_hf_config(model_dir)
    model.check_layer(layer)
    quant = resolve_quant(model, quant)
    cfg = model.moe_config(parse_dtype(dtype) if dtype is not None else None)
    parallel = parallel or ParallelConfig()
    parallel.validate(parallel.world_size, cfg, rank)
    spec = shard_spec(parallel, rank, cfg.num_experts, placement)
    spec.validate(cfg, quant)
    ckpt = SafetensorsCheckpoint(model_dir)
    names = resolve_block_names(ckpt, model, layer)
    # The router's header shape [E, H] first: it ties the config's expert count to what the files
    # hold before anything loops over experts (a config may claim 10^9 of them). A router that is
    # not such a linear (``linear_router=False``) is transformers' to run and moeshard's to skip.
    if model.family.linear_router:
        ckpt.expect(names.router, (cfg.num_experts, cfg.hidden_size))
    experts = ExpertReader(ckpt, names, cfg, model.format)  # checks every expert tensor's shape
    small = _SmallTensors(ckpt, names, cfg, model.format.weight_scales)
    weights = small.weights()
    weights.validate(cfg, routed=False, router=model.family.linear_router)
    local = experts.read(quant, spec)
    return LoadedBlock(model=model, layer=layer, cfg=cfg, quant=quant, parallel=parallel, rank=rank, spec=spec,
                       names=names, weights=weights, local_experts=local, placement=placement,
                       shared_stored=small.shared_stored(quant))


def build_layer(block: LoadedBlock, groups=None, backend: str | None = None, device=None):
    """The ``MoELayer`` of a loaded block. groups: this rank's ``ParallelGroups`` (None for one
    rank; its layout must be ``block.parallel``); backend, device: as ``MoELayer``."""
    from moeshard.layer import MoELayer

    layout = groups.config if groups is not None else ParallelConfig()
    if layout != block.parallel or (groups is not None and groups.rank != block.rank):
        raise ValueError(f"build_layer: the block was loaded for rank {block.rank} of {block.parallel.name}, but "
                         f"the groups are rank {groups.rank if groups else 0} of {layout.name}")
    return MoELayer(block.cfg, quant=block.quant, groups=groups, backend=backend, weights=block.weights,
                    local_experts=block.local_experts, device=device, placement=block.placement,
                    shared_stored=block.shared_stored)

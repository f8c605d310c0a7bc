"""A whole transformers MoE model under a (dp, tp, ep) layout: every MoE block becomes a moeshard
``MoELayer``; attention, norms, embeddings, dense MLP layers and the LM head stay transformers'.

    shard_moe_blocks(model, groups, quant=..., backend=...)
        a model already in memory (the full weights on every rank): each rank keeps its shard of
        every MoE block's experts and drops the rest
    load_sharded_model(model_dir, groups, quant=..., backend=..., dtype=..., device=...)
        from a checkpoint directory: transformers builds the model on the meta device, each rank
        reads the non-expert weights and, per MoE layer, only its slices of the experts
        (``moeshard.checkpoint.load_moe_block``), so a model too large for one device in full
        loads on several
    save_sharded_model(model, groups, model_dir, directory)
        back to a Hugging Face checkpoint (after training, say): rank 0 puts every rank's shard
        of the experts where transformers holds it and saves with transformers' save_pretrained

Both replace ``model.model.layers[L].mlp`` (the family's ``layers`` path and block attribute,
``families.ModelFamily``) of every MoE layer ``L`` (the layers the model family's config says
have an MoE block; DeepSeek-V3's first dense layers and Qwen's
``mlp_only_layers`` are left alone) with an ``MoEBlock``: a ``MoELayer`` that takes and returns
the block's ``[batch, seq, H]`` and keeps transformers' own router module as ``gate``. That
router runs on every forward, on all of this rank's tokens, exactly as in transformers, so
``output_router_logits`` (transformers 5 records the router's first output with a forward
hook) and the auxiliary loss built from it are unchanged; the experts the tokens go to are
chosen by moeshard's router on the same weight (logits in the family's ``router_dtype``, as
transformers' router computes them; ties to the lower index).

Layouts of a whole model (global rank ``r = dp_rank * tp + tp_rank``)::

    layout          experts on a rank        what each rank runs                   collectives per MoE block
    (1,1,off)       all                      every prompt                          none
    (1,tp,off) TP   all, I / tp              every prompt (same on all TP ranks)   all-reduce over TP
    (dp,1,off) DP   all                      its own prompts                       none
    (dp,tp,off)     all, I / tp              its DP rank's prompts                 all-reduce over TP
    (dp,1,on) EP    E / dp, whole            its own prompts                       dispatch/combine over all ranks
    (dp,tp,on) SP   E / (dp*tp), whole       its DP rank's prompts; routes 1/tp    dispatch/combine over all ranks,
                                             of their tokens                       all-gather over TP

Everything outside the MoE blocks is replicated: each rank holds the full attention, norms,
embeddings and LM head, and runs them on its DP rank's prompts.

Cross-rank preconditions (what the caller of the model's forward must keep):
  * the TP ranks of one DP rank run the same tokens (same prompts, same steps), as the layer
    expects; moeshard's ``generate`` command makes them also pick the same next token;
  * with EP on, every MoE block's forward is a collective over all ranks: every rank calls the
    model's forward the same number of times (token counts may differ, zero included);
    a rank that stops early (say at EOS) leaves the others waiting until the group times out;
  * with EP off and tp == 1 (DP) the ranks are independent.
Refused, before any collective, with a ValueError naming the field and the values: a model type
moeshard does not know, a layout whose world size differs from the process group's, an expert
count not divisible by the EP size, an intermediate size not divisible by tp (or not aligned to
the quantization's block under TP), a backend / quantization / layout combination the registry
does not support, a model on another device than the process group's, a model whose blocks are
already moeshard's, and (``shard_moe_blocks``) a model transformers loaded pre-quantized. When
one rank fails to load, every rank raises (with that rank's reason) before the first collective.

Training: gradients flow through every block under every layout (``moeshard.autograd``) when
the model's parameters require grad; ``moeshard.training.reduce_gradients`` then completes each
over its group (the blocks' own parameters by their layout, everything else over DP). The
auxiliary loss transformers computes from the router logits is over each rank's own tokens, not
the global batch, and under SP it would reach the router once per TP rank: train with
``moeshard.training.router_losses`` instead (docs/training.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
from torch import nn

from moeshard.autograd.roles import GradRole, replicated_role
from moeshard.checkpoint.block_state import canonical_state
from moeshard.checkpoint.dense import read_dense
from moeshard.checkpoint.families import READ_FUSED_LAYOUTS, ModelFamily
from moeshard.checkpoint.hf_config import HFMoEModel, parse_hf_config, read_hf_config
from moeshard.checkpoint.loader import resolve_quant
from moeshard.checkpoint.names import BlockNames
from moeshard.checkpoint.reader import SafetensorsCheckpoint
from moeshard.config import MODEL_DTYPES, MoEConfig, QuantConfig, parse_dtype
from moeshard.dispatch.registry import default_backend, support
from moeshard.errors import MoeshardError
from moeshard.integrations.given_routing import MoEExperts
from moeshard.layer import MoELayer
from moeshard.parallel.agree import first_failure
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.router import Routing, route_tokens
from moeshard.sharding import shard_spec
from moeshard.weights import MoEWeights

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MoEBlock", "find_moe_blocks", "load_sharded_model", "moe_model_info", "shard_moe_blocks",
           "check_layout"]


class MoEBlock(MoELayer):
    """A transformers MoE block run by moeshard: ``forward(hidden_states [..., H]) -> [..., H]``.

    router: the block's transformers router module (the family's ``router``, ``gate``: ``weight``
    [E, H], DeepSeek-V3's ``e_score_correction_bias`` [E], gpt-oss's ``bias`` [E]); registered as
    ``router_name``, it replaces ``MoELayer``'s own ``gate``, so the router keeps transformers'
    names and its forward hooks (transformers' router-logit recorder) keep firing. router_weight,
    correction_bias: the router's weight and selection-bias parameter names inside it (dotted:
    AFMoE's ``gate.weight``, Hunyuan's ``wg.weight``; a bias held [1, E], as ERNIE 4.5 holds it, is
    read as [E]); router_bias: the router linear's bias parameter name (read when the routing kind
    has ``router_bias``). block_bias: None, or the name under which the block itself holds the
    selection bias (MiniMax-M2, AFMoE, LFM2-MoE): the block then keeps ``weights``' bias as that
    buffer [E] and calls the router as transformers does, ``router(rows, bias)`` (with
    ``use_correction_bias`` False the bias is None, as LFM2-MoE passes it without
    ``use_expert_bias``).
    router_input: ``"rows"``: the router is called on the rows [T, H]; ``"block"``: on the
    block's input as given (``ModelFamily.router_input``).
    returns_router_output: None, or i: ``forward`` returns ``(output, router(x)[i])`` as the
    family's block does. output_bias_name: None, or the name of the block's learned output bias
    (``ModelFamily.output_bias``, JetMoE's ``bias``); output_bias: its value [H] in the model dtype,
    the same on every rank, held as a parameter under that name and added to the layer's output
    rows (after a sequence-parallel gather, so each rank adds it to whole rows): its gradient is a
    replicated parameter's outside the layer (``gradient_roles``). output_norm_name, output_norm:
    None, or the name and transformers' module of a norm the block applies to its output last
    (``ModelFamily.output_norm``, A.X-K1's ``post_mlp_layernorm``), registered under that name and
    applied after the output bias to whole rows (after a sequence-parallel gather): its parameters
    are replicated parameters outside the layer too. layer: the decoder layer index (for
    messages). Other arguments as ``MoELayer``.
    """

    def __init__(self, router: nn.Module, cfg: MoEConfig, *, layer: int | None = None, router_name: str = "gate",
                 router_weight: str = "weight", correction_bias: str = "e_score_correction_bias",
                 router_bias: str = "bias", block_bias: str | None = None,
                 returns_router_output: int | None = None, router_input: str = "rows",
                 output_bias_name: str | None = None, output_bias: torch.Tensor | None = None,
                 output_norm_name: str | None = None, output_norm: nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__(cfg, **kwargs)
        weight = _tensor_at(router, router_weight)
        if weight is None or tuple(weight.shape) != (cfg.num_experts, cfg.hidden_size):
            raise ValueError(f"MoEBlock (layer {layer}): the router's {router_weight} must be [num_experts="
                             f"{cfg.num_experts}, hidden_size={cfg.hidden_size}], got "
                             f"{None if weight is None else tuple(weight.shape)}")
        self.layer_index = layer
        self.router_name, self.router_weight, self.bias_name, self.block_bias = (router_name, router_weight,
                                                                                 correction_bias, block_bias)
        self.router_bias_name = router_bias
        self.returns_router_output = returns_router_output
        self.router_input = router_input
        if block_bias is not None and cfg.use_correction_bias:
            bias = self.gate.e_score_correction_bias
            if bias is None:
                raise ValueError(f"MoEBlock (layer {layer}): block_bias={block_bias!r} with use_correction_bias "
                                 f"needs the bias in weights")
            self.register_buffer(block_bias, bias)
        self.output_bias_name = output_bias_name
        if self._output_part(layer, "output_bias", output_bias_name, output_bias):
            assert output_bias_name is not None and output_bias is not None  # _output_part checked both
            if tuple(output_bias.shape) != (cfg.hidden_size,) or output_bias.dtype != cfg.dtype:
                raise ValueError(f"MoEBlock (layer {layer}): the block's output bias {output_bias_name!r} must be "
                                 f"[hidden_size={cfg.hidden_size}] in {cfg.dtype}, got {list(output_bias.shape)} "
                                 f"in {output_bias.dtype}")
            self.register_parameter(output_bias_name, nn.Parameter(output_bias.detach().to(self.device),
                                                                   requires_grad=output_bias.requires_grad))
        self.output_norm_name = output_norm_name
        if self._output_part(layer, "output_norm", output_norm_name, output_norm):
            assert output_norm_name is not None and output_norm is not None  # _output_part checked both
            self.add_module(output_norm_name, output_norm.to(self.device))
        # transformers' router stands in for MoELayer's Gate, under the family's router name.
        if router_name != "gate":
            del self.gate
        self.add_module(router_name, router.to(self.device))

    def _output_part(self, layer: int | None, what: str, name: str | None, value: object) -> bool:
        """Whether the block holds a part applied to its output (``what``: output_bias or
        output_norm) under ``name``: ValueError where the name and the value do not come together,
        or the name is the layer's own attribute."""
        if (name is None) != (value is None):
            raise ValueError(f"MoEBlock (layer {layer}): {what}_name={name!r} and {what} "
                             f"({'None' if value is None else 'given'}) go together")
        if name is not None and hasattr(self, name):
            raise ValueError(f"MoEBlock (layer {layer}): {what}_name={name!r} is taken by the layer's own attribute "
                             f"of that name")
        return name is not None

    @property
    def hf_router(self) -> nn.Module:
        """The transformers router module (the family's ``router`` attribute of this block)."""
        module = getattr(self, self.router_name)
        assert isinstance(module, nn.Module)  # registered in __init__
        return module

    def route(self, x: torch.Tensor) -> Routing:
        """x: [T, H] rows this rank routes -> top-k ids / fp32 weights (moeshard's router on the
        transformers router's weight, selection bias and, for a kind with ``router_bias``, bias)."""
        weight = _tensor_at(self.hf_router, self.router_weight)
        assert weight is not None  # checked in __init__
        bias = getattr(self.hf_router, self.router_bias_name, None) if self.cfg.routing_kind.router_bias else None
        return route_tokens(x, weight, self.cfg, self._selection_bias(), bias)

    def _selection_bias(self) -> torch.Tensor | None:
        """fp32 [E]: the block's own bias (``block_bias``), else the router's; None without a
        selection bias."""
        if not self.cfg.use_correction_bias:
            return None
        if self.block_bias is not None:
            return getattr(self, self.block_bias)
        bias = _tensor_at(self.hf_router, self.bias_name)  # dotted (ERNIE 4.5), held [1, E] there
        return None if bias is None else bias.reshape(-1)

    # The block keeps transformers' contract (a tuple for some families), not MoELayer's [T, H].
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, Any]:  # type: ignore[override]
        """hidden_states: [..., H] (transformers passes [batch, seq, H]) in the model dtype ->
        the same shape (with ``returns_router_output`` i: ``(that, router output i)``, as the
        family's block returns). The transformers router runs first on all rows, for its outputs'
        observers (``output_router_logits``); its routing is not used."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        rows = hidden_states if self.router_input == "block" else x  # as the transformers block passes them
        if self.block_bias is not None:  # LFM2-MoE passes None without a bias
            router_out = self.hf_router(rows, self._selection_bias())
        else:
            router_out = self.hf_router(rows)
        out = super().forward(x).reshape(shape)
        if self.output_bias_name is not None:
            out = out + getattr(self, self.output_bias_name)
        if self.output_norm_name is not None:
            out = getattr(self, self.output_norm_name)(out)
        if self.returns_router_output is not None:
            return out, router_out[self.returns_router_output]
        return out

    def gradient_roles(self) -> dict[str, GradRole]:
        """``MoELayer.gradient_roles``, with the block's output bias and output norm's parameters
        as replicated parameters outside the layer: every rank applies them to whole rows (after
        any sequence-parallel gather), so the TP ranks of a DP rank hold the same gradient and
        only DP ranks sum."""
        roles = super().gradient_roles()
        rank = self.groups.rank if self.groups is not None else 0
        if self.output_bias_name is not None:
            roles[self.output_bias_name] = replicated_role(rank)
        if self.output_norm_name is not None:
            for local, _ in getattr(self, self.output_norm_name).named_parameters():
                roles[f"{self.output_norm_name}.{local}"] = replicated_role(rank)
        return roles

    def extra_repr(self) -> str:
        s = self.shard
        return (f"layer={self.layer_index}, layout={self.parallel.name}, backend={self.backend_name}, "
                f"quant={self.quant.name}, experts=[{s.expert_start}, {s.expert_stop}) of {self.cfg.num_experts}")


def _tensor_at(module: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer at dotted ``name`` under ``module`` (``wg.weight``), None if absent."""
    owner, _, leaf = name.rpartition(".")
    try:
        holder = module.get_submodule(owner) if owner else module
    except AttributeError:
        return None
    value = getattr(holder, leaf, None)
    return value if isinstance(value, torch.Tensor) else None


# -- finding the blocks -----------------------------------------------------------------------
def moe_model_info(model: nn.Module) -> HFMoEModel:
    """What moeshard reads from the model's config (family, MoE shape and routing, dense layers);
    ValueError for a model type moeshard does not support."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"{type(model).__name__} has no transformers config (model.config); expected a "
                         f"transformers PreTrainedModel")
    return parse_hf_config(config.to_dict(), f"{type(model).__name__}.config")


def _decoder_layers(model: nn.Module, family: ModelFamily) -> nn.ModuleList:
    """The decoder layers at the family's ``layers`` path (``model.layers``) of a causal LM, or at
    that path less its first part in the bare decoder (``layers``)."""
    path = family.model_layers or family.layers
    tried = [path, path.partition(".")[2]]
    for where in [t for t in tried if t]:
        try:
            layers = model.get_submodule(where)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__}: no decoder layers found (expected a ModuleList at "
                     f"{' or '.join(repr(t) for t in tried if t)})")


def _block_attribute(layer: nn.Module, family: ModelFamily) -> str:
    """The first of the family's block attributes the decoder layer has (``mlp``)."""
    for attr in family.block_attributes:
        if getattr(layer, attr, None) is not None:
            return attr
    return family.block_attributes[-1]


def _block_of(layer: nn.Module, family: ModelFamily) -> nn.Module | None:
    """The decoder layer's MoE block: the layer itself where the family's block prefix is ""
    (Gemma 4's layer holds its router and experts), else the attribute that holds it."""
    return layer if family.block_is_layer else getattr(layer, _block_attribute(layer, family), None)


def _replaced_name(layer: nn.Module, family: ModelFamily) -> str:
    """The module moeshard replaces, relative to the decoder layer: the block (``mlp``), or for an
    ``experts_only`` family the block's experts module (``experts``, ``mlp.experts``)."""
    if not family.experts_only:
        return _block_attribute(layer, family)
    return family.experts if family.block_is_layer else f"{_block_attribute(layer, family)}.{family.experts}"


def find_moe_blocks(model: nn.Module) -> dict[int, nn.Module]:
    """layer index -> the transformers MoE block (``layers[L].mlp``: the family's ``layers`` and
    block attribute) of every MoE layer, in order.

    Refuses a model whose MoE layers do not hold a block with the family's router and experts,
    and a model whose blocks are already ``MoEBlock``s. For a family whose decoder layer routes
    itself (``experts_only`` with the block prefix "", Gemma 4) the "block" is the decoder layer,
    which holds the router and the experts; for DeepSeek-V4 (``experts_only`` under ``mlp``) it is
    the block, which routes itself. An experts module already an ``MoEExperts`` is refused the
    same way."""
    info = moe_model_info(model)
    family = info.family
    layers = _decoder_layers(model, family)
    if len(layers) != info.num_layers:
        raise ValueError(f"{type(model).__name__}: {len(layers)} decoder layers, but its config says "
                         f"{info.family.layer_count if isinstance(info.family.layer_count, str) else 'its layer types'}"
                         f"={info.num_layers}")
    blocks: dict[int, nn.Module] = {}
    for index, layer in enumerate(layers):
        if index in info.dense_layers:
            continue
        block = _block_of(layer, family)
        done = getattr(block, family.experts, None) if family.experts_only else block
        if isinstance(done, MoELayer):
            raise ValueError(f"{type(model).__name__}: layer {index}'s MoE block is already a moeshard "
                             f"{type(done).__name__} (layout {done.parallel.name}); shard a model once")
        # The experts' module, or where the block holds them itself (JetMoE) their fused gate_up.
        experts = family.experts or family.expert_tensor(family.fused_names[0])
        held = block is not None and (getattr(block, experts, None) is not None if family.experts
                                      else _tensor_at(block, experts) is not None)
        if block is None or not isinstance(getattr(block, family.router, None), nn.Module) or not held:
            at = "the decoder layer" if family.block_is_layer else \
                " or ".join("." + a for a in family.block_attributes)
            raise ValueError(f"{type(model).__name__}: layer {index} should hold an MoE block with a router "
                             f"({family.router}) and experts ({experts}) at {at}, found {type(block).__name__}")
        blocks[index] = block
    return blocks


# -- checks before any collective -------------------------------------------------------------
def _quant(quant: QuantConfig | str | None) -> QuantConfig | None:
    return QuantConfig(quant) if isinstance(quant, str) else quant


def check_layout(cfg: MoEConfig, quant: QuantConfig, parallel: ParallelConfig, backend: str | None = None,
                 device: str = "cpu", rank: int | None = None) -> str:
    """Refuses (ValueError naming the field and values) what no rank of ``parallel`` could run
    for blocks of ``cfg``; returns the backend. Pure: every rank (and a parent before any rank
    starts) can call it."""
    parallel.validate(parallel.world_size, cfg, rank)
    quant.check_model(cfg, "quant" if rank is None else f"quant (rank {rank})")
    backend = backend or default_backend(parallel)
    ok, reason = support(backend, quant, parallel, device=device)
    if not ok:
        raise ValueError(f"backend {backend!r} cannot run layout {parallel.name} with quant {quant.name!r} on "
                         f"{device}: {reason}")
    for r in range(parallel.world_size):
        shard_spec(parallel, r, cfg.num_experts).validate(cfg, quant)
    return backend


def _layout(groups: ParallelGroups | None) -> tuple[ParallelConfig, int]:
    if groups is None:
        return ParallelConfig(), 0
    if not isinstance(groups, ParallelGroups):
        raise ValueError(f"groups: expected moeshard ParallelGroups or None, got {type(groups).__name__}")
    return groups.config, groups.rank


def agree(groups: ParallelGroups | None, error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed ``what`` (one all_gather_object of the reasons),
    so a rank that cannot go on makes every rank raise with that rank's reason instead of leaving
    the others waiting in the next collective. A ValueError stays a ValueError everywhere,
    anything else becomes a RuntimeError, except on the rank that raised an expected failure of
    its own (``MoeshardError``: a one-rank run's ``--timeout`` deadline, exit code 5), which
    raises it unchanged. The reasons are our own (kind, text) strings."""
    rank = groups.rank if groups is not None else 0
    failure = first_failure(groups, error, rank)
    if isinstance(error, MoeshardError):
        raise error
    if failure is not None:
        kind, text, failed = failure
        also = f" (ranks that failed {what}: {failed})" if len(failed) > 1 else ""
        raise (ValueError if kind == "ValueError" else RuntimeError)(text + also) from error


# -- a model already in memory ----------------------------------------------------------------
def _gate_up(block: nn.Module, index: int, name: str, family: ModelFamily) -> torch.Tensor:
    """The fused ``experts.gate_up_proj`` of layer ``index``'s block (transformers 5; the family's
    ``experts`` and ``fused_names``)."""
    name_in_model = family.expert_tensor(family.fused_names[0])  # dotted: DBRX's experts.mlp.w1
    w = _tensor_at(block, name_in_model)
    if w is None and name_in_model in family.stored_names:  # an older release under the checkpoint's name
        w = _tensor_at(block, family.stored_names[name_in_model])
    if w is None:
        raise ValueError(f"{name}: the experts of layer {index} are not a fused gate_up_proj tensor; "
                         f"expected transformers-5 fused experts in one of {sorted(MODEL_DTYPES)}")
    return w


def _model_dtype(blocks: dict[int, nn.Module], name: str, family: ModelFamily) -> torch.dtype:
    index = next(iter(blocks))
    w = _gate_up(blocks[index], index, name, family)
    if w.dtype not in MODEL_DTYPES.values():
        raise ValueError(f"{name}: the experts of layer {index} are {w.dtype}; "
                         f"expected transformers-5 fused experts in one of {sorted(MODEL_DTYPES)}")
    return w.dtype


def _router_names(family: ModelFamily) -> dict[str, Any]:
    return {"router_name": family.router, "router_weight": family.router_weight,
            "correction_bias": family.correction_bias, "router_bias": family.router_bias,
            "block_bias": family.block_bias, "returns_router_output": family.returns_router_output,
            "router_input": family.router_input, "output_bias_name": family.output_bias,
            "output_norm_name": family.output_norm}


def shard_moe_blocks(model: nn.Module, groups: ParallelGroups | None = None, *, quant: QuantConfig | str | None = None,
                     backend: str | None = None) -> nn.Module:
    """Replaces every MoE block of a loaded transformers model with an ``MoEBlock`` under the
    layout of ``groups`` (None: one device) and returns the model (changed in place).

    model: a transformers model of a family moeshard knows (``checkpoint.families``) with its full
    weights, the same on every rank, on this rank's device (``groups.device``); quant: expert
    quantization (default none); backend: dispatch backend (default: the layout's).
    Collective when groups is given: every rank of the world calls it with the same model.
    Each rank keeps only its shard of the experts; the full expert tensors are released.
    """
    quant = _quant(quant) or QuantConfig()
    parallel, rank = _layout(groups)
    name = type(model).__name__
    error: Exception | None = None
    work: list[tuple[int, nn.Module, MoEWeights, torch.Tensor | None, nn.Module | None]] = []
    cfg: MoEConfig | None = None
    device: torch.device | None = None
    try:
        if getattr(model, "hf_quantizer", None) is not None or getattr(model.config, "quantization_config", None):
            raise ValueError(f"{name} was loaded pre-quantized by transformers; load it with "
                             f"moeshard.integrations.transformers.load_sharded_model(model_dir, ...) instead")
        info = moe_model_info(model)
        blocks = find_moe_blocks(model)
        if not blocks:
            raise ValueError(f"{name}: no MoE block to shard (every layer is dense)")
        family = info.family
        if family.fused_layout not in READ_FUSED_LAYOUTS:
            raise ValueError(f"{name}: fused layout {family.fused_layout!r} of model_type {family.model_type!r} is "
                             f"not read yet (readable: {list(READ_FUSED_LAYOUTS)})")
        cfg = info.moe_config(_model_dtype(blocks, name, family))
        first = next(iter(blocks))
        device = groups.device if groups is not None else _gate_up(blocks[first], first, name, family).device
        backend = check_layout(cfg, quant, parallel, backend, device.type, rank)
        for index, block in blocks.items():
            where = _gate_up(block, index, name, family).device
            if where.type != device.type or (device.index is not None and where.index != device.index):
                raise ValueError(f"{name}: layer {index}'s experts are on {where}, but this rank computes on {device} "
                                 f"(move the model to the process group's device first)")
            router = getattr(block, family.router)
            assert isinstance(router, nn.Module)  # find_moe_blocks checked every block's router
            # A transformers block may hold tensors the layer does not read (its own buffers): the
            # families' parity with transformers, not strictness, proves what is read.
            held = block.state_dict()
            if family.experts_only:  # only its router's and experts' tensors (not the shared experts')
                held = {k: v for k, v in held.items() if k.startswith((family.router + ".", family.experts + "."))}
            state = canonical_state(held, family, cfg.num_experts)
            bias = _tensor_at(block, family.output_bias) if family.output_bias is not None else None
            if family.output_bias is not None and bias is None:
                raise ValueError(f"{name}: layer {index}'s block has no output bias {family.output_bias!r}")
            norm = getattr(block, family.output_norm, None) if family.output_norm is not None else None
            if family.output_norm is not None and not isinstance(norm, nn.Module):
                raise ValueError(f"{name}: layer {index}'s block has no output norm module {family.output_norm!r}")
            weights = MoEWeights.from_state_dict(state, cfg, strict=False, router=family.linear_router)
            work.append((index, router, weights, bias, norm))
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it (see agree)
        error = exc
    agree(groups, error, "to prepare the model")
    assert cfg is not None and device is not None  # agree raised unless this rank prepared every block
    info = moe_model_info(model)
    family, identity, skips = info.family, info.identity_experts, info.zero_weight_skips
    layers = _decoder_layers(model, family)
    while work:
        index, router, weights, bias, norm = work.pop(0)  # out of work: the full experts go with the old block
        _replace_block(layers[index], family, router, cfg, layer=index, quant=quant, groups=groups, backend=backend,
                       weights=weights, device=device, output_bias=bias, output_norm=norm,
                       identity_experts=identity, zero_weight_skips=skips)
    return model


def _replace_block(decoder_layer: nn.Module, family: ModelFamily, router: nn.Module | None, cfg: MoEConfig, *,
                   output_bias: torch.Tensor | None = None, output_norm: nn.Module | None = None,
                   identity_experts: int = 0, zero_weight_skips: bool = False, **kwargs: Any) -> None:
    """Puts moeshard's module in the decoder layer: an ``MoEBlock`` (with transformers' router) in
    place of the block, or for an ``experts_only`` family an ``MoEExperts`` in place of its
    experts (the router stays where it is; ``identity_experts``: its zero-computation experts;
    ``zero_weight_skips``: its router's skips are picks of weight 0).
    kwargs: ``MoELayer``'s, and ``layer``."""
    if family.experts_only:
        block = _block_of(decoder_layer, family)
        assert block is not None  # find_moe_blocks found it
        setattr(block, family.experts, MoEExperts(cfg, identity_experts=identity_experts,
                                                  zero_weight_skips=zero_weight_skips, **kwargs))
        return
    assert router is not None  # every block family's router is loaded with its block
    setattr(decoder_layer, _block_attribute(decoder_layer, family),
            MoEBlock(router, cfg, output_bias=output_bias, output_norm=output_norm, **kwargs, **_router_names(family)))


# -- from a checkpoint directory --------------------------------------------------------------
def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Puts ``value`` in place of the parameter or buffer ``name`` (a meta tensor)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if leaf in module._parameters:
        old = module._parameters[leaf]
        assert old is not None  # name is one named_parameters gave, which skips None entries
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[leaf] = value


def _is_meta(t: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    return t is not None and t.is_meta


def _build_on_meta(model_dir: Path, dtype: torch.dtype):
    """transformers' model of ``model_dir``'s config.json on the meta device (nothing allocated)."""
    import transformers

    from moeshard.checkpoint.hf_model import model_class

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = model_class(config).from_config(config, dtype=dtype)
    _hold_as_loaded(model, dtype)
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(model_dir))
    return model


def _hold_as_loaded(model: nn.Module, dtype: torch.dtype) -> None:
    """Gives the meta model's tensors the dtypes ``from_pretrained`` loads them in, where they differ
    from ``from_config``'s: a model class keeps some in fp32 whatever ``dtype`` (its
    ``_keep_in_fp32_modules_strict`` for fp16 and bf16, ``_keep_in_fp32_modules`` for fp16),
    listed by its ``_get_dtype_plan`` and matched as transformers' loader matches them (each
    pattern searched in the tensor's name, ``*`` as ``.*``). Why: transformers 5.17's dots1 and
    EXAONE-MoE declare the selection bias without a dtype, so ``from_config`` in bf16 held it in
    bf16 and moeshard routed on the rounded bias, while transformers' loaded model keeps it in
    fp32 (5.24 declares it fp32)."""
    import re

    get_plan = getattr(model, "_get_dtype_plan", None)
    if get_plan is None:
        return
    plan = [(re.compile(pattern.replace("*", ".*")), held) for pattern, held in get_plan(dtype).items()]
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in tensors:
        held = next((held for pattern, held in plan if pattern.search(name)), None)
        if held is not None and t.dtype != held:
            _set(model, name, t.to(held))


def _load_router(model: nn.Module, ckpt: SafetensorsCheckpoint, prefix: str, names: BlockNames,
                 device: torch.device, weight_scales: str | None) -> nn.Module:
    """The block's transformers router with its weight (and bias) read from the checkpoint, in
    the dtypes transformers gave them (DeepSeek-V3 keeps its router in fp32)."""
    router = model.get_submodule(prefix + names.router_module)
    for local, t in list(router.named_parameters()) + list(router.named_buffers()):
        # The checkpoint's block prefix (Mixtral: block_sparse_moe.) and the family's stored name
        # (Granite: router.layer.weight for the model's router.weight).
        stored = names.stored(f"{names.router_module}.{local}")
        if f"{names.router_module}.{local}" == names.family.bias_module:
            stored = names.correction_bias  # the name this checkpoint keeps the bias under (EXAONE-MoE: the block's)
        _set(router, local, read_dense(ckpt, stored, tuple(t.shape), t.dtype, weight_scales).to(device))
    return router


def _load_output_norm(model: nn.Module, ckpt: SafetensorsCheckpoint, prefix: str, layer: int, names: BlockNames,
                      device: torch.device, weight_scales: str | None) -> nn.Module:
    """The block's output norm (``ModelFamily.output_norm``) with its tensors read from the
    checkpoint, under the block's prefix or, as A.X-K1's hub and transformers' saves keep it,
    under the decoder layer's."""
    family = names.family
    assert family.output_norm is not None  # asked for only then
    norm = model.get_submodule(prefix + family.output_norm)
    for local, t in list(norm.named_parameters()) + list(norm.named_buffers()):
        candidates = [f"{names.prefix}{family.output_norm}.{local}", f"{family.layer_prefix(layer)}{family.output_norm}.{local}"]
        stored = next((c for c in candidates if ckpt.has(c)), candidates[0])
        _set(norm, local, read_dense(ckpt, stored, tuple(t.shape), t.dtype, weight_scales).to(device))
    return norm


def _load_dense(model: PreTrainedModel, ckpt: SafetensorsCheckpoint, skip: tuple[str, ...], device: torch.device,
                weight_scales: str | None, family: ModelFamily) -> None:
    """Every parameter and persistent buffer outside the MoE blocks (``skip`` prefixes), read
    under its own name (or as the family stores it: ``ModelFamily.dense_sources``); tied weights
    (``lm_head`` with ``tie_word_embeddings``) are tied after; non-persistent buffers (rotary
    frequencies) are computed as transformers does."""
    persistent = set(model.state_dict(keep_vars=True))
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    tensors: list[tuple[str, torch.Tensor]] = [(n, t) for n, t in model.named_parameters(remove_duplicate=False)]
    tensors += [(n, t) for n, t in model.named_buffers(remove_duplicate=False) if n in persistent]
    shapes = {n: tuple(t.shape) for n, t in tensors}
    split_read: dict[str, tuple[torch.Tensor, set[str]]] = {}  # a split tensor read once, until its parts are taken
    for name, t in tensors:
        if name.startswith(skip) or not _is_meta(t):
            continue
        convert = family.dense_convert_of(name)
        if convert is not None:
            _set(model, name, _read_converted(ckpt, name, convert, tuple(t.shape), t.dtype, weight_scales).to(device))
            continue
        split = family.dense_split_of(name, ckpt.has)
        if split is not None:
            _set(model, name, _read_split(ckpt, name, split, shapes, t.dtype, weight_scales, split_read).to(device))
            continue
        sources = family.dense_sources(name, ckpt.has)
        if not ckpt.has(sources[0]) and name in tied:
            continue
        _set(model, name, _read_sources(ckpt, name, sources, tuple(t.shape), t.dtype, weight_scales).to(device))
    model.tie_weights()
    for name, buffer in list(model.named_buffers()):
        if name in persistent or not _is_meta(buffer):
            continue
        owner = name.rpartition(".")[0]
        module = model.get_submodule(owner) if owner else model
        # transformers' own initialisation of e.g. rotary inv_freq, or Gemma's embedding scale. It
        # initialises the module's parameters too, and those of the modules inside it (a vision
        # embedding's position table beside its position ids): every tensor that holds a value in
        # that subtree (read from the checkpoint) stands aside as a meta tensor meanwhile, so that
        # it stays; the module's buffers still to be computed are allocated after, so they do not.
        with _loaded_standing_aside(module):
            for leaf, b in list(module._buffers.items()):
                if _is_meta(b):
                    module._buffers[leaf] = torch.empty_like(b, device=device)
            with torch.no_grad():
                model._init_weights(module)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if _is_meta(t) and not n.startswith(skip)]
    if left:
        raise ValueError(f"{ckpt.model_dir}: no value for {left[:6]}{' ...' if len(left) > 6 else ''} (not in the "
                         f"checkpoint)")


@contextlib.contextmanager
def _loaded_standing_aside(module: nn.Module):
    """Within: every parameter and buffer of ``module`` and the modules inside it that holds a value
    (not a meta tensor) is replaced by a meta tensor of its shape; after: each is put back."""
    held: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for sub in module.modules():
        for slots in (cast(dict[str, Any], sub._parameters), cast(dict[str, Any], sub._buffers)):
            for leaf, t in list(slots.items()):
                if t is not None and not t.is_meta:
                    held.append((slots, leaf, t))
                    meta = torch.empty_like(t, device="meta")
                    slots[leaf] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        yield
    finally:
        for slots, leaf, t in held:
            slots[leaf] = t


def _read_sources(ckpt: SafetensorsCheckpoint, name: str, sources: tuple[str, ...], shape: tuple[int, ...],
                  dtype: torch.dtype, weight_scales: str | None) -> torch.Tensor:
    """The model's tensor ``name`` of ``shape`` from its checkpoint ``sources``: one tensor, or
    equal parts along dim 0 concatenated (``ModelFamily.dense_concat``)."""
    if len(sources) == 1:
        return read_dense(ckpt, sources[0], shape, dtype, weight_scales)
    if not shape or shape[0] % len(sources):
        raise ValueError(f"{name}: its shape {list(shape)} does not split into {len(sources)} equal parts along dim 0 "
                         f"({list(sources)})")
    part = (shape[0] // len(sources), *shape[1:])
    return torch.cat([read_dense(ckpt, source, part, dtype, weight_scales) for source in sources])


def _read_converted(ckpt: SafetensorsCheckpoint, name: str, convert: tuple[tuple[str, ...], Callable[..., torch.Tensor]],
                    shape: tuple[int, ...], dtype: torch.dtype, weight_scales: str | None) -> torch.Tensor:
    """The model's tensor ``name`` of ``shape``: ``convert``'s function of its stored tensors, each
    read whole in its stored shape (``ModelFamily.dense_convert``)."""
    sources, fn = convert
    missing = [s for s in sources if not ckpt.has(s)]
    if missing:
        raise ValueError(f"{ckpt.model_dir}: {name} is made from {list(sources)}; missing {missing}")
    parts = [read_dense(ckpt, s, tuple(ckpt.info(s).shape), dtype, weight_scales) for s in sources]
    out = fn(parts, shape)
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: {list(sources)} of shapes {[list(p.shape) for p in parts]} make shape "
                         f"{list(out.shape)}, the model holds {list(shape)}")
    return out.contiguous()


def _read_split(ckpt: SafetensorsCheckpoint, name: str, split: tuple[str, tuple[str, ...]],
                shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, weight_scales: str | None,
                held: dict[str, tuple[torch.Tensor, set[str]]]) -> torch.Tensor:
    """The model's tensor ``name``: its rows of the stored tensor ``split[0]``, whose consecutive row
    ranges along dim 0 are the model tensors ``split[1]``, in order (``ModelFamily.dense_split``).
    The stored tensor is read once and kept in ``held`` until each of its parts has been taken."""
    stored, parts = split
    missing = [p for p in parts if p not in shapes]
    if missing:
        raise ValueError(f"{name}: the model has no {missing}, which {stored!r} also holds")
    rows = [shapes[p][0] for p in parts]
    if stored not in held:
        held[stored] = (read_dense(ckpt, stored, (sum(rows), *shapes[name][1:]), dtype, weight_scales), set(parts))
    whole, left = held[stored]
    left.discard(name)
    if not left:
        del held[stored]
    start = sum(rows[: parts.index(name)])
    return whole[start:start + shapes[name][0]].clone()


def load_sharded_model(model_dir: str | Path, groups: ParallelGroups | None = None, *,
                       quant: QuantConfig | str | None = None, backend: str | None = None,
                       dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
                       max_tokens_per_rank: int | None = None) -> nn.Module:
    """A transformers causal LM from ``model_dir`` (config.json + safetensors) with every MoE block
    an ``MoEBlock`` under the layout of ``groups`` (None: one device), in eval mode.

    Each rank reads the non-expert weights whole and, per MoE layer, only its experts (EP) or
    its slice of the intermediate dimension (TP), one expert at a time, so it holds about the
    non-expert weights plus its share of the experts. quant: expert quantization (default: the
    checkpoint's own, fp8_block for an FP8 block checkpoint); backend: dispatch backend;
    dtype: model dtype (default: the checkpoint's, else fp32); device: default
    ``groups.device`` or CPU; max_tokens_per_rank: the most rows one block's forward gets on a
    rank (the ``MoELayer`` argument, which backends with fixed buffers, low_latency, need).
    Collective when groups is given (see the module's preconditions).
    """
    model_dir = Path(model_dir)
    parallel, rank = _layout(groups)
    if device is None:
        device = groups.device if groups is not None else "cpu"
    device = torch.device(device)
    error, model, blocks, routers, biases, norms = None, None, {}, {}, {}, {}
    cfg = quant_cfg = None
    try:
        from moeshard.checkpoint.loader import load_moe_block

        info = read_hf_config(model_dir)
        quant_cfg = resolve_quant(info, _quant(quant))
        dtype = parse_dtype(dtype) if dtype is not None else (info.checkpoint_dtype or torch.float32)
        cfg = info.moe_config(dtype)
        backend = check_layout(cfg, quant_cfg, parallel, backend, device.type, rank)
        model = _build_on_meta(model_dir, dtype)
        ckpt = SafetensorsCheckpoint(model_dir)
        family = info.family
        layers = _decoder_layers(model, family)
        # Module names in the transformers model: the family's layers path and block attribute (for
        # an experts_only family its experts module: its router and the rest of the block load as dense
        # tensors).
        prefixes = {index: f"{family.model_layer_prefix(index)}{_replaced_name(layers[index], family)}."
                    for index in find_moe_blocks(model)}
        weight_scales = info.format.weight_scales
        for index, prefix in prefixes.items():
            blocks[index] = load_moe_block(model_dir, index, parallel=parallel, rank=rank, quant=quant_cfg, dtype=dtype)
            if not family.experts_only:
                routers[index] = _load_router(model, ckpt, prefix, blocks[index].names, device, weight_scales)
            if family.output_bias is not None:
                held = model.get_parameter(prefix + family.output_bias)  # the meta model's: shape and dtype
                biases[index] = read_dense(ckpt, blocks[index].names.prefix + family.output_bias, tuple(held.shape),
                                           held.dtype, weight_scales).to(device).requires_grad_(held.requires_grad)
            if family.output_norm is not None:
                norms[index] = _load_output_norm(model, ckpt, prefix, index, blocks[index].names, device, weight_scales)
        _load_dense(model, ckpt, tuple(prefixes.values()), device, weight_scales, family)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it (see agree)
        error = exc
    agree(groups, error, "to load")
    assert model is not None  # agree raised unless this rank built the model
    family = moe_model_info(model).family
    layers = _decoder_layers(model, family)
    for index in sorted(blocks):
        block = blocks.pop(index)
        weights = block.weights
        if not family.experts_only:
            weights = _bias_as_transformers_holds_it(weights, getattr(layers[index], _block_attribute(layers[index],
                                                                                                     family)), family)
        _replace_block(layers[index], family, routers.pop(index, None), block.cfg, layer=index, quant=block.quant,
                       groups=groups, backend=backend, weights=weights, local_experts=block.local_experts,
                       device=device, max_tokens_per_rank=max_tokens_per_rank, shared_stored=block.shared_stored,
                       output_bias=biases.pop(index, None), output_norm=norms.pop(index, None),
                       identity_experts=block.model.identity_experts,
                       zero_weight_skips=block.model.zero_weight_skips)
    return model.eval()


def save_sharded_model(model: nn.Module, groups: ParallelGroups | None, model_dir: str | Path,
                       directory: str | Path, optimizer: torch.optim.Optimizer | None = None,
                       steps_done: int = 0) -> int | None:
    """Saves a model of ``load_sharded_model`` or ``shard_moe_blocks`` (trained or not) as a Hugging
    Face checkpoint in the new ``directory``, which transformers' ``from_pretrained`` and
    ``load_sharded_model`` read: every rank's shard of the experts put back where transformers
    holds it, every other tensor from the lowest rank (``checkpoint.writer``). model_dir: the
    checkpoint the model was loaded from; its config, its other files (tokenizer) and the tensors
    no rank holds come from it.

    Collective when groups is given: every rank sends its parameters and floating-point buffers
    (CPU fp32) to world rank 0 (one ``gather_object``), which writes. Returns on rank 0 the number
    of parameters written, None on the others. Refused on every rank before the gather (ValueError):
    a model without moeshard blocks or with quantized experts, a ``directory`` that exists or lies
    inside ``model_dir``, a checkpoint transformers cannot load here. A failure to write on rank 0
    is raised on every rank. Rank 0 holds the whole model once in fp32 (the ranks' copies) and
    once in the model's dtype (transformers' model it saves).

    optimizer: also save this optimizer's state (over ``model``'s parameters), whole, under
    ``directory/optimizer/`` in the same write (``training.optimizer_state``: every moment put back
    into its transformers parameter's tensor), with ``steps_done``, the steps it has taken; any
    layout reads it back (``optimizer_state.load_sharded_optimizer``, ``moeshard train --resume``
    for AdamW and SGD)."""
    import torch.distributed as dist

    from moeshard.checkpoint.hf_model import transformers_refusal
    from moeshard.checkpoint.writer import RankState, save_checkpoint
    from moeshard.config import dtype_name
    from moeshard.outputs import check_output_dir
    from moeshard.training import optimizer_state

    _, rank = _layout(groups)
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    error: BaseException | None = None
    try:
        if not blocks:
            raise ValueError(f"save_sharded_model: {type(model).__name__} has no moeshard MoE block (load it with "
                             f"load_sharded_model or shard_moe_blocks)")
        quantized = sorted({m.quant.scheme for m in blocks.values() if m.quant.scheme != "none"})
        if quantized:
            raise ValueError(f"save_sharded_model: the experts are quantized ({', '.join(quantized)}); only quant "
                             f"none is written (a checkpoint of the model dtype)")
        if optimizer is not None:
            if not (isinstance(steps_done, int) and steps_done >= 0):
                raise ValueError(f"save_sharded_model: steps_done must be an integer >= 0, got {steps_done!r}")
            known = {id(q) for q in model.parameters()}
            stray = sum(1 for group in optimizer.param_groups for q in group["params"] if id(q) not in known)
            if stray:
                raise ValueError(f"save_sharded_model: the optimizer steps {stray} tensor(s) that are no parameters of "
                                 f"the model; its state is saved by the model's parameter names")
        if rank == 0:
            check_output_dir(directory, "save_sharded_model directory", reads=[model_dir])
            unloadable = transformers_refusal(model_dir, "save_sharded_model")
            if unloadable:
                raise ValueError(unloadable)
    except ValueError as exc:
        error = exc
    agree(groups, error, "save_sharded_model")
    state = RankState(rank, {n: p.detach().float().cpu() for n, p in model.named_parameters()},
                      {n: m.shard for n, m in blocks.items()},
                      {n: b.detach().float().cpu() for n, b in model.named_buffers() if b.is_floating_point()})
    mine = (state, None if optimizer is None else optimizer_state.rank_state(optimizer, model))
    gathered: list[Any] = [mine]
    if groups is not None:
        gathered = [None] * groups.world_size
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    written, error = None, None
    if rank == 0:
        try:
            layer = next(iter(blocks.values()))
            ranks = [g[0] for g in gathered]
            also = None
            if optimizer is not None:
                meta = optimizer_state.OptimizerMeta(
                    layout=layer.parallel.name, world_size=layer.parallel.world_size, backend=layer.backend_name,
                    optimizer=type(optimizer).__name__.lower(), steps_done=steps_done, dtype=dtype_name(layer.cfg.dtype),
                    format=optimizer_state.FORMAT_WHOLE)
                also = optimizer_state.whole_writer(model_dir, layer.cfg, ranks, {r.rank: h for r, h in gathered}, meta)
            written = save_checkpoint(model_dir, layer.cfg, ranks, directory, also=also)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it (agree)
            error = exc
    agree(groups, error, "save_sharded_model")
    return written


def _bias_as_transformers_holds_it(weights: MoEWeights, meta_block: nn.Module, family: ModelFamily) -> MoEWeights:
    """``weights`` with a block's own selection bias (``block_bias``) rounded to the dtype
    transformers' block declares for it, as transformers rounds it on loading (MiniMax-M2 holds
    it in the model dtype, AFMoE in fp32): selection then adds the values transformers adds. A
    router's bias is read in its router's dtype already (``_load_router``)."""
    held = getattr(meta_block, family.block_bias, None) if family.block_bias is not None else None
    if not isinstance(held, torch.Tensor) or weights.correction_bias is None:
        return weights
    return replace(weights, correction_bias=weights.correction_bias.to(held.dtype))


def expert_bytes(model: nn.Module) -> int:
    """Bytes of routed-expert tensors this rank holds (every ``MoEBlock``'s or ``MoEExperts``' shard,
    scales included)."""
    total = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            total += sum(t.nbytes for t in list(module.experts.parameters()) + list(module.experts.buffers()))
    return total

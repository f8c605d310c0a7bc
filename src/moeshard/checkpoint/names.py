"""Where the tensors of one layer's MoE block are stored, under either naming.

Every name below comes from the family's descriptor (``moeshard.checkpoint.families``): block
prefix ``P`` is its ``layers`` path and ``{L}.`` (``model.layers.{L}.``) followed by one of its
``block_prefixes`` (``mlp.``; Mixtral on the hub: ``block_sparse_moe.``); the router is its
``router`` module (``gate``, weight ``router_weight``), the selection bias the first of its
``bias_names`` present (``gate.e_score_correction_bias``), the experts its ``experts`` module with ``fused_names`` or one of
its ``expert_spellings``, the shared MLP one of its ``shared_prefixes``. The table shows the
built-in families' names.

====================================  ==========================================  ==============
tensor                                per expert, as published on the hub         fused (transformers 5)
====================================  ==========================================  ==============
router [E, H]                         P gate.weight                               same
correction bias [E] (DeepSeek-V3)     P gate.e_score_correction_bias              same
gate rows of expert e [I, H]          P experts.{e}.gate_proj.weight  (Mixtral w1)  P experts.gate_up_proj [E, 2I, H]
up rows of expert e [I, H]            P experts.{e}.up_proj.weight    (Mixtral w3)    (rows I..2I)
down of expert e [H, I]               P experts.{e}.down_proj.weight  (Mixtral w2)  P experts.down_proj [E, H, I]
shared MLP [S, H], [S, H], [H, S]     P shared_experts.{gate,up,down}_proj.weight (DeepSeek-V3)
                                      P shared_expert.{gate,up,down}_proj.weight  (Qwen2-MoE)
                                      P shared_experts.gate_up_proj.weight [2S, H], gate's rows first,
                                      and down_proj.weight (MiniMax-M3)
shared expert gate [1, H]             P shared_expert_gate.weight (Qwen2-MoE)
====================================  ==========================================  ==============

A family's ``stored_names`` map a tensor the transformers model names one way onto the name the
checkpoint stores it under (Granite: ``router.weight`` is ``router.layer.weight``, the fused
``experts.gate_up_proj`` is ``input_linear.weight``); every name above goes through it.

FP8 checkpoints add a block scale next to each quantized weight: ``<module>.weight_scale_inv`` for a
``<module>.weight`` (DeepSeek-V4's release: ``<module>.scale``; ``block_scale_names``),
``<name>_scale_inv`` for a fused parameter. MXFP4 checkpoints (gpt-oss) store a
fused parameter ``<name>`` as ``<name>_blocks`` and ``<name>_scales`` instead (``mxfp4_names``).
A router bias (gpt-oss) is ``P router.bias``; expert biases ``P experts.gate_up_proj_bias`` [E, 2I]
and ``P experts.down_proj_bias`` [E, H] (the family's ``router_bias`` and ``expert_biases``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moeshard.checkpoint.families import ModelFamily
from moeshard.checkpoint.fused import fused_layout
from moeshard.checkpoint.hf_config import HFMoEModel
from moeshard.checkpoint.reader import SafetensorsCheckpoint

PROJECTIONS = ("gate", "up", "down")


def mxfp4_names(fused_name: str) -> tuple[str, str]:
    """The (blocks, scales) tensors an MXFP4 checkpoint stores for the fused parameter ``fused_name``."""
    return fused_name + "_blocks", fused_name + "_scales"


def scale_name(weight_name: str) -> str:
    """The FP8 block-scale tensor that belongs to ``weight_name``, as transformers names it."""
    if weight_name.endswith(".weight"):
        return weight_name[: -len("weight")] + "weight_scale_inv"
    return weight_name + "_scale_inv"


def block_scale_names(weight_name: str) -> tuple[str, ...]:
    """The names an FP8 weight's scale may be stored under: ``scale_name``'s, then for a
    ``<module>.weight`` DeepSeek-V4's ``<module>.scale`` (which transformers renames as it loads)."""
    if weight_name.endswith(".weight"):
        return scale_name(weight_name), weight_name[: -len("weight")] + "scale"
    return (scale_name(weight_name),)


def stored_block_scale_name(has: Callable[[str], bool], weight_name: str, missing: str | None = None) -> str:
    """The first of ``block_scale_names(weight_name)`` the checkpoint holds (``has``); where none
    is, ``missing`` (default ``scale_name``'s), so that reading it names the missing tensor."""
    return next((n for n in block_scale_names(weight_name) if has(n)), missing or scale_name(weight_name))


def row_scale_name(weight_name: str) -> str:
    """The per-tensor or per-row scale tensor (``weight_scale``) that belongs to ``weight_name`` in
    a ModelOpt or compressed-tensors FP8 checkpoint."""
    if weight_name.endswith(".weight"):
        return weight_name[: -len("weight")] + "weight_scale"
    return weight_name + "_scale"


@dataclass(frozen=True)
class BlockNames:
    """Tensor names of one block, from its family's descriptor (``families.ModelFamily``).

    prefix: e.g. ``"model.layers.3.mlp."``; fused: the routed experts are stored as the family's
    ``fused_names`` (``experts.gate_up_proj``/``experts.down_proj``); spelling: per-expert
    module names (gate, up, down); shared_prefix: e.g. ``"shared_experts."`` or
    ``"shared_expert."`` (None without shared experts); family: where the router, expert and
    shared-gate names come from; bias: the selection bias's full checkpoint name, the first of the
    family's ``bias_names`` (after the prefix) and then ``layer_bias_aliases`` (after the decoder
    layer's prefix) the checkpoint holds (None: the first of ``bias_names``); shared_fused: the
    shared MLP stores gate and up as one ``gate_up_proj`` [2S, H], gate's rows first; layout: the
    fused layout the checkpoint stores the experts in, where it is the family's
    ``checkpoint_fused_layout`` or one of its ``stored_fused_layouts`` (None: the family's
    ``fused_layout``)."""

    prefix: str
    fused: bool
    spelling: tuple[str, str, str]
    shared_prefix: str | None
    family: ModelFamily = field(repr=False)
    bias: str | None = None
    shared_fused: bool = False
    layout: str | None = None

    @property
    def router_module(self) -> str:
        """The router's module name in the block (``gate``)."""
        return self.family.router

    def stored(self, name: str) -> str:
        """The checkpoint's full name of the block-relative tensor ``name`` (the family's
        ``stored_names`` applied)."""
        return self.prefix + self.family.stored(name)

    @property
    def router(self) -> str:
        return self.stored(self.family.router_tensor)

    @property
    def correction_bias(self) -> str:
        return self.bias or self.prefix + self.family.stored(self.family.bias_names[0])

    @property
    def router_bias(self) -> str:
        return self.stored(f"{self.family.router}.{self.family.router_bias}")

    @property
    def fused_layout(self) -> str:
        return self.layout or self.family.fused_layout

    @property
    def fused_gate_up_bias(self) -> str:
        return self.prefix + self.family.expert_tensor(self.family.expert_biases[0])

    @property
    def fused_down_bias(self) -> str:
        return self.prefix + self.family.expert_tensor(self.family.expert_biases[1])

    @property
    def fused_gate_up(self) -> str:
        """The fused gate_up tensor (a ``stacked`` layout's gate tensor)."""
        return self.stored(self.family.expert_tensor(self.family.fused_names[0]))

    @property
    def fused_down(self) -> str:
        return self.stored(self.family.expert_tensor(self.family.fused_names[-1]))

    @property
    def fused_tensors(self) -> tuple[str, ...]:
        """Every stored tensor of the fused experts, in the family's ``fused_names`` order:
        (gate_up, down), or (gate, up, down) for a ``stacked`` layout."""
        return tuple(self.stored(self.family.expert_tensor(name)) for name in self.family.fused_names)

    def expert(self, e: int, projection: str) -> str:
        """Per-expert weight name; projection is "gate", "up" or "down"."""
        return self.prefix + self.family.expert_tensor(f"{e}.{self.spelling[PROJECTIONS.index(projection)]}.weight")

    def shared(self, projection: str) -> str:
        """The shared MLP's weight of ``projection``: "gate", "up", "down", or "gate_up" (where
        ``shared_fused``)."""
        return self.stored(f"{self.shared_prefix}{projection}_proj.weight")

    @property
    def shared_expert_gate(self) -> str:
        return f"{self.prefix}{self.family.shared_expert_gate}.weight"


def resolve_block_names(ckpt: SafetensorsCheckpoint, model: HFMoEModel, layer: int) -> BlockNames:
    """Finds which prefix and which expert naming the checkpoint uses for ``layer``'s block.

    ValueError names the tensors looked for and the files looked in.
    """
    files = [p.name for p in ckpt.files]
    family = model.family
    candidates = [family.layer_prefix(layer) + p for p in family.block_prefixes]
    router = family.stored(family.router_tensor)
    prefix = next((p for p in candidates if ckpt.has(p + router)), None)
    if prefix is None:
        wanted = " or ".join(repr(p + router) for p in candidates)
        raise ValueError(f"layer {layer}: router tensor {wanted} is missing; looked in {files} under "
                         f"{str(ckpt.model_dir)!r}")
    probe = BlockNames(prefix=prefix, fused=True, spelling=family.expert_spellings[0], shared_prefix=None,
                       family=family)
    # An MXFP4 checkpoint stores the fused parameters as <name>_blocks and <name>_scales.
    stored = lambda name: ckpt.has(name) or ckpt.has(mxfp4_names(name)[0])  # noqa: E731
    fused = stored(probe.fused_gate_up)
    spelling = family.expert_spellings[0]
    # Expert 0's first stored projection: its gate, or its up for ungated experts.
    first_projection = PROJECTIONS.index("gate" if model.moe.activation_kind.gated else "up")
    firsts = [prefix + family.expert_tensor(f"0.{s[first_projection]}.weight") for s in family.expert_spellings]
    both = [name for name in firsts if ckpt.has(name)]
    if fused and both:
        # Two copies of the same experts and nothing to say which is meant (transformers refuses
        # to load such a checkpoint): never pick one silently.
        raise ValueError(f"layer {layer}: the checkpoint holds the routed experts twice, fused "
                         f"({probe.fused_gate_up}) and per expert ({both[0]}, ...); keep one of the two "
                         f"under {str(ckpt.model_dir)!r}")
    layout = None
    if fused:
        if not stored(probe.fused_down):
            raise ValueError(f"layer {layer}: {probe.fused_gate_up} is present but {probe.fused_down} "
                             f"is missing; looked in {files}")
        layout = _stored_layout(ckpt, probe, model)
    else:
        found = [s for s, name in zip(family.expert_spellings, firsts, strict=True) if ckpt.has(name)]
        if not found:
            tried = [probe.fused_gate_up] + firsts
            raise ValueError(f"layer {layer}: no routed-expert tensors found; looked for {tried} in {files} under "
                             f"{str(ckpt.model_dir)!r}")
        spelling = found[0]
    shared_prefix, shared_fused = None, False
    if model.moe.has_shared_experts:
        # (prefix, fused) candidates: separate gate and up projections first, then a fused gate_up.
        options = [(a, fused_mlp) for fused_mlp in (False, True) for a in family.shared_prefixes]
        first = lambda a, fused_mlp: prefix + family.stored(f"{a}{'gate_up' if fused_mlp else 'gate'}_proj.weight")  # noqa: E731
        found_shared = next(((a, f) for a, f in options if ckpt.has(first(a, f))), None)
        if found_shared is None:
            tried = [first(a, f) for a, f in options]
            raise ValueError(f"layer {layer}: the config has shared experts but none of {tried} is in {files}")
        shared_prefix, shared_fused = found_shared
    bias = None
    if model.moe.use_correction_bias:
        candidates = [prefix + family.stored(b) for b in family.bias_names] + \
            [family.layer_prefix(layer) + b for b in family.layer_bias_aliases]
        bias = next((b for b in candidates if ckpt.has(b)), None)
    return BlockNames(prefix=prefix, fused=fused, spelling=spelling, shared_prefix=shared_prefix, family=family,
                      bias=bias, shared_fused=shared_fused, layout=layout)


def _stored_layout(ckpt: SafetensorsCheckpoint, probe: BlockNames, model: HFMoEModel) -> str | None:
    """The family's ``checkpoint_fused_layout``, else which of its ``stored_fused_layouts`` the stored
    fused gate_up's shape says, or None (the family's ``fused_layout``) where it fits that one or the
    family has no others; a shape that fits none is the expert reader's to refuse, naming both."""
    family = probe.family
    if family.checkpoint_fused_layout is not None:  # the same shapes as fused_layout: no shape tells them apart
        return family.checkpoint_fused_layout
    if not family.stored_fused_layouts or not ckpt.has(probe.fused_gate_up):
        return None
    cfg = model.moe
    shape = ckpt.info(probe.fused_gate_up).shape
    for name in (family.fused_layout, *family.stored_fused_layouts):
        if fused_layout(name).stored_shapes(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size)[0] == shape:
            return None if name == family.fused_layout else name
    return None

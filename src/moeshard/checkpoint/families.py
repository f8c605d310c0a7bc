"""The model families moeshard reads, one ``ModelFamily`` entry each in ``FAMILIES``.

A family says everything that differs between Hugging Face ``model_type``s: the defaults of the
routing fields, how ``config.json`` maps onto ``MoEConfig``, which layers are dense, where a
layer's block lives, how its router, experts and shared experts are named, the fused layout, its
routing and activation kinds and its checkpoint formats. ``hf_config``, ``names``, ``experts``,
``loader`` and the transformers integration read it; a new family (say ``qwen3_next``) is one
more entry here (or ``register_family`` from outside the package).

===========  =====================  =========================================================
model_type   routing                 which layers have an MoE block
===========  =====================  =========================================================
mixtral      softmax, renormalized   every layer
qwen2_moe    softmax, norm_topk_prob not in ``mlp_only_layers`` and (L + 1) % decoder_sparse_step
             gated shared expert     == 0 (and num_experts > 0)
qwen3_moe    softmax, norm_topk_prob as qwen2_moe
deepseek_v3  sigmoid + correction    L >= first_k_dense_replace and L % moe_layer_freq == 0
             bias, grouped top-k,
             routed scaling, shared
             experts
===========  =====================  =========================================================

A routing field missing from ``config.json`` takes the default of the transformers-5 config class
of that model type (e.g. ``norm_topk_prob=False`` for Qwen, ``True`` for DeepSeek-V3), so the
block is the one transformers would build; a missing shape field (sizes, expert count, top-k)
is an error. ``moe_layer_freq`` (DeepSeek's own code; transformers ignores it, every published
config has 1) is honoured. ``hidden_act`` ``silu``/``swish`` map to ``"silu"``; every ``gelu*``
variant maps to ``"gelu"`` (exact erf GELU: the tanh-approximate variants
``gelu_new``/``gelu_pytorch_tanh``/``gelu_fast`` then differ from the model by the
approximation, below 1e-3 absolute per activation).
"""

from __future__ import annotations

import builtins
import fnmatch
import itertools
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from moeshard.activations import get_activation
from moeshard.checkpoint.formats import (  # noqa: F401 - re-exported: the formats a family names
    CHECKPOINT_FORMATS,
    FP8_CHECKPOINT_BLOCK,
    CheckpointFormat,
)
from moeshard.checkpoint.fused import LAYOUTS, fused_layout
from moeshard.config import MAX_ROUTED_SCALING, ROUTER_DTYPES, MoEConfig
from moeshard.routing import get_routing
from moeshard.validate import MAX_DIM, is_int

# Per-expert (gate, up, down) module names: as transformers' per-expert MLPs, and as Mixtral publishes.
GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
W1_W3_W2 = ("w1", "w3", "w2")

# Other spellings of a field: transformers 5 writes num_local_experts where older configs (and the
# hub) have num_experts / n_routed_experts.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("n_layers",),  # DBRX
    "hidden_act": ("activation_function", "hidden_activation"),  # JetMoE, Gemma 4
    "num_local_experts": ("num_experts",),
    "num_experts": ("num_local_experts",),
    "n_routed_experts": ("num_local_experts", "num_experts"),  # Sarvam-MoE's hub config: num_experts
    "n_shared_experts": ("num_shared_experts",),
    "shared_experts_intermediate_size": ("moe_shared_expert_intermediate_size",),  # dots.note 3's older configs
}


class ConfigFields:
    """``config.json`` values with the family's defaults, and messages that name the field.

    Every value is read through a typed getter (``int``, ``bool``, ``float``, ``int_list``,
    ``activation``): a value of the wrong JSON type (``"false"`` for a bool, ``"8"`` or ``1.5`` for
    an int, ``Infinity`` or ``1e39`` for a scale) is a ValueError naming the file, the field and
    the value, never read loosely (``bool("false")`` is True).
    """

    def __init__(self, raw: dict[str, Any], family: ModelFamily, source: str) -> None:
        self.raw, self.family, self.source = raw, family, source

    def get(self, key: str) -> Any:
        for name in (key, *_ALIASES.get(key, ())):
            if self.raw.get(name) is not None:
                return self.raw[name]
        if key in self.family.defaults:
            return self.family.defaults[key]
        also = "".join(f" (or {alias!r})" for alias in _ALIASES.get(key, ()))
        raise ValueError(f"{self.source}: missing field {key!r}{also} (model_type {self.family.model_type!r})")

    def int(self, key: str, minimum: int = 1) -> int:
        value = self.get(key)
        if not is_int(value) or value < minimum:
            raise ValueError(f"{self.source}: {key} must be an integer >= {minimum}, got {value!r}")
        if value > MAX_DIM:
            raise ValueError(f"{self.source}: {key} must be at most {MAX_DIM}, got {value!r}")
        return value

    def bool(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise ValueError(f"{self.source}: {key} must be true or false (a JSON boolean), got {value!r}")
        return value

    def float(self, key: str, low: float, high: float) -> float:
        """A finite number in ``(low, high]``."""
        value = self.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            ok = ok and math.isfinite(float(value)) and low < float(value) <= high
        except OverflowError:
            ok = False
        if not ok:
            raise ValueError(f"{self.source}: {key} must be a finite number in ({low:g}, {high:g}], got {value!r}")
        return float(value)

    def int_list(self, key: str) -> tuple[builtins.int, ...]:  # builtins: the method int shadows the type here
        """A list of integers >= 0 (layer indices)."""
        value = self.get(key)
        if not isinstance(value, list) or not all(is_int(v) and 0 <= v for v in value):
            raise ValueError(f"{self.source}: {key} must be a list of integers >= 0, got {value!r}")
        return tuple(value)

    def activation(self, key: str = "hidden_act") -> str:
        """The activation kind the field ``key`` (``hidden_act``; Nemotron-H's ``mlp_hidden_act``)
        maps to under the family's ``hidden_acts``."""
        name = self.get(key)
        if isinstance(name, str):
            for pattern, kind in self.family.hidden_acts.items():
                if fnmatch.fnmatchcase(name, pattern):
                    return kind
        raise ValueError(f"{self.source}: {key}={name!r} is not supported; expected one of "
                         f"{list(self.family.hidden_acts)}")

    def layer_types(self, *, listed: str, pattern: str, codes: Mapping[str, str], known: tuple[str, ...]) -> tuple[str, ...]:
        """Each layer's type: the list field ``listed`` (entries of ``known``), else the string field
        ``pattern``, one character a layer, read through ``codes`` (Nemotron-H's
        ``layers_block_type`` or ``hybrid_override_pattern``)."""
        value = self.raw.get(listed)
        if value is not None:
            if not isinstance(value, list) or not value or not all(v in known for v in value):
                raise ValueError(f"{self.source}: {listed} must be a non-empty list of {list(known)}, got {value!r}")
            return tuple(value)
        value = self.raw.get(pattern)
        if not isinstance(value, str) or not value or not all(c in codes for c in value):
            raise ValueError(f"{self.source}: expected {listed} (a list of {list(known)}) or {pattern} (a string of "
                             f"{list(codes)}), got {listed}={self.raw.get(listed)!r}, {pattern}={value!r}")
        return tuple(codes[c] for c in value)

    def fixed_activation(self, kind: str, fields: Mapping[str, str], why: str) -> str:
        """``kind``, an activation whose parameters are fixed in its registry entry, once each
        config.json field of ``fields`` (field -> the kind's parameter) is checked to hold that
        parameter's value (``why``: where the value comes from, for the refusal)."""
        params = get_activation(kind).params
        for key, param in fields.items():
            value = self.float(key, 0.0, 1e6)
            if value != params[param]:
                raise ValueError(f"{self.source}: {key}={value!r}; moeshard's {kind!r} activation computes "
                                 f"{param}={params[param]} ({why})")
        return kind


def checkpoint_format(raw: dict[str, Any], family: ModelFamily, source: str) -> CheckpointFormat:
    """The format ``raw``'s ``quantization_config`` describes, among those ``family`` ships (with the
    family's ``quantization_fields`` moved into it)."""
    q = raw.get("quantization_config")
    if isinstance(q, dict):
        q = {**{k: raw[k] for k in family.quantization_fields if k in raw}, **q}
    for name in family.formats:
        if CHECKPOINT_FORMATS[name].detect(q, source):
            return CHECKPOINT_FORMATS[name]
    method = q.get("quant_method") if isinstance(q, dict) else q
    raise ValueError(f"{source}: quantization_config with quant_method={method!r} is not supported for model_type "
                     f"{family.model_type!r}; its formats: "
                     + "; ".join(f"{n}: {CHECKPOINT_FORMATS[n].summary}" for n in family.formats))


# -- the family descriptor ---------------------------------------------------------------------
# Fused routed experts, as one gate_up tensor and one down tensor (``checkpoint.fused``):
#   gate_up_rows            [E, 2I, H] rows [0, I) gate, [I, 2I) up (transformers 5)
#   interleaved             [E, 2I, H] rows 2i gate, 2i + 1 up
#   transposed              [E, H, 2I] gate columns first, down [E, I, H] (Llama-4)
#   transposed_interleaved  [E, H, 2I] columns 2i gate, 2i + 1 up, down [E, I, H] (gpt-oss)
#   stacked                 gate, up and down as three [E * I, H] tensors, down transposed (DBRX)
# Every one is read (by the checkpoint reader and the transformers integration).
FUSED_LAYOUTS = tuple(LAYOUTS)
READ_FUSED_LAYOUTS = FUSED_LAYOUTS
# What transformers' block passes its router: rows [T, H], or its input as given [batch, seq, H].
ROUTER_INPUTS = ("rows", "block")
# hidden_act patterns (fnmatch) -> activation kind, tried in order.
HIDDEN_ACTS = {"silu": "silu", "swish": "silu", "gelu*": "gelu"}


# (model name part or pattern, stored part, or for a pattern a re.sub template or a function of the match)
DenseRename = tuple[str | re.Pattern[str], str | Callable[[re.Match[str]], str]]


@dataclass(frozen=True)
class ModelFamily:
    """What moeshard knows about one ``model_type``.

    defaults: transformers-5 defaults of the routing fields it reads, used when config.json omits
      one. Shape fields (sizes, expert counts, top-k) have none: a guess there would load the
      wrong tensors, so a missing one is an error.
    moe: config.json -> the block's ``MoEConfig`` (dtype and router_dtype left at their defaults:
      the loader sets the first from the checkpoint or the caller, the second from ``router_dtype``;
      a routing kind that scores in the model dtype needs ``router_dtype=f.family.router_dtype``
      here already, since ``MoEConfig`` refuses it with fp32 logits).
    dense_layers: (config.json, num_layers) -> ``DenseLayers``, {layer: why it has no MoE block},
      decided per layer by a rule (reading the fields once), never by a loop over all layers.
    routing: the routing kind (``moeshard.routing``) its blocks use; ``moe`` builds the
      ``MoEConfig`` with it (read as ``f.family.routing``).
    layers: the decoder layers' module path, in the checkpoint and in the transformers model
      (``model.layers``: tensors ``model.layers.{L}.*``, module ``model.model.layers``).
    block_prefixes: where layer L's block lives, after ``{layers}.{L}.``, in the order tried, in
      the checkpoint; without the dot, the decoder layer's attribute in the transformers model.
    router: the router's module name in the block (its weight [E, H] is ``{router}.{router_weight}``;
      see ``linear_router``).
    router_dtype: the precision of the family's router logits (``config.ROUTER_DTYPES``), as its
      transformers router computes them: ``"model"`` for ``F.linear(hidden_states, weight)`` in
      the model dtype (Mixtral, Qwen, most families), ``"fp32"`` for a router transformers keeps
      and runs in fp32 (DeepSeek-V3 style: ``F.linear(h.float(), w.float())``); the loader puts
      it into the block's ``MoEConfig.router_dtype``.
    router_weight: the weight's name inside the router module (``weight``; AFMoE's router wraps
      a linear: ``gate.weight``; Hunyuan's router holds an fp32 linear: ``wg.weight``).
    layer_count: the config field that counts the decoder layers (``num_hidden_layers``;
      LongCat-Flash's ``num_layers``, where transformers 5.17 also writes ``num_hidden_layers`` as
      twice that, its attention sublayers), or ``config.json -> count`` where no field holds it
      (Nemotron-H: the length of its per-layer type list).
    model_layers: None, or the decoder layers' module path in the transformers causal LM where it
      differs from the checkpoint's ``layers`` (Nemotron-H: ``model.layers`` in the model,
      ``backbone.layers`` as transformers saves and the hub stores it); with ``text_model`` and no
      ``model_layers``, ``{text_model}.layers``.
    text_model: None, or the text model's module path in the whole vision-language model
      transformers builds (``model.language_model``), whose tensors the checkpoint holds, as
      ``SafetensorsCheckpoint`` names them, as a causal LM's under ``model.``
      (``checkpoint_name``); ``dense_renames``, ``dense_concat`` and ``dense_split`` then apply
      to that name.
    text_config: the family is a vision-language model whose config.json holds its text model's
      fields in ``text_config`` (``model_type`` names the whole model: Aria's ``aria``, whose
      ``text_config`` is an ``aria_text``, a family of its own as the causal LM transformers also
      builds). Its fields are read there (``hf_config.text_model_config``); the model transformers
      builds is the whole one (``hf_model.model_class``), with its decoder layers at
      ``model_layers``.
    release_text_config: None, or ``(whole, key)``: a release's config.json of model type ``whole``
      (a vision-language model) that holds this text family's fields under ``key`` instead of
      ``text_config`` (Unlimited OCR's original ``unlimited_ocr``: ``language_config``), which
      transformers' config class moves into its text config. ``hf_config.text_model_config``
      reads it as this family, as transformers does, whatever model type ``key`` names.
    identity_experts: None, or the config field that counts zero-computation experts (LongCat-Flash's
      ``zero_expert_num``, Z): the router picks among E + Z, and a pick of id E .. E + Z - 1 passes
      the row through scaled by its weight (``MoEExperts(identity_experts=Z)``); transformers'
      experts module may hold gate_up rows for them, never used. Only for an ``experts_only``
      family without a linear router (its router is [E + Z, H]).
    zero_weight_skips: the family's router marks a pick that skips the experts as expert 0 with
      weight exactly 0 (ZAYA's skip class, set by a masked fill, so that weight has no gradient):
      ``MoEExperts(zero_weight_skips=True)`` takes every given pick of weight 0 as an empty pick
      (``Routing.empty_picks``), which no expert computes. Only for an ``experts_only`` family.
    linear_router: the router weight is a linear [E, H] over the block's input, which moeshard
      reads (True, every family that moeshard routes). False: it is some other tensor of a
      router moeshard never computes (ZAYA's MLP router ends in ``router_mlp.out_proj.weight``
      [E + 1, router_hidden_size]); it only locates the block in a checkpoint. Only for an
      ``experts_only`` family, whose router transformers runs.
    correction_bias: the router's selection-bias parameter [E] (``{router}.{correction_bias}``;
      dotted like ``router_weight``: ERNIE 4.5's ``moe_statics.e_score_correction_bias``).
    router_bias: the router linear's bias parameter [E] (``{router}.{router_bias}``), read when the
      routing kind has ``router_bias`` (gpt-oss).
    block_bias: None, or the name of a selection bias [E] the block holds itself instead of its
      router (MiniMax-M2 ``e_score_correction_bias``, AFMoE ``expert_bias``); transformers then
      calls the router as ``router(hidden_states, bias)``.
    bias_aliases: further checkpoint names of the selection bias, after the block prefix, tried
      after ``bias_module`` (EXAONE-MoE checkpoints keep it on the block: ``e_score_correction_bias``).
    layer_bias_aliases: checkpoint names of the selection bias after the decoder layer's prefix
      (``{layers}.{L}.``), tried after ``bias_names``, for a checkpoint that keeps it outside the
      block (Kolibri-1: ``moe.router.expert_bias``, which transformers loads as the block's
      ``gate.e_score_correction_bias``).
    experts: the routed experts' module name, or "" where the block holds their fused parameters
      itself (JetMoE's ``input_linear.weight``); fused_names: its (gate_up, down) fused parameters,
      or for a ``stacked`` layout its (gate, up, down) ones (dotted: DBRX's ``mlp.w1``);
      fused_layout: how the fused gate_up holds gate and up (``FUSED_LAYOUTS``, ``checkpoint.fused``);
      stored_fused_layouts: further layouts a checkpoint may store the fused experts in, told apart
      by the stored gate_up's shape (``fused_layout`` wins where both fit, as transformers' loader,
      which transposes only a shape that does not fit, decides): Qwen3-VL-MoE's published
      checkpoints hold them ``transposed`` while transformers holds and saves ``gate_up_rows``;
      checkpoint_fused_layout: None, or the layout every checkpoint stores the fused experts in
      where it differs from ``fused_layout`` (the transformers model's) though the shapes are the
      same, so that no shape tells them apart (Inkling 2: ``w13_weight`` interleaved, gate row 2i
      and up row 2i + 1, while transformers holds ``gate_up_proj`` gate rows first); the checkpoint
      reader reads that layout, the model in memory stays ``fused_layout``;
      expert_biases: its (gate_up [E, 2I], down [E, H]) bias parameters, read when the config has
      ``expert_bias`` (gpt-oss); the gate_up bias follows ``fused_layout``'s gate/up order.
    expert_spellings: per-expert (gate, up, down) module names, in the order tried.
    shared_prefixes: the shared-expert MLP's module names (with the dot), in the order tried;
      shared_expert_gate: the shared expert's sigmoid gate module [1, H].
    hidden_acts: ``hidden_act`` patterns (fnmatch) -> activation kind (``moeshard.activations``).
    formats: the checkpoint formats (``CHECKPOINT_FORMATS``) it ships, full precision first.
    quantization_fields: config.json's top-level fields that belong to its ``quantization_config``,
      read there where that object lacks them, as transformers' config class moves them
      (DeepSeek-V4's release states ``expert_dtype`` at the top level).
    returns_router_output: None (the block returns its output), or i: the transformers block
      returns ``(output, router(x)[i])`` (gpt-oss: its router's scores; Llama-4: its logits), and
      so does moeshard's block in its place.
    router_input: what transformers' block passes its router: ``"rows"`` [T, H] (most
      families) or ``"block"``, the block's input as given, [batch, seq, H] (AFMoE's router
      unpacks three dimensions); moeshard's block calls the router the same way, for its
      observers (``output_router_logits``).
    dense_renames, dense_concat, dense_split: how the checkpoint stores a tensor outside the MoE
      blocks that transformers renames, stacks or splits as it loads (Kimi-Linear's and
      LaraMini's linear attention): ``dense_renames`` (model part, stored part) pairs, each
      replacing the first in a model tensor's name (a model part may be a compiled ``re.Pattern``,
      its stored part then a ``re.sub`` template or a function of the match: a layer index the
      checkpoint shifts, Inkling 2's ``attn_res.attn_queries.{L - 1}`` for
      ``layers.{L}.attention_input.query``); ``dense_concat`` {model name ending: the
      stored name endings whose tensors, concatenated along dim 0 in that order, make it};
      ``dense_split`` {stored name ending: the model name endings that are its consecutive row
      ranges along dim 0, in order; taken only where the checkpoint lacks the model's tensor
      itself, and renamed as ``dense_renames`` say} (``dense_sources``, ``dense_split_of``); ``dense_convert``
      {model name: (stored names, convert)}: the stored tensors, each read whole in its stored
      shape, make the model's tensor of shape ``shape`` as ``convert(tensors, shape)`` (Inkling 2's
      unembedding padded to ``vocab_size``, of which ``lm_head`` is the first rows; Inkling 2 Loop's
      message queries, two stored tensors whose rows the model holds in another order)
      (``dense_convert_of``).
    experts_only: transformers routes the tokens itself and hands its experts module the routing,
      ``experts(rows [T, H], top_k_index [T, K], top_k_weights [T, K])``: its decoder layer
      (Gemma 4: the router reads the residual stream through its own norm and scales, the experts
      another norm of it; ``block_prefixes`` ``("",)``, the decoder layer holds ``router`` and
      ``experts``) or its block (DeepSeek-V4: some layers route by token id, which the block
      alone is given; ``block_prefixes`` as any family's). moeshard then replaces only that
      module (``MoEExperts``), taking the routing as given; the router, and whatever else the
      block holds (shared experts), stay transformers' and are read as dense tensors. ``moe``'s
      routing kind describes the router's selection; ``moeshard run``, which routes one block
      alone, refuses such a family.
    output_bias: None, or the name of a learned bias [H] the block adds to every row of its output
      (JetMoE's ``bias``). moeshard's block adds it to the layer's output rows, whole (after a
      sequence-parallel gather), as transformers' block does; it is a parameter of the block, not
      of the layer, and its gradient is reduced as any replicated parameter's outside the layer.
    output_norm: None, or the name of a module the block applies to its output last (A.X-K1's
      ``post_mlp_layernorm``: an RMS norm of the routed and shared experts' sum). moeshard's block
      keeps transformers' module under that name and applies it to the layer's output rows, whole
      (after a sequence-parallel gather); its parameters are replicated parameters outside the
      layer. The checkpoint may hold them under the block or under the decoder layer (A.X-K1's hub
      and transformers' saves: ``model.layers.{L}.post_mlp_layernorm.weight``); both are read.
    dtype_check: None, or a probe of the installed transformers: ``dtype_check(dtype)`` raises
      ValueError, naming the dtype, the transformers version and what fails, when transformers'
      own modules of this family (those moeshard leaves to it) cannot run in that model dtype
      (transformers 5.17's DeepSeek-V4 norms return float32 into bfloat16 projections). Every
      model built from a checkpoint asks it (``HFMoEModel.moe_config``), before any rank starts.
    stored_names: block-relative tensor names as the transformers model holds them -> as the
      checkpoint stores them, where the two differ (Granite's ``router.weight`` is stored
      ``router.layer.weight``, its ``experts.gate_up_proj`` ``input_linear.weight``); the
      checkpoint reader and the router loader look tensors up under the stored name.
    """

    model_type: str
    defaults: Mapping[str, Any]
    moe: Callable[[ConfigFields], MoEConfig]
    dense_layers: Callable[[ConfigFields, int], DenseLayers]
    routing: str = "softmax"
    layers: str = "model.layers"
    block_prefixes: tuple[str, ...] = ("mlp.",)
    router: str = "gate"
    router_dtype: str = "fp32"
    router_weight: str = "weight"
    correction_bias: str = "e_score_correction_bias"
    block_bias: str | None = None
    bias_aliases: tuple[str, ...] = ()
    layer_bias_aliases: tuple[str, ...] = ()
    experts: str = "experts"
    fused_names: tuple[str, ...] = ("gate_up_proj", "down_proj")
    fused_layout: str = "gate_up_rows"
    stored_fused_layouts: tuple[str, ...] = ()
    checkpoint_fused_layout: str | None = None
    expert_spellings: tuple[tuple[str, str, str], ...] = (GATE_UP_DOWN, W1_W3_W2)
    shared_prefixes: tuple[str, ...] = ("shared_experts.", "shared_expert.")
    shared_expert_gate: str = "shared_expert_gate"
    hidden_acts: Mapping[str, str] = field(default_factory=lambda: dict(HIDDEN_ACTS))
    formats: tuple[str, ...] = ("bf16", "fp8_block")
    quantization_fields: tuple[str, ...] = ()
    router_bias: str = "bias"
    expert_biases: tuple[str, str] = ("gate_up_proj_bias", "down_proj_bias")
    returns_router_output: int | None = None
    stored_names: Mapping[str, str] = field(default_factory=dict)
    router_input: str = "rows"
    output_bias: str | None = None
    output_norm: str | None = None
    experts_only: bool = False
    linear_router: bool = True
    identity_experts: str | None = None
    zero_weight_skips: bool = False
    layer_count: str | Callable[[ConfigFields], int] = "num_hidden_layers"
    model_layers: str | None = None
    text_model: str | None = None
    text_config: bool = False
    release_text_config: tuple[str, str] | None = None
    dense_renames: tuple[DenseRename, ...] = ()
    dense_concat: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    dense_split: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    dense_convert: Mapping[str, tuple[tuple[str, ...], Callable[[list[torch.Tensor], tuple[int, ...]], torch.Tensor]]] = \
        field(default_factory=dict)
    dtype_check: Callable[[torch.dtype], None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "hidden_acts", MappingProxyType(dict(self.hidden_acts)))
        object.__setattr__(self, "stored_names", MappingProxyType(dict(self.stored_names)))
        object.__setattr__(self, "dense_concat", MappingProxyType(dict(self.dense_concat)))
        object.__setattr__(self, "dense_split", MappingProxyType(dict(self.dense_split)))
        object.__setattr__(self, "dense_convert", MappingProxyType(dict(self.dense_convert)))
        if self.model_layers is None and isinstance(self.text_model, str):  # the text model's decoder layers
            object.__setattr__(self, "model_layers", f"{self.text_model}.layers")
        where = f"ModelFamily({self.model_type!r})"
        routing = get_routing(self.routing, f"{where}.routing")
        if not isinstance(self.router_dtype, str) or self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"{where}.router_dtype: {self.router_dtype!r} is not one of {list(ROUTER_DTYPES)}")
        if routing.score_dtype == "model" and self.router_dtype != "model":
            raise ValueError(f"{where}.router_dtype: routing {self.routing!r} scores in the model dtype, from logits "
                             f"computed in it; router_dtype must be 'model', got {self.router_dtype!r}")
        for pattern, kind in self.hidden_acts.items():
            get_activation(kind, f"{where}.hidden_acts[{pattern!r}]")
        if self.fused_layout not in FUSED_LAYOUTS:
            raise ValueError(f"{where}.fused_layout: {self.fused_layout!r} is not one of {list(FUSED_LAYOUTS)}")
        unknown = [f for f in self.formats if f not in CHECKPOINT_FORMATS]
        if unknown or not self.formats:
            raise ValueError(f"{where}.formats: {list(self.formats)} must be a non-empty list of "
                             f"{list(CHECKPOINT_FORMATS)}")
        r = self.release_text_config
        if r is not None and not (isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, str) and x for x in r)):
            raise ValueError(f"{where}.release_text_config: expected None or (whole model_type, config.json key), "
                             f"got {r!r}")
        if not isinstance(self.quantization_fields, tuple) or \
                not all(isinstance(k, str) and k for k in self.quantization_fields):
            raise ValueError(f"{where}.quantization_fields: expected a tuple of config.json field names, got "
                             f"{self.quantization_fields!r}")
        if self.experts_only and not self.experts:
            raise ValueError(f"{where}: experts_only needs an experts module name (the module moeshard replaces), "
                             f"got {self.experts!r}")
        for name in ("block_prefixes", "shared_prefixes"):
            if name == "block_prefixes" and self.experts_only and self.block_is_layer:
                continue  # the decoder layer holds the router and the experts
            bad = [p for p in getattr(self, name) if not (isinstance(p, str) and p.endswith(".") and len(p) > 1)]
            if bad or not getattr(self, name):
                raise ValueError(f"{where}.{name}: every entry must be a module name ending in '.', got "
                                 f"{list(getattr(self, name))}")
        layout = fused_layout(self.fused_layout)
        others = [fused_layout(n) if n in FUSED_LAYOUTS else None for n in self.stored_fused_layouts]
        if self.checkpoint_fused_layout is not None:
            if self.stored_fused_layouts:
                raise ValueError(f"{where}: checkpoint_fused_layout and stored_fused_layouts exclude each other (one "
                                 f"layout every checkpoint stores, or layouts told apart by shape)")
            others.append(fused_layout(self.checkpoint_fused_layout) if self.checkpoint_fused_layout in FUSED_LAYOUTS
                          else None)
            stored = fused_layout(self.checkpoint_fused_layout) if others[-1] is not None else None
            if stored is not None and stored.transposed != layout.transposed:
                raise ValueError(f"{where}.checkpoint_fused_layout: {self.checkpoint_fused_layout!r} stores other shapes "
                                 f"than {self.fused_layout!r}; list it in stored_fused_layouts (told apart by shape)")
        if any(o is None or o.tensors != layout.tensors or o.gated != layout.gated for o in others):
            raise ValueError(f"{where}.stored_fused_layouts: {list(self.stored_fused_layouts)} must be fused layouts "
                             f"({list(FUSED_LAYOUTS)}) of as many tensors as {self.fused_layout!r}, holding the same "
                             f"products")
        if len(self.fused_names) != layout.tensors or not all(
                isinstance(n, str) and n and all(p.isidentifier() for p in n.split(".")) for n in self.fused_names):
            want = "(gate, up, down)" if layout.stacked else "(gate_up, down)"
            raise ValueError(f"{where}.fused_names: fused layout {self.fused_layout!r} expects {want} names, got "
                             f"{self.fused_names!r}")
        for name in ("router_weight", "correction_bias"):
            value = getattr(self, name)
            if not (isinstance(value, str) and value and all(part.isidentifier() for part in value.split("."))):
                raise ValueError(f"{where}.{name}: expected a dotted parameter name, got {value!r}")
        odd = {k: v for k, v in self.stored_names.items() if not (isinstance(k, str) and isinstance(v, str) and k and v)}
        if odd:
            raise ValueError(f"{where}.stored_names: every entry must map a tensor name to a tensor name, got {odd}")
        if not all(isinstance(pair, tuple) and len(pair) == 2 and (
                all(isinstance(p, str) and p for p in pair)
                or (isinstance(pair[0], re.Pattern) and (isinstance(pair[1], str) or callable(pair[1]))))
                for pair in self.dense_renames):
            raise ValueError(f"{where}.dense_renames: expected (model part, stored part) pairs of names, or "
                             f"(re.Pattern, template or function of the match), got {list(self.dense_renames)}")
        if not all(isinstance(k, str) and k and isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], tuple)
                   and v[0] and all(isinstance(p, str) and p for p in v[0]) and callable(v[1])
                   for k, v in self.dense_convert.items()):
            raise ValueError(f"{where}.dense_convert: expected {{model name: (stored names, convert(tensors, shape))}}, "
                             f"got {dict(self.dense_convert)}")
        for name, what in (("dense_concat", "{model name ending: two or more stored name endings}"),
                           ("dense_split", "{stored name ending: two or more model name endings}")):
            entries = getattr(self, name)
            if not all(isinstance(k, str) and k and isinstance(v, tuple) and len(v) > 1
                       and all(isinstance(p, str) and p for p in v) for k, v in entries.items()):
                raise ValueError(f"{where}.{name}: expected {what}, got {dict(entries)}")
        if self.dtype_check is not None and not callable(self.dtype_check):
            raise ValueError(f"{where}.dtype_check: expected None or a callable(dtype), got {self.dtype_check!r}")
        if self.router_input not in ROUTER_INPUTS:
            raise ValueError(f"{where}.router_input: {self.router_input!r} is not one of {list(ROUTER_INPUTS)}")
        if self.block_bias is not None and not (isinstance(self.block_bias, str) and self.block_bias.isidentifier()):
            raise ValueError(f"{where}.block_bias: expected None or a parameter name of the block, got "
                             f"{self.block_bias!r}")
        if self.output_bias is not None and not (isinstance(self.output_bias, str) and self.output_bias.isidentifier()):
            raise ValueError(f"{where}.output_bias: expected None or a parameter name of the block, got "
                             f"{self.output_bias!r}")
        if self.output_norm is not None and not (isinstance(self.output_norm, str) and self.output_norm.isidentifier()):
            raise ValueError(f"{where}.output_norm: expected None or a module name of the block, got "
                             f"{self.output_norm!r}")
        if not (callable(self.layer_count) or (isinstance(self.layer_count, str) and self.layer_count.isidentifier())):
            raise ValueError(f"{where}.layer_count: expected a config field name or a callable, got {self.layer_count!r}")
        if self.model_layers is not None and not (isinstance(self.model_layers, str) and all(
                p.isidentifier() for p in self.model_layers.split("."))):
            raise ValueError(f"{where}.model_layers: expected None or a dotted module path, got {self.model_layers!r}")
        if self.text_model is not None and not (isinstance(self.text_model, str) and all(
                p.isidentifier() for p in self.text_model.split("."))):
            raise ValueError(f"{where}.text_model: expected None or a dotted module path, got {self.text_model!r}")
        if not isinstance(self.text_config, bool) or (self.text_config and self.model_layers is None):
            raise ValueError(f"{where}.text_config: expected a bool, and model_layers or text_model (the whole "
                             f"model's decoder layers) where true; got text_config={self.text_config!r}, "
                             f"model_layers={self.model_layers!r}")
        gated = {get_activation(kind).gated for kind in self.hidden_acts.values()}
        if gated != {layout.gated}:
            raise ValueError(f"{where}.fused_layout: {self.fused_layout!r} holds {'gate and up' if layout.gated else 'up'} "
                             f"rows, but its activations {sorted(set(self.hidden_acts.values()))} are "
                             f"{' and '.join('gated' if g else 'ungated' for g in sorted(gated, reverse=True))}")
        if self.identity_experts is not None and (self.linear_router or not self.experts_only
                                                  or not self.identity_experts.isidentifier()):
            raise ValueError(f"{where}.identity_experts: {self.identity_experts!r} needs a config field name, "
                             f"experts_only=True and linear_router=False (transformers' router picks them)")
        if not isinstance(self.zero_weight_skips, bool) or (self.zero_weight_skips and not self.experts_only):
            raise ValueError(f"{where}.zero_weight_skips: {self.zero_weight_skips!r} must be a bool, True only with "
                             f"experts_only=True (transformers' router marks the skips)")
        if not self.linear_router and not self.experts_only:
            raise ValueError(f"{where}: linear_router=False needs experts_only=True (moeshard routes every other "
                             f"family itself, with the router's [E, H] weight)")
        if self.output_norm is not None and self.experts_only:
            raise ValueError(f"{where}: output_norm needs moeshard's block in place of transformers' (experts_only "
                             f"keeps transformers' block, which applies its own norm)")
        if not (isinstance(self.experts, str) and all(p.isidentifier() for p in self.experts.split(".") if self.experts)):
            raise ValueError(f"{where}.experts: expected a module name or '' (the block holds the experts), got "
                             f"{self.experts!r}")
        if not all(isinstance(a, str) and a and not a.endswith(".") for a in self.bias_aliases):
            raise ValueError(f"{where}.bias_aliases: expected tensor names after the block prefix, got "
                             f"{list(self.bias_aliases)}")
        if not all(isinstance(a, str) and a and not a.endswith(".") for a in self.layer_bias_aliases):
            raise ValueError(f"{where}.layer_bias_aliases: expected tensor names after the decoder layer's prefix, "
                             f"got {list(self.layer_bias_aliases)}")

    @property
    def bias_module(self) -> str:
        """The selection bias's name in the transformers block: the block's own ``block_bias``,
        else the router's ``{router}.{correction_bias}``."""
        return self.block_bias or f"{self.router}.{self.correction_bias}"

    @property
    def bias_names(self) -> tuple[str, ...]:
        """The selection bias's checkpoint names after the block prefix, in the order tried."""
        return (self.bias_module, *self.bias_aliases)

    @property
    def block_is_layer(self) -> bool:
        """Whether the decoder layer itself holds the router and the experts (block prefix "",
        Gemma 4), rather than a block module inside it."""
        return self.block_prefixes == ("",)

    @property
    def block_attributes(self) -> tuple[str, ...]:
        """The decoder layer's attributes that may hold the block in a transformers model."""
        return tuple(p[:-1] for p in self.block_prefixes)

    def stored(self, name: str) -> str:
        """The checkpoint's name of the block-relative tensor ``name`` (see ``stored_names``)."""
        return self.stored_names.get(name, name)

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name (as ``SafetensorsCheckpoint`` gives it) of the model's tensor
        ``name`` before any dense rename: a tensor of the text model (``text_model``) under the
        causal LM's ``model.``, any other as it is."""
        if self.text_model is not None and name.startswith(self.text_model + "."):
            return "model." + name[len(self.text_model) + 1:]
        return name

    def dense_split_of(self, name: str, stored: Callable[[str], bool] | None = None) -> tuple[str, tuple[str, ...]] | None:
        """(the stored tensor, the model tensors that are its row ranges, in order) where the model's
        tensor ``name`` is one of a ``dense_split`` entry's parts, else None. Given what the
        checkpoint holds (``stored``): None where it holds ``name`` itself (under its own name or
        as ``dense_renames`` rename it: a part's ending may also end tensors stored apart, Unlimited
        OCR's text attention beside its vision encoder's fused one), and the stored tensor named as
        the checkpoint holds it (``dense_renames`` applied)."""
        for stored_ending, parts in self.dense_split.items():
            for part in parts:
                if name.endswith(part):
                    prefix = name[: len(name) - len(part)]
                    whole = self.checkpoint_name(prefix + stored_ending)
                    if stored is not None:
                        if stored(self._stored_as(self.checkpoint_name(name), stored)):
                            return None
                        whole = self._stored_as(whole, stored)
                    return whole, tuple(prefix + p for p in parts)
        return None

    def dense_sources(self, name: str, stored: Callable[[str], bool]) -> tuple[str, ...]:
        """The checkpoint's tensors that make the model's tensor ``name`` outside the MoE blocks,
        named from its ``checkpoint_name`` n: n itself where the checkpoint holds it (``stored``);
        else the parts ``dense_concat`` lists (concatenated along dim 0), each as ``_stored_as``
        finds it; else n as ``_stored_as`` finds it."""
        name = self.checkpoint_name(name)
        if stored(name):
            return (name,)
        for ending, parts in self.dense_concat.items():
            if name.endswith(ending):
                return tuple(self._stored_as(name[: len(name) - len(ending)] + part, stored) for part in parts)
        return (self._stored_as(name, stored),)

    def _stored_as(self, name: str, stored: Callable[[str], bool]) -> str:
        """``name`` where the checkpoint holds it, else the first the checkpoint holds of ``name``
        with each rename of ``dense_renames`` that applies, then with all of them applied in order
        (else ``name`` with the first that applies, or ``name``, for the message)."""
        if stored(name):
            return name
        renamed = [_rename(name, model_part, stored_part) for model_part, stored_part in self.dense_renames
                   if _applies(name, model_part)]
        if not renamed:
            return name
        if len(renamed) > 1:  # every rename that applies, in order (a vision tower's prefix and an inner name)
            composed = name
            for model_part, stored_part in self.dense_renames:
                composed = _rename(composed, model_part, stored_part)
            renamed.append(composed)
        return next((r for r in renamed if stored(r)), renamed[0])

    def dense_convert_of(self, name: str) -> tuple[tuple[str, ...], Callable[..., torch.Tensor]] | None:
        """(the stored tensors, convert) that make the model's tensor ``name`` (``dense_convert``),
        else None."""
        return self.dense_convert.get(self.checkpoint_name(name))

    def expert_tensor(self, name: str) -> str:
        """The block-relative name of the routed experts' tensor ``name`` (``experts.gate_up_proj``;
        ``name`` itself where the block holds the experts, ``experts`` "")."""
        return f"{self.experts}.{name}" if self.experts else name

    @property
    def router_tensor(self) -> str:
        """The router weight's block-relative name in the transformers model (``gate.weight``)."""
        return f"{self.router}.{self.router_weight}"

    @property
    def bias_tensor(self) -> str:
        """The correction bias's block-relative name in the transformers model."""
        return f"{self.router}.{self.correction_bias}"

    def layer_prefix(self, layer: int) -> str:
        """``model.layers.{layer}.``: where the decoder layer's tensors are named in the checkpoint."""
        return f"{self.layers}.{layer}."

    def model_layer_prefix(self, layer: int) -> str:
        """Where the decoder layer's tensors are named in the transformers causal LM (``model_layers``,
        else ``layers``)."""
        return f"{self.model_layers or self.layers}.{layer}."

    def count_layers(self, f: ConfigFields) -> int:
        """The decoder layers ``config.json`` describes (``layer_count``)."""
        return f.int(self.layer_count) if isinstance(self.layer_count, str) else self.layer_count(f)

    def fields(self, raw: dict[str, Any], source: str) -> ConfigFields:
        return ConfigFields(raw, self, source)


def _applies(name: str, model_part: str | re.Pattern[str]) -> bool:
    return model_part.search(name) is not None if isinstance(model_part, re.Pattern) else model_part in name


def _rename(name: str, model_part: str | re.Pattern[str], stored_part: str | Callable[[re.Match[str]], str]) -> str:
    """``name`` with the first occurrence of ``model_part`` replaced (a pattern: ``re.sub`` once)."""
    if isinstance(model_part, re.Pattern):
        return model_part.sub(stored_part, name, count=1)
    assert isinstance(stored_part, str)  # __post_init__ allows a function only with a pattern
    return name.replace(model_part, stored_part, 1)


# -- dense layers ------------------------------------------------------------------------------
SCAN_LIMIT = 100_000  # layers looked at, at most, when a message lists some MoE layers


class DenseLayers(Mapping[int, str]):
    """``{layer: why it has no MoE block}`` for layers ``0 .. num_layers - 1``, computed per layer by
    ``why(layer) -> str | None``: a lookup is O(1) whatever ``num_hidden_layers`` says (a config
    may claim 10^9 layers); only iterating visits every layer."""

    def __init__(self, num_layers: int, why: Callable[[int], str | None]) -> None:
        self.num_layers, self._why = num_layers, why

    def __getitem__(self, layer: object) -> str:
        reason = self._why(layer) if is_int(layer) and 0 <= layer < self.num_layers else None
        if reason is None:
            raise KeyError(layer)
        return reason

    def __contains__(self, layer: object) -> bool:
        return is_int(layer) and 0 <= layer < self.num_layers and self._why(layer) is not None

    def __iter__(self) -> Iterator[int]:
        return (layer for layer in range(self.num_layers) if self._why(layer) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def moe_layers(self, limit: int) -> list[int]:
        """The first ``limit`` layers that have an MoE block, among the first ``SCAN_LIMIT`` layers."""
        scan = range(min(self.num_layers, SCAN_LIMIT))
        return list(itertools.islice((layer for layer in scan if self._why(layer) is None), limit))

    def __repr__(self) -> str:
        return f"DenseLayers(num_layers={self.num_layers})"


def every_layer(f: ConfigFields, num_layers: int) -> DenseLayers:
    """Every layer holds an MoE block."""
    return DenseLayers(num_layers, lambda layer: None)


def qwen_dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    only = frozenset(f.int_list("mlp_only_layers"))
    step = f.int("decoder_sparse_step")
    experts = f.int("num_experts", minimum=0)

    def why(layer: int) -> str | None:
        if experts == 0:
            return "num_experts=0"
        if layer in only:
            return f"listed in mlp_only_layers={sorted(only)}"
        if (layer + 1) % step:
            return f"(layer + 1) % decoder_sparse_step={step} != 0"
        return None
    return DenseLayers(num_layers, why)


def _deepseek_dense_layers(f: ConfigFields, num_layers: int) -> DenseLayers:
    first = f.int("first_k_dense_replace", minimum=0)
    freq = f.int("moe_layer_freq")

    def why(layer: int) -> str | None:
        if layer < first:
            return f"layer < first_k_dense_replace={first}"
        if layer % freq:
            return f"layer % moe_layer_freq={freq} != 0"
        return None
    return DenseLayers(num_layers, why)


# -- config.json -> MoEConfig ------------------------------------------------------------------
def _mixtral_moe(f: ConfigFields) -> MoEConfig:
    act, H = f.activation(), f.int("hidden_size")
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"), hidden_size=H,
                     intermediate_size=f.int("intermediate_size"),
                     activation=act, scoring=f.family.routing)  # renormalize: the kind's rule (softmax: True)


SHARED_EXPERT_KINDS = ("none", "gated", "ungated")


def qwen_layout_moe(f: ConfigFields, shared_expert: str) -> MoEConfig:
    """The block of a Qwen-layout config.json (``num_experts``, ``moe_intermediate_size``,
    ``norm_topk_prob``) under the family's routing kind, with no shared expert, or one of
    ``shared_expert_intermediate_size`` behind a sigmoid gate (Qwen2-MoE) or added whole
    (LaraMini, Flint): ``shared_expert`` is one of ``SHARED_EXPERT_KINDS``."""
    if shared_expert not in SHARED_EXPERT_KINDS:
        raise ValueError(f"qwen_layout_moe: shared_expert={shared_expert!r} is not one of {list(SHARED_EXPERT_KINDS)}")
    act, H = f.activation(), f.int("hidden_size")
    shared = f.int("shared_expert_intermediate_size", minimum=0) if shared_expert != "none" else 0
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"), hidden_size=H,
                     intermediate_size=f.int("moe_intermediate_size"), activation=act, scoring=f.family.routing,
                     renormalize=f.bool("norm_topk_prob"), num_shared_experts=1 if shared else 0,
                     shared_intermediate_size=shared, shared_expert_gate=bool(shared) and shared_expert == "gated")


def _qwen2_moe(f: ConfigFields) -> MoEConfig:
    return qwen_layout_moe(f, "gated")


def _qwen3_moe(f: ConfigFields) -> MoEConfig:
    return qwen_layout_moe(f, "none")


def _deepseek_v3_moe(f: ConfigFields) -> MoEConfig:
    act, H = f.activation(), f.int("hidden_size")
    if f.get("scoring_func") != "sigmoid":
        raise ValueError(f"{f.source}: scoring_func={f.get('scoring_func')!r}; deepseek_v3 blocks use 'sigmoid'")
    if f.get("topk_method") != "noaux_tc":
        raise ValueError(f"{f.source}: topk_method={f.get('topk_method')!r}; deepseek_v3 blocks use 'noaux_tc' "
                         f"(sigmoid scores + e_score_correction_bias)")
    I = f.int("moe_intermediate_size")
    shared = f.int("n_shared_experts", minimum=0)
    return MoEConfig(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"), hidden_size=H,
                     intermediate_size=I, activation=act, scoring=f.family.routing, renormalize=f.bool("norm_topk_prob"),
                     n_group=f.int("n_group"), topk_group=f.int("topk_group"),
                     routed_scaling_factor=f.float("routed_scaling_factor", 0.0, MAX_ROUTED_SCALING),
                     use_correction_bias=True,
                     num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


# The FP8 checkpoints published for these families: block scales (Qwen's own), ModelOpt's
# (NVIDIA's) and compressed-tensors' (per-channel, as Red Hat's FP8-dynamic releases).
_FP8_FORMATS = ("bf16", "fp8_block", "modelopt_fp8", "compressed_fp8", "modelopt_nvfp4")
_QWEN_DEFAULTS = {"hidden_act": "silu", "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}

FAMILIES: dict[str, ModelFamily] = {family.model_type: family for family in (
    # Mixtral on the hub keeps its block under block_sparse_moe; transformers 5 writes mlp.
    ModelFamily("mixtral", {"hidden_act": "silu"}, _mixtral_moe, every_layer,
                block_prefixes=("block_sparse_moe.", "mlp."), router_dtype="model", formats=_FP8_FORMATS),
    ModelFamily("qwen2_moe", _QWEN_DEFAULTS, _qwen2_moe, qwen_dense_layers, router_dtype="model", formats=_FP8_FORMATS),
    ModelFamily("qwen3_moe", _QWEN_DEFAULTS, _qwen3_moe, qwen_dense_layers, router_dtype="model", formats=_FP8_FORMATS),
    ModelFamily("deepseek_v3", {"hidden_act": "silu", "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                                "norm_topk_prob": True, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                                "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
                _deepseek_v3_moe, _deepseek_dense_layers, routing="sigmoid", router_dtype="fp32",
                formats=("bf16", "fp8_block", "modelopt_nvfp4")),
)}


def register_family(family: ModelFamily) -> ModelFamily:
    """Adds ``family`` (a new ``model_type``); ValueError if that model type is known already."""
    if not isinstance(family, ModelFamily):
        raise ValueError(f"register_family: expected a ModelFamily, got {type(family).__name__}")
    if family.model_type in FAMILIES:
        raise ValueError(f"register_family({family.model_type!r}): a family of that model_type is registered already")
    FAMILIES[family.model_type] = family
    REFUSED.pop(family.model_type, None)
    return family


def unregister_family(model_type: str) -> None:
    """Removes a family (tests that register one of their own clean up with this)."""
    FAMILIES.pop(model_type, None)


# model_type -> which part of its MoE block moeshard cannot express: such a model type is refused
# with that reason rather than as unknown. A registered family of that model type wins.
REFUSED: dict[str, str] = {}


def refuse_family(model_type: str, reason: str) -> None:
    """Records that ``model_type`` is refused, and why (one clause naming the part of its block);
    nothing when a family of that model type is registered."""
    if model_type not in FAMILIES:
        REFUSED[model_type] = reason


def model_family(model_type: Any, source: str) -> ModelFamily:
    """The family of ``model_type``; ValueError naming it and the supported ones otherwise (with the
    reason for a model type in ``REFUSED``)."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        why = REFUSED.get(model_type) if isinstance(model_type, str) else None
        because = f": {why}" if why else ""
        raise ValueError(f"{source}: model_type {model_type!r} is not supported{because}; supported: {list(FAMILIES)}")
    return family

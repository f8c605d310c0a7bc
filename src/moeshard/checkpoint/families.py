"""The model families moeshard reads, one ``ModelFamily`` entry each in ``FAMILIES``.

A family says everything that differs between Hugging Face ``model_type``s: the defaults of the
routing fields, how ``config.json`` maps onto ``MoEConfig``, which layers are dense, where a
layer's block lives and how its experts' tensors are spelled. ``hf_config`` and ``names`` read
it; a new family (say ``qwen3_next``) is one more entry here.

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

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from moeshard.config import MoEConfig
from moeshard.validate import is_int

# Per-expert (gate, up, down) module names: as transformers' per-expert MLPs, and as Mixtral publishes.
GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
W1_W3_W2 = ("w1", "w3", "w2")

# Other spellings of a field: transformers 5 writes num_local_experts where older configs (and the
# hub) have num_experts / n_routed_experts.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_local_experts": ("num_experts",),
    "num_experts": ("num_local_experts",),
    "n_routed_experts": ("num_local_experts",),
}


class ConfigFields:
    """``config.json`` values with the family's defaults, and messages that name the field."""

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
        return value

    def activation(self) -> str:
        name = self.get("hidden_act")
        if name in ("silu", "swish"):
            return "silu"
        if isinstance(name, str) and name.startswith("gelu"):
            return "gelu"
        raise ValueError(f"{self.source}: hidden_act={name!r} is not supported; expected 'silu', 'swish' or a "
                         f"'gelu' variant")


@dataclass(frozen=True)
class ModelFamily:
    """What moeshard knows about one ``model_type``.

    defaults: transformers-5 defaults of the routing fields it reads, used when config.json omits
      one. Shape fields (sizes, expert counts, top-k) have none: a guess there would load the
      wrong tensors, so a missing one is an error.
    moe: config.json -> the block's ``MoEConfig`` (dtype left at its default).
    dense_layers: (config.json, num_layers) -> {layer: why it has no MoE block}.
    block_prefixes: where layer L's block lives, after ``model.layers.{L}.``, in the order tried.
    expert_spellings: per-expert (gate, up, down) module names, in the order tried.
    """

    model_type: str
    defaults: Mapping[str, Any]
    moe: Callable[[ConfigFields], MoEConfig]
    dense_layers: Callable[[ConfigFields, int], dict[int, str]]
    block_prefixes: tuple[str, ...] = ("mlp.",)
    expert_spellings: tuple[tuple[str, str, str], ...] = (GATE_UP_DOWN, W1_W3_W2)

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    def fields(self, raw: dict[str, Any], source: str) -> ConfigFields:
        return ConfigFields(raw, self, source)


# -- dense layers ------------------------------------------------------------------------------
def _no_dense_layers(f: ConfigFields, num_layers: int) -> dict[int, str]:
    return {}


def _qwen_dense_layers(f: ConfigFields, num_layers: int) -> dict[int, str]:
    only = set(f.get("mlp_only_layers"))
    step = f.int("decoder_sparse_step")
    experts = f.int("num_experts", minimum=0)
    dense = {}
    for layer in range(num_layers):
        if experts == 0:
            dense[layer] = "num_experts=0"
        elif layer in only:
            dense[layer] = f"listed in mlp_only_layers={sorted(only)}"
        elif (layer + 1) % step:
            dense[layer] = f"(layer + 1) % decoder_sparse_step={step} != 0"
    return dense


def _deepseek_dense_layers(f: ConfigFields, num_layers: int) -> dict[int, str]:
    first = f.int("first_k_dense_replace", minimum=0)
    freq = f.int("moe_layer_freq")
    dense = {}
    for layer in range(num_layers):
        if layer < first:
            dense[layer] = f"layer < first_k_dense_replace={first}"
        elif layer % freq:
            dense[layer] = f"layer % moe_layer_freq={freq} != 0"
    return dense


# -- config.json -> MoEConfig ------------------------------------------------------------------
def _mixtral_moe(f: ConfigFields) -> MoEConfig:
    act, H = f.activation(), f.int("hidden_size")
    return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"), hidden_size=H,
                     intermediate_size=f.int("intermediate_size"),
                     activation=act, renormalize=True)


def _qwen_moe(f: ConfigFields, gated_shared_expert: bool) -> MoEConfig:
    act, H = f.activation(), f.int("hidden_size")
    shared = f.int("shared_expert_intermediate_size", minimum=0) if gated_shared_expert else 0
    return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"), hidden_size=H,
                     intermediate_size=f.int("moe_intermediate_size"), activation=act,
                     renormalize=bool(f.get("norm_topk_prob")), num_shared_experts=1 if shared else 0,
                     shared_intermediate_size=shared, shared_expert_gate=bool(shared))


def _qwen2_moe(f: ConfigFields) -> MoEConfig:
    return _qwen_moe(f, gated_shared_expert=True)


def _qwen3_moe(f: ConfigFields) -> MoEConfig:
    return _qwen_moe(f, gated_shared_expert=False)


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
                     intermediate_size=I, activation=act, scoring="sigmoid", renormalize=bool(f.get("norm_topk_prob")),
                     n_group=f.int("n_group"), topk_group=f.int("topk_group"),
                     routed_scaling_factor=float(f.get("routed_scaling_factor")), use_correction_bias=True,
                     num_shared_experts=shared, shared_intermediate_size=I if shared else 0)


_QWEN_DEFAULTS = {"hidden_act": "silu", "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}

FAMILIES: dict[str, ModelFamily] = {family.model_type: family for family in (
    # Mixtral on the hub keeps its block under block_sparse_moe; transformers 5 writes mlp.
    ModelFamily("mixtral", {"hidden_act": "silu"}, _mixtral_moe, _no_dense_layers,
                block_prefixes=("block_sparse_moe.", "mlp.")),
    ModelFamily("qwen2_moe", _QWEN_DEFAULTS, _qwen2_moe, _qwen_dense_layers),
    ModelFamily("qwen3_moe", _QWEN_DEFAULTS, _qwen3_moe, _qwen_dense_layers),
    ModelFamily("deepseek_v3", {"hidden_act": "silu", "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                                "norm_topk_prob": True, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                                "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
                _deepseek_v3_moe, _deepseek_dense_layers),
)}


def model_family(model_type: Any, source: str) -> ModelFamily:
    """The family of ``model_type``; ValueError naming it and the supported ones otherwise."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: {list(FAMILIES)}")
    return family

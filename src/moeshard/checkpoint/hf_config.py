"""What a Hugging Face ``config.json`` says about a model's MoE blocks.

Four model types are understood; each maps its own field names onto ``MoEConfig``:

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
config has 1) is honoured. ``hidden_act`` ``silu``/``swish`` map to
``"silu"``; every ``gelu*`` variant maps to ``"gelu"`` (exact erf GELU: the tanh-approximate
variants ``gelu_new``/``gelu_pytorch_tanh``/``gelu_fast`` then differ from the model by the
approximation, below 1e-3 absolute per activation).

A ``quantization_config`` is accepted only for DeepSeek-V3-style FP8 block checkpoints
(``quant_method: fp8``, ``weight_block_size: [128, 128]``, dynamic activations), which load as
moeshard's ``fp8_block``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moeshard.config import MODEL_DTYPES, MoEConfig
from moeshard.validate import is_int

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
FP8_CHECKPOINT_BLOCK = (128, 128)

# transformers-5 defaults of the routing fields we read, per model type, used when config.json
# omits one. Shape fields (sizes, expert counts, top-k) have no default: a guess there would load
# the wrong tensors, so a missing one is an error.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"hidden_act": "silu"},
    "qwen2_moe": {"hidden_act": "silu", "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3_moe": {"hidden_act": "silu", "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "deepseek_v3": {"hidden_act": "silu", "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                    "norm_topk_prob": True, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                    "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
}
# Other spellings of a field: transformers 5 writes num_local_experts where older configs (and the
# hub) have num_experts / n_routed_experts.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_local_experts": ("num_experts",),
    "num_experts": ("num_local_experts",),
    "n_routed_experts": ("num_local_experts",),
}


@dataclass(frozen=True)
class HFMoEModel:
    """The MoE-relevant part of one model's ``config.json``.

    Fields:
      model_type: one of ``SUPPORTED_MODEL_TYPES``.
      num_layers: ``num_hidden_layers``; layers are ``0 .. num_layers - 1``.
      moe: the shape and routing of every MoE block of the model (dtype: ``checkpoint_dtype`` or
        fp32 when the config names none).
      dense_layers: layer index -> why that layer has no MoE block (a dense MLP instead).
      checkpoint_dtype: the ``dtype`` / ``torch_dtype`` the config declares, if it is a model
        dtype (fp32/bf16/fp16), else None.
      fp8_block: True for an FP8 checkpoint with 128 x 128 block scales (``weight_scale_inv``).
      source: the config file, for messages.
    """

    model_type: str
    num_layers: int
    moe: MoEConfig
    dense_layers: dict[int, str]
    checkpoint_dtype: torch.dtype | None
    fp8_block: bool
    source: str

    def moe_config(self, dtype: torch.dtype | None = None) -> MoEConfig:
        """The block's ``MoEConfig`` in ``dtype`` (default: the checkpoint's dtype, else fp32)."""
        return replace(self.moe, dtype=dtype or self.checkpoint_dtype or torch.float32)

    def check_layer(self, layer: int) -> None:
        """Raises ValueError unless ``layer`` exists and has an MoE block (says why not)."""
        if not is_int(layer):
            raise ValueError(f"layer: must be an integer, got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range: {self.source} has num_hidden_layers="
                             f"{self.num_layers} (layers 0..{self.num_layers - 1})")
        if layer in self.dense_layers:
            moe_layers = [i for i in range(self.num_layers) if i not in self.dense_layers]
            shown = moe_layers[:8] + (["..."] if len(moe_layers) > 8 else [])
            raise ValueError(f"layer {layer} of this {self.model_type} model has no MoE block: it is a dense "
                             f"layer ({self.dense_layers[layer]}); MoE layers: {shown}")


def _activation(name: Any, source: str) -> str:
    if name in ("silu", "swish"):
        return "silu"
    if isinstance(name, str) and name.startswith("gelu"):
        return "gelu"
    raise ValueError(f"{source}: hidden_act={name!r} is not supported; expected 'silu', 'swish' or a 'gelu' variant")


class _Fields:
    """config.json values with the model type's defaults and messages that name the field."""

    def __init__(self, raw: dict[str, Any], model_type: str, source: str) -> None:
        self.raw, self.model_type, self.source = raw, model_type, source

    def get(self, key: str) -> Any:
        for name in (key, *_ALIASES.get(key, ())):
            if self.raw.get(name) is not None:
                return self.raw[name]
        if key in _DEFAULTS[self.model_type]:
            return _DEFAULTS[self.model_type][key]
        also = "".join(f" (or {alias!r})" for alias in _ALIASES.get(key, ()))
        raise ValueError(f"{self.source}: missing field {key!r}{also} (model_type {self.model_type!r})")

    def int(self, key: str, minimum: int = 1) -> int:
        value = self.get(key)
        if not is_int(value) or value < minimum:
            raise ValueError(f"{self.source}: {key} must be an integer >= {minimum}, got {value!r}")
        return value


def _checkpoint_dtype(raw: dict[str, Any]) -> torch.dtype | None:
    name = raw.get("dtype") or raw.get("torch_dtype")
    if isinstance(name, str):
        return MODEL_DTYPES.get(name.removeprefix("torch."))
    return None


def _fp8_block(raw: dict[str, Any], source: str) -> bool:
    q = raw.get("quantization_config")
    if q is None:
        return False
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise ValueError(f"{source}: quantization_config with quant_method={method!r} is not supported; only "
                         f"DeepSeek-V3-style block FP8 (quant_method 'fp8', weight_block_size [128, 128]) is")
    block = q.get("weight_block_size")
    if block is None or tuple(block) != FP8_CHECKPOINT_BLOCK:
        raise ValueError(f"{source}: fp8 quantization_config has weight_block_size={block!r}; moeshard's fp8_block "
                         f"needs {list(FP8_CHECKPOINT_BLOCK)} (per-tensor FP8 checkpoints are not supported)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{source}: fp8 quantization_config has activation_scheme={scheme!r}; only 'dynamic' "
                         f"is supported (moeshard quantizes activations per token and 128 columns)")
    return True


def _dense_layers(f: _Fields, num_layers: int) -> dict[int, str]:
    if f.model_type == "mixtral":
        return {}
    if f.model_type in ("qwen2_moe", "qwen3_moe"):
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
    first = f.int("first_k_dense_replace", minimum=0)
    freq = f.int("moe_layer_freq")
    dense = {}
    for layer in range(num_layers):
        if layer < first:
            dense[layer] = f"layer < first_k_dense_replace={first}"
        elif layer % freq:
            dense[layer] = f"layer % moe_layer_freq={freq} != 0"
    return dense


def _moe(f: _Fields) -> MoEConfig:
    act = _activation(f.get("hidden_act"), f.source)
    H = f.int("hidden_size")
    if f.model_type == "mixtral":
        return MoEConfig(num_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"), hidden_size=H,
                         intermediate_size=f.int("intermediate_size"), activation=act, renormalize=True)
    if f.model_type in ("qwen2_moe", "qwen3_moe"):
        shared = f.int("shared_expert_intermediate_size", minimum=0) if f.model_type == "qwen2_moe" else 0
        return MoEConfig(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"), hidden_size=H,
                         intermediate_size=f.int("moe_intermediate_size"), activation=act,
                         renormalize=bool(f.get("norm_topk_prob")), num_shared_experts=1 if shared else 0,
                         shared_intermediate_size=shared, shared_expert_gate=bool(shared))
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


def parse_hf_config(raw: dict[str, Any], source: str = "config.json") -> HFMoEModel:
    """``HFMoEModel`` from the parsed ``config.json`` dict; ValueError names the field and value."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: "
                         f"{list(SUPPORTED_MODEL_TYPES)}")
    f = _Fields(raw, model_type, source)
    num_layers = f.int("num_hidden_layers")
    try:
        moe = _moe(f)
    except ValueError as exc:
        if str(exc).startswith(source):
            raise
        raise ValueError(f"{source}: the MoE block it describes is invalid: {exc}") from None
    return HFMoEModel(model_type=model_type, num_layers=num_layers, moe=moe,
                      dense_layers=_dense_layers(f, num_layers), checkpoint_dtype=_checkpoint_dtype(raw),
                      fp8_block=_fp8_block(raw, source), source=source)


def read_hf_config(model_dir: str | Path) -> HFMoEModel:
    """Reads ``<model_dir>/config.json``; ValueError if the directory or file is missing or malformed."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {str(model_dir)!r} does not exist or is not a directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON: {exc}") from None
    return parse_hf_config(raw, str(path))

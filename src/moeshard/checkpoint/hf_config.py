"""What a Hugging Face ``config.json`` says about a model's MoE blocks.

The model types understood, and how each maps its own field names onto ``MoEConfig``, are the
families of ``moeshard.checkpoint.families`` (mixtral, qwen2_moe, qwen3_moe, deepseek_v3, and those
``moeshard.checkpoint.models`` registers): one ``ModelFamily`` entry each, read here and by ``names``.

A ``quantization_config`` is matched against the checkpoint formats the family ships
(``families.CHECKPOINT_FORMATS``): DeepSeek-V3-style FP8 block checkpoints
(``quant_method: fp8``, ``weight_block_size: [128, 128]``, dynamic activations), which load as
moeshard's ``fp8_block``; ModelOpt and compressed-tensors FP8 checkpoints (per-tensor or per-row
``weight_scale``), which load as ``fp8_token`` (``checkpoint.formats``); and gpt-oss MXFP4
checkpoints (``quant_method: mxfp4``), whose experts are dequantized to the model dtype as they are
read. An older ModelOpt export states its quantization only in ``hf_quant_config.json``, read
where config.json has no ``quantization_config``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moeshard.checkpoint.families import (
    CHECKPOINT_FORMATS,
    FAMILIES,
    FP8_CHECKPOINT_BLOCK,
    SCAN_LIMIT,
    CheckpointFormat,
    DenseLayers,
    ModelFamily,
    checkpoint_format,
    model_family,
)
from moeshard.config import MODEL_DTYPES, MoEConfig
from moeshard.outputs import check_input_dir, check_input_file
from moeshard.validate import is_int

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)  # the built-in families; FAMILIES also holds registered ones
__all__ = ["FP8_CHECKPOINT_BLOCK", "SUPPORTED_MODEL_TYPES", "HFMoEModel", "parse_hf_config", "read_hf_config"]


@dataclass(frozen=True)
class HFMoEModel:
    """The MoE-relevant part of one model's ``config.json``.

    Fields:
      model_type: one of ``SUPPORTED_MODEL_TYPES`` (the keys of ``families.FAMILIES``).
      num_layers: ``num_hidden_layers`` (the family's ``layer_count``); layers are ``0 .. num_layers - 1``.
      moe: the shape and routing of every MoE block of the model (dtype: ``checkpoint_dtype`` or
        fp32 when the config names none).
      dense_layers: layer index -> why that layer has no MoE block (a dense MLP instead); a
        ``families.DenseLayers``, decided per layer (lookups cost nothing whatever num_layers is).
      checkpoint_dtype: the ``dtype`` / ``torch_dtype`` the config declares, if it is a model
        dtype (fp32/bf16/fp16), else None.
      checkpoint_format: the name of its ``families.CHECKPOINT_FORMATS`` entry (``bf16``, or
        ``fp8_block`` for FP8 weights with 128 x 128 block scales ``weight_scale_inv``).
      source: the config file, for messages.
      identity_experts: Z, the zero-computation experts the family's router may pick beside the
        E routed ones (``ModelFamily.identity_experts``; 0 for every other family).
      zero_weight_skips: the family's router marks skips as picks of weight 0
        (``ModelFamily.zero_weight_skips``).
    """

    model_type: str
    num_layers: int
    moe: MoEConfig
    dense_layers: DenseLayers
    checkpoint_dtype: torch.dtype | None
    checkpoint_format: str
    source: str
    identity_experts: int = 0
    zero_weight_skips: bool = False

    @property
    def family(self) -> ModelFamily:
        """The registry entry of ``model_type`` (block prefixes, expert spellings, ...)."""
        return FAMILIES[self.model_type]

    @property
    def format(self) -> CheckpointFormat:
        """The descriptor of ``checkpoint_format``."""
        return CHECKPOINT_FORMATS[self.checkpoint_format]

    def moe_config(self, dtype: torch.dtype | None = None) -> MoEConfig:
        """The block's ``MoEConfig`` in ``dtype`` (default: the checkpoint's dtype, else fp32).
        Raises ValueError when the installed transformers cannot run the family's own modules in
        that dtype (``ModelFamily.dtype_check``)."""
        cfg = replace(self.moe, dtype=dtype or self.checkpoint_dtype or torch.float32)
        if self.family.dtype_check is not None:
            self.family.dtype_check(cfg.dtype)
        return cfg

    def check_layer(self, layer: int) -> None:
        """Raises ValueError unless ``layer`` exists and has an MoE block (says why not)."""
        if not is_int(layer):
            raise ValueError(f"layer: must be an integer, got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range: {self.source} has num_hidden_layers="
                             f"{self.num_layers} (layers 0..{self.num_layers - 1})")
        if layer in self.dense_layers:
            moe_layers = self.dense_layers.moe_layers(9)
            shown: list[int | str] | str = moe_layers[:8] + (["..."] if len(moe_layers) > 8 else [])
            if not moe_layers:
                shown = f"none among the first {min(self.num_layers, SCAN_LIMIT)}"
            raise ValueError(f"layer {layer} of this {self.model_type} model has no MoE block: it is a dense "
                             f"layer ({self.dense_layers[layer]}); MoE layers: {shown}")


def _checkpoint_dtype(raw: dict[str, Any], source: str) -> torch.dtype | None:
    """The model dtype the config declares (``dtype``, else ``torch_dtype``), None when it declares
    none or one that is not a model dtype (e.g. an FP8 checkpoint's); a non-string is refused."""
    for key in ("dtype", "torch_dtype"):
        name = raw.get(key)
        if name is None:
            continue
        if not isinstance(name, str):
            raise ValueError(f"{source}: {key} must be a dtype name such as 'bfloat16', got {name!r}")
        return MODEL_DTYPES.get(name.removeprefix("torch."))
    return None


# What a vision-language config.json declares for the whole checkpoint, which its text model's
# config inherits where it declares none.
_WHOLE_CHECKPOINT = ("dtype", "torch_dtype", "quantization_config")


def text_model_config(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """``(raw, source)``, or, named ``<source>: text_config``, the fields of a vision-language
    config.json's ``text_config`` with what the whole checkpoint declares (``_WHOLE_CHECKPOINT``):
    - where the config's own model type is no family and its ``text_config``'s is (Qwen3.5-MoE's
      ``qwen3_5_moe`` holds a ``qwen3_5_moe_text``, Llama 4's ``llama4`` a ``llama4_text``): that
      text family, the model transformers' ``AutoModelForCausalLM`` builds from it, whose tensors
      ``SafetensorsCheckpoint`` names as that model does;
    - where the config's own model type is a family that reads its ``text_config``
      (``ModelFamily.text_config``, Aria's ``aria``): that family, the whole model;
    - named ``<source>: <key>``, where a release holds a text family's fields under another key
      and has no ``text_config`` (``ModelFamily.release_text_config``, Unlimited OCR's
      ``language_config``): that family."""
    def known(model_type: Any) -> bool:  # a malformed model_type (a dict, a list) is model_family's to refuse
        return isinstance(model_type, str) and model_type in FAMILIES

    top, text = raw.get("model_type"), raw.get("text_config")
    whole = {k: raw[k] for k in _WHOLE_CHECKPOINT if k in raw}
    release = next(((f.model_type, f.release_text_config[1]) for f in FAMILIES.values()
                    if f.release_text_config is not None and f.release_text_config[0] == top), None)
    if release is not None and text is None:
        family, key = release
        held = raw.get(key)
        if not isinstance(held, dict):
            raise ValueError(f"{source}: model_type {top!r} without a text_config holds its text model's fields in "
                             f"{key}, which must be an object; got {type(held).__name__}")
        return {**whole, **held, "model_type": family}, f"{source}: {key}"
    if isinstance(top, str) and known(top) and FAMILIES[top].text_config:
        if not isinstance(text, dict):
            raise ValueError(f"{source}: model_type {top!r} holds its text model's fields in text_config, which must "
                             f"be an object; got {type(text).__name__}")
        return {**whole, **text, "model_type": top}, f"{source}: text_config"
    if known(top) or not isinstance(text, dict) or not known(text.get("model_type")):
        return raw, source
    return {**whole, **text}, f"{source}: text_config"


def parse_hf_config(raw: dict[str, Any], source: str = "config.json") -> HFMoEModel:
    """``HFMoEModel`` from the parsed ``config.json`` dict; ValueError names the field and value."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    raw, source = text_model_config(raw, source)
    family = model_family(raw.get("model_type"), source)
    f = family.fields(raw, source)
    num_layers = family.count_layers(f)
    try:
        moe = replace(family.moe(f), router_dtype=family.router_dtype)
    except ValueError as exc:
        if str(exc).startswith(source):
            raise
        raise ValueError(f"{source}: the MoE block it describes is invalid: {exc}") from None
    identity = f.int(family.identity_experts, minimum=0) if family.identity_experts is not None else 0
    return HFMoEModel(model_type=family.model_type, num_layers=num_layers, moe=moe,
                      dense_layers=family.dense_layers(f, num_layers), checkpoint_dtype=_checkpoint_dtype(raw, source),
                      checkpoint_format=checkpoint_format(raw, family, source).name, source=source,
                      identity_experts=identity, zero_weight_skips=family.zero_weight_skips)


def read_hf_config(model_dir: str | Path) -> HFMoEModel:
    """Reads ``<model_dir>/config.json``; ValueError if the directory or file is missing or malformed."""
    model_dir = check_input_dir(model_dir, "model directory")
    path = model_dir / "config.json"
    if not os.path.lexists(path):
        raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
    raw = _read_json(path)
    legacy = model_dir / "hf_quant_config.json"
    if isinstance(raw, dict) and "quantization_config" not in raw and os.path.lexists(legacy):
        raw = {**raw, "quantization_config": modelopt_quantization(_read_json(legacy), str(legacy))}
    return parse_hf_config(raw, str(path))


def _read_json(path: Path) -> Any:
    check_input_file(path, f"model directory's {path.name}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON: {exc}") from None


def modelopt_quantization(raw: Any, source: str) -> dict[str, Any]:
    """The ``quantization_config`` that an older ModelOpt export states only in its
    hf_quant_config.json (``{"producer": ..., "quantization": {"quant_algo": ..., ...}}``), as
    config.json states it in newer exports: its ``quantization`` object with quant_method
    ``modelopt``. ValueError naming the field when it has no such object."""
    quantization = raw.get("quantization") if isinstance(raw, dict) else None
    if not isinstance(quantization, dict):
        raise ValueError(f"{source}: expected an object with a 'quantization' object (ModelOpt's export), got "
                         f"{str(raw)[:80]!r}")
    return {"quant_method": "modelopt", **quantization}

"""transformers' own model of a checkpoint (every expert, one device): what ``--compare``'s
reference runs and what the checkpoint writer fills and saves, and why transformers cannot load
a checkpoint here."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from moeshard.checkpoint.dense import read_dense
from moeshard.checkpoint.formats import CheckpointFormat
from moeshard.checkpoint.fp8_block_mxfp4 import PACKED_DTYPES, read_fp4
from moeshard.checkpoint.hf_config import read_hf_config
from moeshard.checkpoint.mxfp8 import scale_names as mxfp8_scale_names
from moeshard.checkpoint.names import block_scale_names, row_scale_name
from moeshard.checkpoint.nvfp4_modelopt import read_nvfp4
from moeshard.checkpoint.nvfp4_modelopt import scale_names as nvfp4_scale_names
from moeshard.checkpoint.reader import SafetensorsCheckpoint

# Static activation and KV-cache scales of ModelOpt and compressed-tensors checkpoints: calibration
# data for kernels that quantize with them, not weights of transformers' modules.
STATIC_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale")


def model_class(config):
    """transformers' auto class that builds the whole model of ``config`` (a ``PretrainedConfig``):
    its causal LM or, for a vision-language model with none (Qwen3-VL-MoE, GLM-4.5V), its
    image-text-to-text model, which takes text alone as well. Anything else: the causal LM's
    class, whose error names the config."""
    import transformers

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    return transformers.AutoModelForCausalLM


def transformers_refusal(model_dir: str | Path, flag: str = "--compare") -> str | None:
    """Why transformers' ``from_pretrained`` cannot load ``model_dir`` here (what ``flag`` needs:
    ``--compare``'s reference, ``--save``'s writer), or None: transformers reads an FP8 block
    checkpoint only with the accelerate package installed."""
    import importlib.util

    if read_hf_config(model_dir).format.name == "fp8_block" and importlib.util.find_spec("accelerate") is None:
        return (f"{flag}: transformers loads an FP8 block checkpoint only with the accelerate package, which this "
                f"environment lacks (pip install accelerate); run without {flag}")
    return None


def load_transformers_model(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model of ``model_dir`` (``model_class``: its causal LM, or a vision-language
    model's image-text-to-text one) in ``dtype`` (``from_pretrained``), on the CPU.
    Typed as the nn.Module it is: transformers wraps PreTrainedModel.to with functools.wraps,
    whose stub mypy does not bind as a method."""

    info = read_hf_config(model_dir)
    if info.format.weight_scales in ("row", "mx", "nvfp4") or info.format.name == "fp8_block_mxfp4":
        return _from_dequantized_copy(model_dir, dtype, info.format)
    model = _from_pretrained(model_dir, dtype)
    if info.checkpoint_format == "mxfp4":
        _mxfp4_experts_in(model, dtype)
    return model


def _from_pretrained(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """``from_pretrained`` of ``model_class``'s class, with the experts looped over in float64
    (``torch._grouped_mm`` takes no float64)."""
    import transformers

    auto = model_class(transformers.AutoConfig.from_pretrained(model_dir))
    if dtype != torch.float64:
        return auto.from_pretrained(model_dir, dtype=dtype)
    try:
        return auto.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager")
    except ValueError:  # a model without an experts implementation to choose
        return auto.from_pretrained(model_dir, dtype=dtype)


def _from_dequantized_copy(model_dir: str, dtype: torch.dtype, fmt: CheckpointFormat) -> torch.nn.Module:
    """transformers' model of a checkpoint with per-tensor or per-row fp8 scales (ModelOpt,
    compressed-tensors; ``fmt.weight_scales`` "row"), MXFP8 ones ("mx"), ModelOpt's NVFP4 weights
    ("nvfp4") or DeepSeek-V4's FP8 block weights and FP4 experts (``fp8_block_mxfp4``), which
    transformers does not load itself here (no ModelOpt reader; the compressed-tensors one needs
    that package, its MXFP8 and FP8 ones accelerate): every quantized weight
    dequantized in fp32 and rounded once to ``dtype`` (as moeshard reads them,
    ``dense.read_dense``), written with the
    other tensors under their stored names and config.json without its quantization_config into
    a temporary directory, and loaded from there with ``from_pretrained``, whose own renaming
    then applies.

    The copy is written one stored file at a time (a shard of the copy per file of the checkpoint,
    with its ``model.safetensors.index.json``), so host memory holds one file's tensors while it is
    written, then the model once while it loads; the disk holds the whole copy until then."""
    from safetensors.torch import save_file

    source = Path(model_dir)
    ckpt = SafetensorsCheckpoint(source)
    names = ckpt.names()
    quantized, scales = _quantized_tensors(ckpt, fmt)
    skip = scales | {n for n in names if n.rsplit(".", 1)[-1] in STATIC_SCALES}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        if name not in skip:
            by_file.setdefault(ckpt.info(name).file, []).append(name)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    with tempfile.TemporaryDirectory(prefix="moeshard-dequantized-") as tmp:
        weight_map: dict[str, str] = {}
        for i, (_, group) in enumerate(sorted(by_file.items())):
            shard = f"model-{i + 1:05d}-of-{len(by_file):05d}.safetensors"
            tensors = {ckpt.stored_name(name): _dequantized(ckpt, name, dtype, fmt)
                       if name in quantized else ckpt.read(name) for name in group}
            save_file(tensors, str(Path(tmp) / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, shard))
            del tensors
        (Path(tmp) / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        if (source / "generation_config.json").is_file():
            (Path(tmp) / "generation_config.json").write_text((source / "generation_config.json").read_text())
        return _from_pretrained(tmp, dtype)


def _quantized_tensors(ckpt: SafetensorsCheckpoint, fmt: CheckpointFormat) -> tuple[set[str], set[str]]:
    """(the quantized weights, the names of their scales) of ``ckpt`` as ``fmt`` stores them: uint8
    NVFP4 weights, each beside its global scale; e4m3 weights; FP4 experts, int8 / uint8 beside a
    block scale."""
    names = ckpt.names()
    if fmt.weight_scales == "nvfp4":  # uint8 e2m1 pairs, each beside its global scale
        quantized = {n for n in names if ckpt.info(n).dtype == torch.uint8 and ckpt.has(nvfp4_scale_names(n)[1])}
        return quantized, {s for n in quantized for s in nvfp4_scale_names(n)}
    quantized = {n for n in names if ckpt.info(n).dtype == torch.float8_e4m3fn}
    if fmt.name == "fp8_block_mxfp4":
        quantized |= {n for n in names if ckpt.info(n).dtype in PACKED_DTYPES
                      and any(ckpt.has(s) for s in block_scale_names(n))}
    scale_names = {"row": lambda n: (row_scale_name(n),), "mx": mxfp8_scale_names,
                   "block": block_scale_names}[fmt.weight_scales or ""]
    return quantized, {s for n in quantized for s in scale_names(n)}


def _dequantized(ckpt: SafetensorsCheckpoint, name: str, dtype: torch.dtype, fmt: CheckpointFormat) -> torch.Tensor:
    """Quantized weight ``name`` in ``dtype``: an NVFP4 one or an FP4 expert of the model's shape
    [R, 2 * (stored columns)], another of its stored shape."""
    info = ckpt.info(name)
    shape = info.shape
    if fmt.weight_scales == "nvfp4":
        return read_nvfp4(ckpt, name, (shape[0], 2 * shape[1]), dtype)
    if info.dtype in PACKED_DTYPES:
        return read_fp4(ckpt, name, (shape[0], 2 * shape[1]), dtype)
    return read_dense(ckpt, name, shape, dtype, fmt.weight_scales)


def _mxfp4_experts_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Puts the experts' weights of a model that transformers loaded from an MXFP4 checkpoint
    (and dequantized) into ``dtype``, in place.

    Why: transformers 5.17 (the GPU machine's) dequantizes MXFP4 experts to bfloat16 whatever
    dtype ``from_pretrained`` is asked for, so an fp32 or float64 reference would run its experts
    in bf16 (logits 1e-2 off at a tiny gpt-oss); 5.24 (constraints.txt) loads them in the asked
    dtype. MXFP4 values (2-bit mantissas times powers of two) are exact in bf16, so the cast
    gives the weights 5.24 loads, bit for bit."""
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and param.dtype != dtype:
            param.data = param.data.to(dtype)

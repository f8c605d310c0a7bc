"""transformers' own model of a checkpoint (every expert, one device): what ``--compare``'s
reference runs and what the checkpoint writer fills and saves, and why transformers cannot load
a checkpoint here."""

from __future__ import annotations

from pathlib import Path

import torch

from moeshard.checkpoint.hf_config import read_hf_config


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
    """transformers' causal LM from ``model_dir`` in ``dtype`` (``from_pretrained``), on the CPU.
    Typed as the nn.Module it is: transformers wraps PreTrainedModel.to with functools.wraps,
    whose stub mypy does not bind as a method."""
    import transformers

    if dtype != torch.float64:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    else:
        try:  # torch._grouped_mm takes no float64: loop over the experts
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                                      experts_implementation="eager")
        except ValueError:  # a model without an experts implementation to choose
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if read_hf_config(model_dir).checkpoint_format == "mxfp4":
        _mxfp4_experts_in(model, dtype)
    return model


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

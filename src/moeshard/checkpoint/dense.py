"""Reading one non-expert tensor whole (router, correction bias, shared experts, and the rest of a
whole model's weights), checked, in a given dtype. In an fp8 checkpoint an e4m3 weight is
dequantized with its scales, since these run in the model dtype: ``weight_scale_inv`` (DeepSeek-V4:
``scale``) per 128 x 128 tile (``CheckpointFormat.weight_scales`` "block"), ``weight_scale`` per
tensor or per output row ("row"), or an E8M0 exponent per 32 values of a row ("mx",
``checkpoint.mxfp8``); in an NVFP4 checkpoint ("nvfp4", ``checkpoint.nvfp4_modelopt``) a uint8
weight of e2m1 pairs with its e4m3 and global scales."""

from __future__ import annotations

import torch

from moeshard.checkpoint.experts import FLOAT_DTYPES, dequantize_fp8_block, read_row_scale, scale_dtypes
from moeshard.checkpoint.mxfp8 import BLOCK as MX_BLOCK
from moeshard.checkpoint.mxfp8 import dequantize_mxfp8, scale_names, stored_scale_name
from moeshard.checkpoint.names import stored_block_scale_name
from moeshard.checkpoint.nvfp4_modelopt import read_nvfp4
from moeshard.checkpoint.reader import SafetensorsCheckpoint, check_finite
from moeshard.quant import FP8_BLOCK
from moeshard.quant.fp8 import fp8_dequantize


def read_dense(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               weight_scales: str | None) -> torch.Tensor:
    """Tensor ``name`` of ``shape`` in ``dtype``. A float tensor of the checkpoint, or in an fp8
    checkpoint (``weight_scales``: its ``CheckpointFormat.weight_scales``) an e4m3 2-D weight and its
    scales, dequantized; for an integer ``dtype``
    (a lookup table: DeepSeek-V4's ``gate.tid2eid``) a tensor stored in exactly that dtype, never
    cast. ValueError naming the tensor, the file and what is wrong (shape, dtype, NaN/Inf)
    otherwise."""
    if not dtype.is_floating_point:
        ckpt.expect(name, shape, (dtype,))
        return ckpt.read(name)
    return in_dtype(*read_stored(ckpt, name, shape, weight_scales), dtype, weight_scales)


def in_dtype(t: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, weight_scales: str | None) -> torch.Tensor:
    """A tensor as ``read_stored`` gives it, in ``dtype``: a float tensor cast, or an e4m3 weight
    [R, C] dequantized in fp32 and rounded once, with its scales as ``weight_scales`` says: "row"
    [R, 1], "block" one per 128 x 128 tile, "mx" [..., C / 32] exponent bytes."""
    if scale is None:
        return t.to(dtype)
    if weight_scales == "mx":
        return dequantize_mxfp8(t, scale, dtype)
    if weight_scales == "row":
        return fp8_dequantize(t, scale).to(dtype)
    return dequantize_fp8_block(t, scale, dtype)


def read_stored(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...],
                weight_scales: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tensor ``name`` of ``shape`` as stored, checked as ``read_dense`` checks it: (the float
    tensor, None), or for an e4m3 weight of an fp8 checkpoint (``weight_scales`` "block" or "row") the
    e4m3 [R, C] codes and their fp32 scales: [ceil(R/128), ceil(C/128)] block scales, or [R, 1];
    of an MXFP8 checkpoint ("mx") the e4m3 [..., C] codes (any number of dimensions: fused experts
    too) and their uint8 exponents [..., C / 32]; of an NVFP4 checkpoint ("nvfp4") a uint8 weight
    [R, C / 2] already dequantized, in fp32 (what rounding to the model dtype then makes is the
    one rounding ``dequantize_nvfp4`` does), and None."""
    if weight_scales == "nvfp4" and len(shape) == 2 and ckpt.has(name) and ckpt.info(name).dtype == torch.uint8:
        return read_nvfp4(ckpt, name, shape, torch.float32), None
    allowed = FLOAT_DTYPES + ((torch.float8_e4m3fn,) if weight_scales else ())
    info = ckpt.expect(name, shape, allowed)
    t = ckpt.read(name)
    check_finite(t, name, info.file)
    if t.dtype != torch.float8_e4m3fn:
        return t, None
    if weight_scales == "mx":
        return t, _mx_scale(ckpt, name, shape)
    if len(shape) != 2:
        raise ValueError(f"tensor {name!r} in {str(info.file)!r}: an fp8 weight with its scales must be 2-D, "
                         f"got shape {list(shape)}")
    if weight_scales == "row":
        return t, read_row_scale(ckpt, name, shape[0])
    sname = stored_block_scale_name(ckpt.has, name)
    sinfo = ckpt.expect(sname, tuple(-(-n // FP8_BLOCK) for n in shape), scale_dtypes())
    scale = ckpt.read(sname).float()
    check_finite(scale, sname, sinfo.file)
    return t, scale


def _mx_scale(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The uint8 exponents [..., C / 32] of MXFP8 weight ``name`` of ``shape`` [..., C], under the
    first of its ``scale_names`` the checkpoint holds; ValueError naming both otherwise."""
    if not shape or shape[-1] % MX_BLOCK:
        raise ValueError(f"tensor {name!r}: an MXFP8 weight's last dimension must be a multiple of {MX_BLOCK}, got "
                         f"shape {list(shape)}")
    stored = stored_scale_name(ckpt.has, name)
    if stored is None:
        raise ValueError(f"tensor {name!r} is float8_e4m3fn, but its MXFP8 scale is missing (looked for "
                         f"{list(scale_names(name))} under {str(ckpt.model_dir)!r})")
    ckpt.expect(stored, (*shape[:-1], shape[-1] // MX_BLOCK), (torch.uint8,))
    return ckpt.read(stored)


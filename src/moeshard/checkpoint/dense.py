"""Reading one non-expert tensor whole (router, correction bias, shared experts, and the rest of a
whole model's weights), checked, in a given dtype; in an FP8 block checkpoint an fp8 weight is
dequantized with its ``weight_scale_inv`` (128 x 128 blocks), since these run in the model dtype."""

from __future__ import annotations

import torch

from moeshard.checkpoint.experts import FLOAT_DTYPES, dequantize_fp8_block, scale_dtypes
from moeshard.checkpoint.names import scale_name
from moeshard.checkpoint.reader import SafetensorsCheckpoint, check_finite
from moeshard.quant import FP8_BLOCK


def read_dense(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               fp8: bool) -> torch.Tensor:
    """Tensor ``name`` of ``shape`` in ``dtype``. A float tensor of the checkpoint, or with ``fp8``
    (an FP8 block checkpoint) an e4m3 2-D weight and its block scales; for an integer ``dtype``
    (a lookup table: DeepSeek-V4's ``gate.tid2eid``) a tensor stored in exactly that dtype, never
    cast. ValueError naming the tensor, the file and what is wrong (shape, dtype, NaN/Inf)
    otherwise."""
    if not dtype.is_floating_point:
        ckpt.expect(name, shape, (dtype,))
        return ckpt.read(name)
    return in_dtype(*read_stored(ckpt, name, shape, fp8), dtype)


def in_dtype(t: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A tensor as ``read_stored`` gives it, in ``dtype``: an fp8 weight dequantized with its
    128 x 128 block scales, a float tensor cast."""
    if scale is None:
        return t.to(dtype)
    return dequantize_fp8_block(t, scale, dtype)


def read_stored(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...],
                fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tensor ``name`` of ``shape`` as stored, checked as ``read_dense`` checks it: (the float
    tensor, None), or (the e4m3 [R, C] codes, their fp32 [ceil(R/128), ceil(C/128)] block scales)
    for an fp8 weight of an FP8 block checkpoint (``fp8``)."""
    allowed = FLOAT_DTYPES + ((torch.float8_e4m3fn,) if fp8 else ())
    info = ckpt.expect(name, shape, allowed)
    t = ckpt.read(name)
    check_finite(t, name, info.file)
    if t.dtype != torch.float8_e4m3fn:
        return t, None
    if len(shape) != 2:
        raise ValueError(f"tensor {name!r} in {str(info.file)!r}: an fp8 weight with block scales must be 2-D, "
                         f"got shape {list(shape)}")
    sname = scale_name(name)
    sinfo = ckpt.expect(sname, tuple(-(-n // FP8_BLOCK) for n in shape), scale_dtypes())
    scale = ckpt.read(sname).float()
    check_finite(scale, sname, sinfo.file)
    return t, scale

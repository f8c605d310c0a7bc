"""MXFP8 weights (microscaling FP8, as Inkling 2's MXFP8 release stores its routed experts),
dequantized to a model dtype.

A weight ``<name>`` of K input columns is stored as two tensors:

* ``<name>`` float8_e4m3fn [..., K]: the values;
* its scale (``scale_names``: ``<name>_scale``, as ``<module>.weight_scale`` for a
  ``<module>.weight``; transformers' FineGrainedFP8 spells it ``<name>_scale_inv``) uint8
  [..., K / 32]: one E8M0 exponent per 32 consecutive values along the input axis, the block's
  scale 2^(s - 127). The byte 255 is E8M0's NaN.

So ``w[..., 32 g + j] = q[..., 32 g + j] * 2^(scale[..., g] - 127)``. The blocks run along the
reduction axis: Inkling 2 stores gate_up as [E, 2I, H] (rows interleaved gate, up) with scales
[E, 2I, H / 32], and down as [E, H, I] with [E, H, I / 32].

Dequantization is exact in fp32 (an e4m3 value, a 3-bit mantissa, times a power of two, inside
fp32's exponent range for every scale a finite weight can have); the result is rounded to the
model dtype once, which is exact in bf16 too wherever it is in bf16's normal range.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeshard.checkpoint.mxfp4 import SCALE_BIAS

BLOCK = 32  # values per scale
NAN_SCALE = 255  # E8M0's NaN


def scale_names(weight_name: str) -> tuple[str, str]:
    """The names an MXFP8 weight's scale may be stored under, the release's spelling first:
    ``<name>_scale``, ``<name>_scale_inv``."""
    return weight_name + "_scale", weight_name + "_scale_inv"


def stored_scale_name(has: Callable[[str], bool], weight_name: str) -> str | None:
    """The first of ``scale_names(weight_name)`` the checkpoint holds (``has``), or None."""
    return next((n for n in scale_names(weight_name) if has(n)), None)


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "") -> torch.Tensor:
    """values: float8_e4m3fn [..., K]; scales: uint8 [..., K / 32] -> [..., K] in ``dtype``.

    ValueError, naming ``name``, when the dtypes or shapes do not match that layout or a scale is
    E8M0's NaN."""
    where = f"dequantize_mxfp8{f' ({name})' if name else ''}"
    if values.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8:
        raise ValueError(f"{where}: values must be float8_e4m3fn and scales uint8, got {values.dtype} and "
                         f"{scales.dtype}")
    if values.dim() < 1 or values.shape[-1] % BLOCK or tuple(scales.shape) != (*values.shape[:-1], values.shape[-1] // BLOCK):
        raise ValueError(f"{where}: values must be [..., K] with K a multiple of {BLOCK} and scales [..., K / {BLOCK}], "
                         f"got {list(values.shape)} and {list(scales.shape)}")
    if bool((scales == NAN_SCALE).any()):
        at = [int(i) for i in (scales == NAN_SCALE).nonzero()[0]]
        raise ValueError(f"{where}: scale {at} is {NAN_SCALE}, E8M0's NaN")
    exponent = scales.to(torch.int32) - SCALE_BIAS
    blocks = values.float().unflatten(-1, (-1, BLOCK))
    return torch.ldexp(blocks, exponent.unsqueeze(-1)).flatten(-2).to(dtype)

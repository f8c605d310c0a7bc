"""MXFP4 expert weights as gpt-oss checkpoints store them, dequantized to a model dtype.

A fused expert parameter ``<name>`` of K input columns is stored as two uint8 tensors:

* ``<name>_blocks`` [..., K / 32, 16]: 32 FP4 (e2m1) values per block, two per byte, the value at
  even position k in the low nibble and k + 1 in the high nibble. A nibble is sign (bit 3),
  exponent (bits 1-2) and mantissa (bit 0): the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives.
* ``<name>_scales`` [..., K / 32]: one E8M0 exponent per block, the block's scale 2^(s - 127).

So ``w[..., 32 g + j] = e2m1(nibble j of block g) * 2^(scales[..., g] - 127)``. The blocks run
along the reduction axis: gpt-oss stores gate_up as [E, 2I, H / 32, 16] (rows interleaved gate,
up) and down as [E, H, I / 32, 16], whatever the orientation of the model's own parameters.

Dequantization is exact in fp32 and bf16 (every value is a 2-bit mantissa times a power of two
in their exponent range); the result is rounded to the model dtype once.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
# e2m1 codes 0..15 -> values (codes 8..15 are the negatives of 0..7).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks: uint8 [..., G, 16]; scales: uint8 [..., G] -> [..., G * 32] in ``dtype``.

    ValueError when the shapes or dtypes do not match that layout."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"dequantize_mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"dequantize_mxfp4: blocks must be [..., G, {BLOCK // 2}] and scales [..., G], got "
                         f"{list(blocks.shape)} and {list(scales.shape)}")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]: even positions from the low nibble
    exponent = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponent.unsqueeze(-1))
    return out.flatten(-2).to(dtype)

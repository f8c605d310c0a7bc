"""NVFP4: e2m1 values, two per byte, one e4m3 scale per 16 values, one fp32 global scale.

e2m1 codes (4 bits: sign bit 0x8, then a 3-bit magnitude code):

    code    0    1    2    3    4    5    6    7
    value   0   0.5   1   1.5   2    3    4    6        (code | 0x8 is the negative value)

Encoding rounds to the nearest value, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
2.5 -> 2, 5 -> 4), saturates beyond 6, and keeps the sign bit of negative inputs (so -0.1
encodes as 0x8, negative zero), as the hardware conversion does. Element ``2i`` of a row goes
to the low nibble of byte ``i``, element ``2i + 1`` to the high nibble.

Scales (NVIDIA's convention; ``amax`` raised to ``AMAX_FLOOR`` first):

* global scale ``g = (FP8_MAX * E2M1_MAX) / amax = 2688 / amax`` (fp32);
* block scale ``s = e4m3(min((block_amax / 6) * g, 448))`` for each 16 values;
* codes ``q = e2m1(x * g / s)`` (0 where ``s`` rounded to 0);
* ``x ~= e2m1_value(q) * s / g``.

``swizzle_scales`` rearranges a block-scale matrix into the 128x4 tile layout that cuBLAS and
CUTLASS block-scaled GEMMs read; it is applied after dispatch, never before (its padding would
not survive an all-to-all of rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, const, fp8_float, from_wire, to_wire

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
NVFP4_GLOBAL_NUMERATOR = FP8_MAX * E2M1_MAX  # 2688.0

# Midpoints between consecutive magnitude codes i and i+1, with whether a value exactly on the
# midpoint moves up: it does when i+1 is even, which is round-half-to-even on the code.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

# The swizzled tile: 128 rows (4 groups of 32) by 4 scale columns.
_TILE_ROWS = 128
_TILE_COLS = 4


def e2m1_encode(y: Tensor) -> Tensor:
    """Rounds ``y`` (any float dtype, already divided by its scales) to e2m1 codes.

    Returns uint8 of ``y``'s shape, values 0..15. Comparisons against Python constants (no
    lookup table), so no host-to-device copy is needed on CUDA.
    """
    a = y.float().abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for midpoint, tie_up in _MIDPOINTS:
        code += (a >= midpoint if tie_up else a > midpoint).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_decode(code: Tensor) -> Tensor:
    """uint8 e2m1 codes (only the low 4 bits are read) -> fp32 values of the same shape.

    A lookup in the 16 values (made on the codes' device by ``_e2m1_value``, no host copy): one
    gather instead of a dozen elementwise passes over the codes."""
    table = _e2m1_value(torch.arange(16, dtype=torch.uint8, device=code.device))
    return table[(code & 0xF).long()]


def _e2m1_value(code: Tensor) -> Tensor:
    """The definition: e2m1 codes -> fp32 values, elementwise."""
    magnitude = code & 0x7
    exponent = (magnitude >> 1).float()
    mantissa = (magnitude & 0x1).float()
    # Exponent field 0 is subnormal (0 or 0.5); otherwise 2^(e-1) * (1 + m/2).
    value = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent - 1.0) * (1.0 + 0.5 * mantissa))
    return torch.where((code & 0x8) != 0, -value, value)


def pack_fp4(code: Tensor) -> Tensor:
    """uint8 codes ``[..., K]`` (K even) -> uint8 ``[..., K // 2]``; element 2i low nibble, 2i+1 high."""
    k = code.shape[-1]
    if k % 2:
        raise ValueError(f"pack_fp4: the last dimension K={k} must be even (two codes per byte)")
    pairs = code.reshape(*code.shape[:-1], k // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """uint8 ``[..., K // 2]`` -> uint8 codes ``[..., K]`` (inverse of ``pack_fp4``)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def nvfp4_global_scale(amax: Tensor) -> Tensor:
    """fp32 global scale ``2688 / max(amax, AMAX_FLOOR)``, same shape as ``amax``, correctly rounded."""
    amax = amax.float().clamp_min(AMAX_FLOOR)
    # Not ``2688 / amax``: Python's reflected division computes ``amax.reciprocal() * 2688``.
    return const(NVFP4_GLOBAL_NUMERATOR, amax) / amax


def _per_block(g: Tensor) -> Tensor:
    # A global scale of shape [..., 1] (one per row / expert) must broadcast against the
    # [..., K // 16, 16] block view of the data.
    return g.unsqueeze(-1) if g.dim() else g


def nvfp4_quantize(x: Tensor, global_scale: Tensor, scales_from: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Quantizes the last dimension of ``x`` to NVFP4.

    Args:
        x: float ``[..., K]`` (any float dtype), K a multiple of 16.
        global_scale: fp32 ``g`` (see ``nvfp4_global_scale``), shape ``[]`` or broadcastable to
            ``[..., 1]`` (one per row or per leading index).
        scales_from: optional tensor of ``x``'s shape whose block amaxes set the block scales
            (default ``x``'s own); values beyond them saturate at e2m1's 6.
    Returns:
        packed: uint8 ``[..., K // 2]`` e2m1 codes, two per byte.
        block_scale: float8_e4m3fn ``[..., K // 16]``, one per 16 consecutive values of ``x``.
    """
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"nvfp4: the quantized dimension K={k} must be a multiple of {NVFP4_BLOCK}")
    g = global_scale.float()
    blocks = x.float().reshape(*x.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    source = blocks if scales_from is None else scales_from.float().reshape(blocks.shape)
    amax = source.abs().amax(dim=-1)
    block_scale = ((amax / const(E2M1_MAX, amax)) * g).clamp(max=FP8_MAX).to(FP8_DTYPE)
    s = block_scale.float().unsqueeze(-1)
    # A block whose scale rounds to 0 in e4m3 holds values far below the global amax; dividing
    # by 0 would give NaN, so those blocks encode as 0 (their dequantized value is 0 anyway).
    zero = s == 0
    y = torch.where(zero, torch.zeros_like(blocks), blocks * _per_block(g) / torch.where(zero, torch.ones_like(s), s))
    return pack_fp4(e2m1_encode(y).flatten(-2)), block_scale


def nvfp4_dequantize(packed: Tensor, block_scale: Tensor, global_scale: Tensor) -> Tensor:
    """fp32 ``[..., K]`` = ``e2m1_value(q) * s / g`` (inverse of ``nvfp4_quantize``).

    Args:
        packed: uint8 ``[..., K // 2]``.
        block_scale: float8_e4m3fn ``[..., K // 16]``.
        global_scale: fp32, ``[]`` or broadcastable to ``[..., 1]``.
    """
    values = e2m1_decode(unpack_fp4(packed))
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    out = blocks * fp8_float(block_scale).unsqueeze(-1) / _per_block(global_scale.float())
    return out.flatten(-2)


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """``(M, C)`` -> ``(Mpad, Cpad)``: M rounded up to 128, C rounded up to 4."""
    return -(-rows // _TILE_ROWS) * _TILE_ROWS, -(-cols // _TILE_COLS) * _TILE_COLS


def swizzle_scales(scale: Tensor) -> Tensor:
    """Block scales ``[..., M, C]`` -> the 128x4-tile layout ``[..., Mpad, Cpad]``.

    The matrix is zero-padded to ``Mpad = roundup(M, 128)`` rows and ``Cpad = roundup(C, 4)``
    columns, viewed as ``(Mpad/128, 4, 32, Cpad/4, 4)``, permuted by ``(0, 3, 2, 1, 4)`` and
    flattened back to ``[Mpad, Cpad]``. So the scale of row ``m = 128*a + 32*b + r`` and column
    ``c = 4*d + e`` lands at flat offset ``((a * Cpad/4 + d) * 32 + r) * 16 + 4*b + e``: each
    512-byte tile holds 128 rows x 4 columns, rows ``r, r+32, r+64, r+96`` side by side.
    Leading dimensions (experts) are kept and swizzled independently. Any dtype; 1-byte dtypes
    are moved as uint8 because padding and permutes of float8 are not implemented everywhere.
    """
    rows, cols = scale.shape[-2], scale.shape[-1]
    mpad, cpad = swizzled_shape(rows, cols)
    lead = scale.shape[:-2]
    raw = to_wire(scale)
    padded = torch.zeros((*lead, mpad, cpad), dtype=raw.dtype, device=raw.device)
    padded[..., :rows, :cols] = raw
    tiles = padded.reshape(*lead, mpad // _TILE_ROWS, 4, 32, cpad // _TILE_COLS, _TILE_COLS)
    n = len(lead)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return from_wire(tiles.permute(order).reshape(*lead, mpad, cpad), scale.dtype)


def unswizzle_scales(swizzled: Tensor, rows: int, cols: int) -> Tensor:
    """Inverse of ``swizzle_scales``: ``[..., Mpad, Cpad]`` -> the original ``[..., rows, cols]``.

    Raises:
        ValueError: when the last two dimensions are not ``swizzled_shape(rows, cols)``.
    """
    mpad, cpad = swizzled_shape(rows, cols)
    if tuple(swizzled.shape[-2:]) != (mpad, cpad):
        raise ValueError(f"unswizzle_scales: swizzled.shape[-2:]={tuple(swizzled.shape[-2:])} does not match "
                         f"rows={rows}, cols={cols} (expected ({mpad}, {cpad}))")
    lead = swizzled.shape[:-2]
    n = len(lead)
    raw = to_wire(swizzled)
    tiles = raw.reshape(*lead, mpad // _TILE_ROWS, cpad // _TILE_COLS, 32, 4, _TILE_COLS)
    # The permutation swaps two axes, so it is its own inverse.
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)
    flat = tiles.permute(order).reshape(*lead, mpad, cpad)
    return from_wire(flat[..., :rows, :cols].contiguous(), swizzled.dtype)

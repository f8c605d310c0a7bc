"""DeepSeek-V4's FP8 release: FP8 block dense weights and FP4 routed experts, dequantized to a
model dtype as they are read (quantization_config quant_method ``fp8``, weight_block_size
[128, 128], scale_fmt ``ue8m0``, expert_dtype ``fp4``; transformers' FineGrainedFP8 layout).

* A dense weight (attention, shared experts) ``<module>.weight`` float8_e4m3fn [R, C] has one
  UE8M0 scale per 128 x 128 tile, ``<module>.scale`` float8_e8m0fnu [ceil(R/128), ceil(C/128)]
  (transformers' name ``weight_scale_inv`` is read too: ``names.block_scale_names``). These are
  the FP8 block checkpoints' weights with power-of-two scales (``dense.read_stored``).
* A routed expert's weight ``<module>.weight`` of the model's shape [R, C] is stored as int8
  [R, C / 2]: two e2m1 values a byte, the value at even column k in the low nibble and k + 1 in
  the high nibble (the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), with one E8M0
  exponent per 32 values of a row, ``<module>.scale`` float8_e8m0fnu [R, C / 32] (uint8 bytes
  are read too): the block's scale 2^(s - 127), s = 255 being E8M0's NaN.

So ``w[r, 32 g + j] = e2m1(r, 32 g + j) * 2^(scale[r, g] - 127)``: MXFP4 values and scales, one
tensor per expert and projection. Dequantization is exact in fp32 and bf16 (a 2-bit mantissa
times a power of two); the result is rounded to the model dtype once.
"""

from __future__ import annotations

import torch

from moeshard.checkpoint.mxfp4 import BLOCK, dequantize_mxfp4
from moeshard.checkpoint.mxfp8 import NAN_SCALE
from moeshard.checkpoint.names import block_scale_names, stored_block_scale_name
from moeshard.checkpoint.reader import SafetensorsCheckpoint, torch_dtype

PACKED_DTYPES = (torch.int8, torch.uint8)


def exponent_dtypes() -> tuple[torch.dtype, ...]:
    """How the experts' exponents may be stored: uint8 bytes and, where this torch has it (2.7+),
    float8_e8m0fnu. Looked up when needed, so that importing this module works on older torch."""
    e8m0 = torch_dtype("F8_E8M0")
    return (torch.uint8,) + ((e8m0,) if e8m0 is not None else ())


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "") -> torch.Tensor:
    """packed: int8 or uint8 [..., C / 2]; scales: float8_e8m0fnu or uint8 [..., C / 32] -> [..., C]
    in ``dtype``.

    ValueError, naming ``name``, when the dtypes or shapes do not match that layout or a scale is
    E8M0's NaN."""
    where = f"dequantize_fp4{f' ({name})' if name else ''}"
    if packed.dtype not in PACKED_DTYPES or scales.dtype not in exponent_dtypes():
        raise ValueError(f"{where}: the weight must be int8 or uint8 and its scales float8_e8m0fnu or uint8, got "
                         f"{packed.dtype} and {scales.dtype}")
    columns = 2 * packed.shape[-1] if packed.dim() else 0
    if packed.dim() < 1 or columns % BLOCK or tuple(scales.shape) != (*packed.shape[:-1], columns // BLOCK):
        raise ValueError(f"{where}: the weight must be [..., C / 2] and its scales [..., C / {BLOCK}] with C a multiple "
                         f"of {BLOCK}, got {list(packed.shape)} and {list(scales.shape)}")
    exponents = scales.view(torch.uint8)
    if bool((exponents == NAN_SCALE).any()):
        at = [int(i) for i in (exponents == NAN_SCALE).nonzero()[0]]
        raise ValueError(f"{where}: scale {at} is {NAN_SCALE}, E8M0's NaN")
    blocks = packed.view(torch.uint8).unflatten(-1, (-1, BLOCK // 2))
    return dequantize_mxfp4(blocks, exponents, dtype)


def scale_of(ckpt: SafetensorsCheckpoint, name: str) -> str:
    """The scale tensor of expert weight ``name`` the checkpoint holds (transformers'
    ``weight_scale_inv`` or the release's ``.scale``); the release's where it holds neither."""
    return stored_block_scale_name(ckpt.has, name, missing=block_scale_names(name)[-1])


def check_fp4(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...]) -> None:
    """From the headers alone: FP4 expert weight ``name`` of the model's ``shape`` [R, C] is stored
    as int8 / uint8 [R, C / 2] with its scale [R, C / 32]; ValueError naming the tensor that is
    missing or misshapen otherwise."""
    rows, cols = shape
    if cols % BLOCK:
        raise ValueError(f"tensor {name!r}: an FP4 expert weight's columns must be a multiple of {BLOCK}, got shape "
                         f"{list(shape)}")
    ckpt.expect(name, (rows, cols // 2), PACKED_DTYPES)
    ckpt.expect(scale_of(ckpt, name), (rows, cols // BLOCK), exponent_dtypes())


def read_fp4(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             index: tuple[slice, slice] | None = None) -> torch.Tensor:
    """FP4 expert weight ``name`` of the model's ``shape`` [R, C], dequantized to ``dtype``
    (``check_fp4``); with ``index`` (rows, columns of the model's weight on 32-value blocks) only
    that part."""
    check_fp4(ckpt, name, shape)
    r, c = index or (slice(None), slice(None))
    lo, hi, _ = c.indices(shape[1])
    if lo % BLOCK or hi % BLOCK:
        raise ValueError(f"read_fp4({name!r}): columns [{lo}, {hi}) do not start and end on {BLOCK}-value blocks")
    packed, scales = ckpt.read_many([(name, (r, slice(lo // 2, hi // 2))),
                                     (scale_of(ckpt, name), (r, slice(lo // BLOCK, hi // BLOCK)))])
    return dequantize_fp4(packed, scales, dtype, name)

"""NVFP4 weights as NVIDIA ModelOpt exports them (``quant_algo`` NVFP4), dequantized to a model dtype.

A linear weight ``<module>.weight`` [N, K] is stored as three tensors:

* ``<module>.weight`` uint8 [N, K / 2]: two e2m1 values a byte, the value at even column k in the
  low nibble and k + 1 in the high nibble (sign, two exponent bits, one mantissa bit: 0, 0.5, 1,
  1.5, 2, 3, 4, 6 and their negatives);
* ``<module>.weight_scale`` float8_e4m3fn [N, K / 16]: one scale per 16 values of a row;
* ``<module>.weight_scale_2`` fp32, one value (shape [] or [1]): the weight's global scale.

So ``w[n, 16 g + j] = (e2m1(n, 16 g + j) * weight_scale[n, g]) * weight_scale_2``, computed in
fp32 (the first product is exact there) and rounded to the model dtype once. The export's static
``input_scale`` is not used: moeshard quantizes activations dynamically, or not at all.
"""

from __future__ import annotations

import torch

from moeshard.checkpoint.mxfp4 import E2M1
from moeshard.checkpoint.reader import SafetensorsCheckpoint

GROUP = 16  # values per e4m3 scale


def scale_names(weight_name: str) -> tuple[str, str]:
    """(the per-group scale, the global scale) of NVFP4 weight ``weight_name``."""
    return weight_name + "_scale", weight_name + "_scale_2"


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype,
                     name: str = "") -> torch.Tensor:
    """packed: uint8 [..., K / 2]; scale: float8_e4m3fn [..., K / 16]; global_scale: one fp32 value
    -> [..., K] in ``dtype``.

    ValueError, naming ``name``, when the dtypes or shapes do not match that layout, or a scale is
    not finite or negative."""
    where = f"dequantize_nvfp4{f' ({name})' if name else ''}"
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{where}: the weight must be uint8 and its scale float8_e4m3fn, got {packed.dtype} and "
                         f"{scale.dtype}")
    if packed.dim() < 1 or (2 * packed.shape[-1]) % GROUP or \
            tuple(scale.shape) != (*packed.shape[:-1], 2 * packed.shape[-1] // GROUP):
        raise ValueError(f"{where}: the weight must be [..., K / 2] and its scale [..., K / {GROUP}] with K a multiple "
                         f"of {GROUP}, got {list(packed.shape)} and {list(scale.shape)}")
    if global_scale.numel() != 1:
        raise ValueError(f"{where}: the global scale must hold one value, got shape {list(global_scale.shape)}")
    s, g = scale.float(), global_scale.float().reshape(())
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()) or not bool(torch.isfinite(g)) or float(g) < 0:
        raise ValueError(f"{where}: its scales must be finite and >= 0 (global {float(g):.6g}, per-group from "
                         f"{float(s.min()):.6g} to {float(s.max()):.6g})")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    values = torch.stack([lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]], dim=-1).flatten(-2)
    return ((values.unflatten(-1, (-1, GROUP)) * s.unsqueeze(-1)).flatten(-2) * g).to(dtype)


def check_nvfp4(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...]) -> None:
    """From the headers alone: NVFP4 weight ``name`` of the model's ``shape`` [R, C] is stored as
    uint8 [R, C / 2] with its ``weight_scale`` e4m3 [R, C / 16] and one float ``weight_scale_2``;
    ValueError naming the tensor that is missing or misshapen otherwise."""
    rows, cols = shape
    if cols % GROUP:
        raise ValueError(f"tensor {name!r}: an NVFP4 weight's columns must be a multiple of {GROUP}, got shape "
                         f"{list(shape)}")
    group, global_name = scale_names(name)
    ckpt.expect(name, (rows, cols // 2), (torch.uint8,))
    ckpt.expect(group, (rows, cols // GROUP), (torch.float8_e4m3fn,))
    info = ckpt.info(global_name)  # a missing one is named by info
    if info.shape not in ((), (1,)) or not info.dtype.is_floating_point:
        raise ValueError(f"tensor {global_name!r} in {str(info.file)!r}: an NVFP4 global scale must be one float, got "
                         f"{info.dtype} {list(info.shape)}")


def read_nvfp4(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               index: tuple[slice, slice] | None = None) -> torch.Tensor:
    """NVFP4 weight ``name`` of the model's ``shape`` [R, C], dequantized to ``dtype``: the stored
    uint8 [R, C / 2] with its ``weight_scale`` [R, C / 16] and ``weight_scale_2`` (``check_nvfp4``);
    with ``index`` (rows, columns of the model's weight on 16-value groups) only that part."""
    check_nvfp4(ckpt, name, shape)
    group, global_name = scale_names(name)
    r, c = index or (slice(None), slice(None))
    lo, hi, _ = c.indices(shape[1])
    if lo % GROUP or hi % GROUP:
        raise ValueError(f"read_nvfp4({name!r}): columns [{lo}, {hi}) do not start and end on {GROUP}-value groups")
    packed, scale = ckpt.read_many([(name, (r, slice(lo // 2, hi // 2))), (group, (r, slice(lo // GROUP, hi // GROUP)))])
    return dequantize_nvfp4(packed, scale, ckpt.read(global_name).float(), dtype, name)
